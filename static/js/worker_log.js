// The worker page's log tail: lines from the logs SSE stream, as text (never as HTML).
(function () {
  "use strict";
  const MAX_LINES = 2000;
  const pre = document.getElementById("log");
  const status = document.getElementById("log-status");
  if (!pre) return;
  const source = new EventSource(pre.dataset.stream);
  let lines = 0;
  let opened = false;

  source.addEventListener("open", () => {
    // The stream replays its tail on every connection: start over rather than show lines twice.
    if (opened) { pre.textContent = ""; lines = 0; }
    opened = true;
    status.textContent = "following";
  });
  source.addEventListener("error", () => { status.textContent = "disconnected: reconnecting…"; });
  source.addEventListener("log", (msg) => {
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 20;
    pre.appendChild(document.createTextNode(msg.data + "\n"));
    lines++;
    if (lines > MAX_LINES) { pre.removeChild(pre.firstChild); lines--; }
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  });
})();
