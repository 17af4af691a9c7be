// The dashboard page: polls /api/state and redraws. Plain DOM and uPlot (vendored).
"use strict";

const PHASE_COLORS = ["#6366f1", "#0ea5e9", "#10b981", "#f59e0b", "#ef4444", "#8b5cf6"];
const KIND_COLORS = {planned: "#2563eb", straggler: "#d97706", crash: "#dc2626",
                     hang: "#dc2626", host: "#dc2626", commerr: "#dc2626"};
const WORKER_COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2",
                       "#be185d", "#4b5563"];
let trainingPlot = null, workersPlot = null, workersKey = "", state = null;
const openDetails = new Set();

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}
const ms = (s) => s == null ? "-" : (s * 1000).toFixed(1);
const secs = (s) => s == null ? "-" : (s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s");
// A planned migration's downtime is measured against the spread of normal steps: one inside
// that spread (or below zero) is no measurable stall, and a number would mean nothing. The
// server words it (downtime_text, core/accounting.py), as status, report and demo do.
function downtime(it) {
  return it.downtime_text || "downtime not measured";
}

function markInterruptions(u) {
  // vertical lines where each interruption ended, coloured by kind
  const ctx = u.ctx;
  for (const it of (state ? state.interruptions : [])) {
    const x = u.valToPos(it.t, "x", true);
    if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
    ctx.save();
    ctx.strokeStyle = KIND_COLORS[it.kind] || "#111";
    ctx.lineWidth = 2 * devicePixelRatio;
    ctx.setLineDash(it.status === "done" ? [] : [4, 4]);
    ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height);
    ctx.stroke(); ctx.restore();
  }
}

function width(id) { return document.getElementById(id).clientWidth || 900; }

function drawTraining(s) {
  const xs = s.series.map(r => r[0]), loss = s.series.map(r => r[2]),
        tps = s.series.map(r => r[3]);
  const data = [xs, loss, tps];
  if (!trainingPlot) {
    trainingPlot = new uPlot({
      width: width("chart-training"), height: 260,
      scales: {x: {time: false}},
      axes: [{label: "seconds since start"}, {label: "loss"},
             {side: 1, scale: "tps", label: "tokens/s", grid: {show: false}}],
      series: [{label: "t (s)"}, {label: "loss", stroke: "#1d4ed8", width: 1.5},
               {label: "tokens/s", stroke: "#059669", scale: "tps", width: 1}],
      hooks: {draw: [markInterruptions]},
    }, data, document.getElementById("chart-training"));
  } else {
    trainingPlot.setData(data);
  }
}

function drawWorkers(s) {
  const names = Object.keys(s.perf).sort();
  if (!names.length) return;
  const steps = [...new Set(names.flatMap(w => s.perf[w].map(r => r[0])))].sort((a, b) => a - b);
  const data = [steps, ...names.map(w => {
    const by = new Map(s.perf[w].map(r => [r[0], r[2] * 1000]));
    return steps.map(x => by.has(x) ? by.get(x) : null);
  })];
  const key = names.join(",");
  if (!workersPlot || key !== workersKey) {
    if (workersPlot) workersPlot.destroy();
    workersKey = key;
    workersPlot = new uPlot({
      width: width("chart-workers"), height: 220, scales: {x: {time: false}},
      axes: [{label: "step"}, {label: "compute ms"}],
      series: [{label: "step"}, ...names.map((w, i) => ({
        label: w, stroke: WORKER_COLORS[i % WORKER_COLORS.length], width: 1.5,
        spanGaps: true}))],
    }, data, document.getElementById("chart-workers"));
  } else {
    workersPlot.setData(data);
  }
}

function drawTables(s) {
  const st = s.status;
  const roles = document.querySelector("#roles tbody"), standbys = document.querySelector("#standbys tbody");
  const checked = new Set([...roles.querySelectorAll("input:checked")].map(i => i.value));
  roles.replaceChildren(); standbys.replaceChildren();
  if (!st) return;
  for (const w of st.workers) {
    const p = w.perf || {}, wait = p.wait_s ? Object.values(p.wait_s).reduce((a, b) => a + b, 0) : null;
    const box = el("input", {type: "checkbox", value: w.name});
    box.checked = checked.has(w.name);
    roles.append(el("tr", {"data-worker": w.name, class: w.alive ? "" : "dead"},
      el("td", {}, box), el("td", {text: w.name}), el("td", {text: w.role}),
      el("td", {text: w.node}), el("td", {text: w.pid ?? "-"}), el("td", {text: ms(p.step_s)}),
      el("td", {text: ms(p.compute_s)}), el("td", {text: ms(wait)})));
  }
  for (const sb of st.standbys) {
    standbys.append(el("tr", {"data-standby": sb.name, class: sb.alive ? "" : "dead"},
      el("td", {text: sb.name}), el("td", {text: sb.state}), el("td", {text: sb.node}),
      el("td", {text: sb.pid ?? "-"})));
  }
}

function drawInterruptions(s) {
  const box = document.getElementById("interruptions");
  for (const d of box.querySelectorAll("details[open]")) openDetails.add(d.dataset.title);
  for (const d of box.querySelectorAll("details:not([open])")) openDetails.delete(d.dataset.title);
  if (!s.interruptions.length) return;
  box.replaceChildren();
  for (const it of [...s.interruptions].reverse()) {
    const total = it.phases.reduce((a, p) => a + p.seconds, 0) || 1;
    const bar = el("div", {class: "bar"});
    const rows = el("tbody");
    it.phases.forEach((p, i) => {
      const seg = el("div", {class: "phase" + (p.stalled ? "" : " background"),
                             title: `${p.label}: ${secs(p.seconds)}`, "data-phase": p.name});
      seg.style.width = (100 * p.seconds / total) + "%";
      seg.style.background = PHASE_COLORS[i % PHASE_COLORS.length];
      bar.append(seg);
      rows.append(el("tr", {}, el("td", {text: p.label + (p.stalled ? "" : " (training went on)")}),
                     el("td", {text: secs(p.seconds)})));
    });
    const summary = el("summary", {}, el("span", {class: "kind " + it.kind, text: it.kind}), " ",
      `${it.title} ${it.status}: ${it.workers.join(", ")}` +
      (it.step != null ? ` at step ${it.step}` : "") + ` — ${downtime(it)}` +
      (it.reason ? ` (${it.reason})` : ""));
    const d = el("details", {class: "interruption", "data-title": it.title}, summary, bar,
                 el("table", {class: "phases"}, rows));
    if (openDetails.has(it.title)) d.open = true;
    box.append(d);
  }
}

function drawLists(s) {
  const strag = document.getElementById("stragglers");
  if (s.stragglers.length) {
    strag.replaceChildren(...s.stragglers.map(x => el("li", {
      text: `${x.worker} (${x.role}) score ${x.score} vs ${x.reference} at step ${x.step}`})));
  }
  document.getElementById("events").replaceChildren(...[...s.events].reverse().map(e => {
    const {time, t, worker, event, ...rest} = e;
    const detail = Object.entries(rest).filter(([k, v]) => typeof v !== "object")
      .map(([k, v]) => `${k}=${v}`).join(" ");
    return el("li", {"data-event": event, text: `+${t.toFixed(1)} s ${worker || ""} ${event} ${detail}`});
  }));
  document.getElementById("requests").replaceChildren(...s.requests.map(r => el("li", {
    text: `${r.what} ${(r.workers || []).join(", ")}${r.host != null ? " host " + r.host : ""}: ` +
          `${r.status}${r.reason ? " (" + r.reason + ")" : ""}`})));
}

function drawHeadline(s) {
  document.getElementById("job-name").textContent = s.name;
  const st = s.status, last = s.series[s.series.length - 1];
  const steps = s.started && s.started.steps ? "/" + s.started.steps : "";
  const warm = st ? st.standbys.filter(x => x.state === "warm" && x.alive).length : 0;
  const parts = [
    st ? `step ${st.committed_step}${steps}` : (last ? `step ${last[1] + 1}${steps}` : "step -"),
    last && last[2] != null ? `loss ${last[2].toFixed(4)}` : "",
    last && last[3] != null ? `${Math.round(last[3])} tok/s` : "",
    st ? `${st.workers.length} workers, ${warm} warm standbys` : "",
    st && (st.migration_in_flight || st.recovery_in_flight) ?
      "in flight: " + [st.migration_in_flight && `migration ${st.migration_in_flight}`,
                       st.recovery_in_flight && `recovery ${st.recovery_in_flight}`].filter(Boolean).join(", ") : "",
    s.ended ? `ended (${s.ended.event})` : "",
  ];
  document.getElementById("headline").textContent = parts.filter(Boolean).join("  ·  ");
  const err = document.getElementById("status-error");
  err.hidden = !s.status_error || !!s.ended;
  err.textContent = s.status_error || "";
}

async function refresh() {
  try {
    const r = await fetch("/api/state", {credentials: "same-origin"});
    if (!r.ok) throw new Error(`${r.status} ${await r.text()}`);
    state = await r.json();
    drawHeadline(state); drawTables(state); drawInterruptions(state); drawLists(state);
    drawTraining(state); drawWorkers(state);
    document.body.dataset.loaded = "1";
  } catch (e) {
    const err = document.getElementById("status-error");
    err.hidden = false; err.textContent = "cannot read the job's state: " + e.message;
  }
  setTimeout(refresh, 1000 * (state ? state.refresh_s : 1));
}

async function ask(path, body) {
  const out = document.getElementById("action-result");
  const r = await fetch(path, {method: "POST", credentials: "same-origin",
    headers: {"Content-Type": "application/json", "X-Trainmover": "1"}, body: JSON.stringify(body)});
  const answer = await r.json();
  out.textContent = r.ok ? `asked: ${path.split("/").pop()} ${(answer.workers || []).join(", ")}`
                         : `refused: ${answer.error}`;
}

document.getElementById("migrate-btn").addEventListener("click", () => {
  const workers = [...document.querySelectorAll("#roles input:checked")].map(i => i.value);
  if (!workers.length) { document.getElementById("action-result").textContent = "select a worker first"; return; }
  ask("/api/migrate", {workers});
});
document.getElementById("drain-btn").addEventListener("click", () => {
  ask("/api/drain", {host: document.getElementById("drain-host").value});
});
refresh();
