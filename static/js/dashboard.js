// The dashboard's own glue: the API token on every request, JSON bodies for the REST API,
// messages for what a button did or why it was refused, and the "data is stale" state.
(function () {
  "use strict";
  const TOKEN_KEY = "vllm-manager-token";
  const STALE_AFTER_MS = 3500; // the stream sends every second; three missed updates is stale

  // --- API token: stored in this browser, sent as a Bearer header on every htmx request -------
  document.addEventListener("htmx:configRequest", (evt) => {
    const token = localStorage.getItem(TOKEN_KEY);
    if (token) evt.detail.headers["Authorization"] = "Bearer " + token;
  });

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
    if (xhr.status === 401) {
      return "This manager needs an API token for changes: enter it under \"API token\" (top right).";
    }
    try {
      const body = JSON.parse(xhr.responseText);
      if (typeof body.detail === "string") return body.detail;
      if (Array.isArray(body.detail)) {
        return body.detail.map((d) => (d.loc ? d.loc.slice(1).join(".") + ": " : "") + d.msg).join("; ");
      }
    } catch (e) { /* not JSON: fall through */ }
    return "The request failed (HTTP " + xhr.status + ")";
  }

  document.addEventListener("htmx:responseError", (evt) => flash(errorText(evt.detail.xhr), "error"));
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
  });

  setInterval(() => {
    if (!document.querySelector("[sse-connect]") || !lastMessageAt) return;
    const age = Date.now() - lastMessageAt;
    if (age > STALE_AFTER_MS) {
      const why = connected ? "no update from the manager" : "not connected";
      setLive("stale", `Data is stale: ${why} for ${Math.round(age / 1000)} s. Reconnecting…`);
    }
  }, 1000);

  // --- the token form -------------------------------------------------------------------------
  document.addEventListener("DOMContentLoaded", () => {
    const form = document.getElementById("token-form");
    const input = document.getElementById("api-token");
    if (!form || !input) return;
    input.value = localStorage.getItem(TOKEN_KEY) || "";
    form.addEventListener("submit", (evt) => {
      evt.preventDefault();
      const value = input.value.trim();
      if (value) localStorage.setItem(TOKEN_KEY, value); else localStorage.removeItem(TOKEN_KEY);
      flash(value ? "Token saved in this browser" : "Token removed", "ok");
    });
    document.getElementById("token-clear").addEventListener("click", () => {
      localStorage.removeItem(TOKEN_KEY);
      input.value = "";
      flash("Token removed", "ok");
    });
  });
})();
