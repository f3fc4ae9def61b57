// Live uPlot charts. Each .chart element names its series (names or globs as the history API
// takes them); the chart loads the window's history once, then appends each snapshot's values.
(function () {
  "use strict";
  const WINDOW_S = { "15m": 900, "1h": 3600, "24h": 86400 };
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d"];
  let windowName = "15m";
  let workers = {}; // id -> model, from the latest snapshot, for labels
  const charts = {};
  window.dashboardCharts = charts;

  function globToRegExp(pattern) {
    const escaped = pattern.replace(/[.+^${}()|[\]\\]/g, "\\$&").replace(/\*/g, ".*").replace(/\?/g, ".");
    return new RegExp("^" + escaped + "$");
  }

  function label(name) {
    let m = name.match(/^gpu\.(\d+)\./);
    if (m) return "GPU " + m[1];
    m = name.match(/^worker\.([^.]+)\.(.*)$/);
    if (m) {
      const who = workers[m[1]] ? `#${m[1]} ${workers[m[1]]}` : `#${m[1]}`;
      return m[2].startsWith("prompt") ? who + " prompt" : who;
    }
    return name.replace(/^host\./, "").replace(/_/g, " ");
  }

  function formatter(unit) {
    if (unit === "bytes") {
      return (v) => {
        if (v == null) return "n/a";
        const units = ["B", "KiB", "MiB", "GiB", "TiB"];
        let i = 0;
        while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
        return v.toFixed(i ? 1 : 0) + " " + units[i];
      };
    }
    return (v) => (v == null ? "n/a" : (Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(1)) + " " + unit);
  }

  class Chart {
    constructor(el) {
      this.el = el;
      this.key = el.dataset.key;
      this.patterns = el.dataset.series.split(",");
      this.regexps = this.patterns.map(globToRegExp);
      this.unit = el.dataset.unit;
      this.names = [];
      this.data = null;
      this.plot = null;
      this.loading = null;
      el.innerHTML = `<h3>${el.dataset.title}</h3><div class="plot"></div><p class="chart-empty muted"></p>`;
    }

    matches(name) { return this.regexps.some((r) => r.test(name)); }

    async load() {
      const query = this.patterns.map((p) => "series=" + encodeURIComponent(p)).join("&");
      const resp = await fetch(`/api/metrics/history?${query}&window=${windowName}`);
      if (!resp.ok) { this.empty("history unavailable: HTTP " + resp.status); return; }
      const body = await resp.json();
      this.names = Object.keys(body.series).sort();
      const times = new Set();
      for (const n of this.names) for (const [t] of body.series[n]) times.add(t);
      const xs = Array.from(times).sort((a, b) => a - b);
      const index = new Map(xs.map((t, i) => [t, i]));
      const columns = this.names.map((n) => {
        const col = new Array(xs.length).fill(null);
        for (const [t, v] of body.series[n]) col[index.get(t)] = v;
        return col;
      });
      this.data = [xs, ...columns];
      this.draw();
    }

    empty(text) {
      if (this.plot) { this.plot.destroy(); this.plot = null; }
      this.el.querySelector(".chart-empty").textContent = text;
      this.el.classList.add("is-empty");
    }

    draw() {
      if (!this.names.length) { this.empty(this.el.dataset.empty || "no data yet"); return; }
      this.el.classList.remove("is-empty");
      this.el.querySelector(".chart-empty").textContent = "";
      if (this.plot) this.plot.destroy();
      const fmt = formatter(this.unit);
      const box = this.el.querySelector(".plot");
      this.plot = new uPlot({
        width: Math.max(box.clientWidth, 280),
        height: 170,
        legend: { live: true },
        // The x axis always spans the chosen window, so a fresh chart does not stretch 3 points.
        scales: { x: { time: true, range: (u, min, max) => [max - WINDOW_S[windowName], max] }, y: { range: (u, min, max) => [Math.min(0, min), max > 0 ? max * 1.1 : 1] } },
        axes: [{}, { values: (u, vals) => vals.map(fmt), size: 80 }],
        series: [{}, ...this.names.map((n, i) => ({
          label: label(n), stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: false, value: (u, v) => fmt(v),
        }))],
      }, this.data, box);
    }

    // One snapshot: append its values, drop what fell out of the window; new series reload.
    push(payload) {
      if (!this.data || this.loading) return;
      const names = Object.keys(payload.series).filter((n) => this.matches(n)).sort();
      const fresh = names.filter((n) => !this.names.includes(n) && payload.series[n] != null);
      if (fresh.length) { this.reload(); return; }
      if (!this.names.length) return;
      const xs = this.data[0];
      const t = payload.taken_at;
      if (xs.length && windowName === "24h" && t - xs[xs.length - 1] < 60) return; // minute points
      if (xs.length && t <= xs[xs.length - 1]) return;
      xs.push(t);
      this.names.forEach((n, i) => this.data[i + 1].push(n in payload.series ? payload.series[n] : null));
      const cutoff = t - WINDOW_S[windowName];
      let drop = 0;
      while (drop < xs.length && xs[drop] < cutoff) drop++;
      if (drop) this.data = this.data.map((col) => col.slice(drop));
      this.plot.setData(this.data);
    }

    reload() {
      if (this.loading) return;
      this.loading = this.load().catch((e) => this.empty("history unavailable: " + e)).finally(() => { this.loading = null; });
    }

    resize() {
      if (this.plot) this.plot.setSize({ width: Math.max(this.el.querySelector(".plot").clientWidth, 280), height: 170 });
    }
  }

  function onSnapshot(payload) {
    if (window.dashboardSeen) window.dashboardSeen();
    workers = {};
    for (const w of payload.workers) workers[w.id] = w.model;
    for (const chart of Object.values(charts)) chart.push(payload);
  }

  // The snapshot event carries JSON, not HTML: listen on the EventSource htmx opened, once each.
  const hooked = new WeakSet();
  document.addEventListener("htmx:sseOpen", (evt) => {
    const source = evt.detail.source;
    if (hooked.has(source)) return;
    hooked.add(source);
    source.addEventListener("snapshot", (msg) => onSnapshot(JSON.parse(msg.data)));
  });

  function setWindow(name) {
    windowName = name;
    for (const b of document.querySelectorAll("[data-window]")) b.setAttribute("aria-pressed", String(b.dataset.window === name));
    for (const chart of Object.values(charts)) chart.reload();
  }

  function init() {
    for (const el of document.querySelectorAll(".chart[data-series]")) charts[el.dataset.key] = new Chart(el);
    for (const b of document.querySelectorAll("[data-window]")) b.addEventListener("click", () => setWindow(b.dataset.window));
    window.addEventListener("resize", () => Object.values(charts).forEach((c) => c.resize()));
    setWindow(windowName);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init); else init();
})();
