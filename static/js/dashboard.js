// The dashboard's own glue: JSON bodies for the REST API, messages for what a button did or why
// it was refused, the way back to the login page when the session has ended, and the "data is
// stale" state. The session is an HttpOnly cookie from /login: no script here sees the token.
(function () {
  "use strict";
  const STALE_AFTER_MS = 3500; // the stream sends every second; three missed updates is stale

  // Earlier versions kept the API token in localStorage; the login page's cookie replaced it.
  localStorage.removeItem("vllm-manager-token");

  function toLogin() {
    window.location.assign("/login?next=" + encodeURIComponent(location.pathname + location.search));
  }

  // --- json-body: the REST API takes JSON; forms with hx-ext="json-body" send their fields so -----
  htmx.defineExtension("json-body", {
    onEvent(name, evt) {
      if (name === "htmx:configRequest") evt.detail.headers["Content-Type"] = "application/json";
    },
    encodeParameters(xhr, parameters) {
      xhr.overrideMimeType("text/json");
      const body = {};
      for (const [key, value] of parameters.entries()) body[key] = value;
      return JSON.stringify(body);
    },
  });

  // --- messages -------------------------------------------------------------------------------
  function flash(text, kind) {
    const box = document.getElementById("flash");
    if (!box) return;
    const item = document.createElement("p");
    item.className = "flash-item " + (kind || "info");
    item.textContent = text;
    box.appendChild(item);
    setTimeout(() => item.remove(), kind === "error" ? 12000 : 4000);
  }
  window.dashboardFlash = flash;

  function errorText(xhr) {
    try {
      const body = JSON.parse(xhr.responseText);
      if (typeof body.detail === "string") return body.detail;
    } catch (e) { /* not JSON: fall through */ }
    return "The request failed (HTTP " + xhr.status + ")";
  }

  document.addEventListener("htmx:responseError", (evt) => {
    if (evt.detail.xhr.status === 401) toLogin(); // not logged in, or the session has ended
    else flash(errorText(evt.detail.xhr), "error");
  });
  document.addEventListener("htmx:sendError", () =>
    flash("The manager cannot be reached; is it running?", "error"));
  document.addEventListener("htmx:afterRequest", (evt) => {
    const elt = evt.detail.elt;
    if (evt.detail.successful && elt && elt.dataset && elt.dataset.done) flash(elt.dataset.done, "ok");
  });

  // --- live state: fresh while messages arrive, stale when they stop ----------------------------
  let lastMessageAt = 0;
  let connected = false;

  function setLive(state, text) {
    document.body.dataset.live = state;
    const banner = document.getElementById("stale-banner");
    const status = document.getElementById("live-status");
    if (status) status.textContent = state === "fresh" ? "live" : state;
    if (!banner) return;
    banner.hidden = state !== "stale";
    if (text) banner.textContent = text;
  }

  function seen() {
    lastMessageAt = Date.now();
    if (document.body.dataset.live !== "fresh") setLive("fresh");
  }
  window.dashboardSeen = seen;

  document.addEventListener("htmx:sseOpen", () => { connected = true; });
  document.addEventListener("htmx:sseMessage", seen);
  document.addEventListener("htmx:sseError", () => {
    connected = false;
    setLive("stale", "Connection to the manager lost: the figures below are stale. Reconnecting…");
    // A stream refused because the session ended looks like a lost connection: ask once.
    fetch(location.pathname + location.search, { method: "HEAD" })
      .then((resp) => { if (resp.status === 401) toLogin(); })
      .catch(() => { /* the manager is down: the banner says so */ });
  });

  setInterval(() => {
    const stream = document.querySelector("[sse-connect]");
    // A stream that sends only when something changes (data-changes-only) may rightly be silent for long:
    // only a lost connection (htmx:sseError above) makes its page stale.
    if (!stream || stream.hasAttribute("data-changes-only") || !lastMessageAt) return;
    const age = Date.now() - lastMessageAt;
    if (age > STALE_AFTER_MS) {
      const why = connected ? "no update from the manager" : "not connected";
      setLive("stale", `Data is stale: ${why} for ${Math.round(age / 1000)} s. Reconnecting…`);
    }
  }, 1000);
})();
