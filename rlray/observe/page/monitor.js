// rlray's live page: polls /health, /api/metrics and /api/samples and draws inline SVG charts. Which charts, with
// which keys, comes from /api/charts (the metric registry's CHARTS, rlray/observe/metrics.py), read once.
// No library and no network beyond the monitor itself. Data reaches the DOM through textContent and
// setAttribute only (never innerHTML), so a completion holding "<script>" shows as text.
"use strict";

const POLL_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg"; // the SVG namespace name, not a URL that is fetched
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#475569", "#ea580c"];
const state = {charts: null, historyId: null, since: 0, points: [], drawn: false, klLimit: null, bands: [], sampleStep: "latest", samples: null, sort: {key: "reward", desc: true}};

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function fmt(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  if (v !== 0 && (Math.abs(v) >= 1e5 || Math.abs(v) < 1e-3)) return v.toExponential(2);
  return String(Number(v.toPrecision(4)));
}

async function getJSON(url) {
  const response = await fetch(url, {cache: "no-store"});
  const doc = await response.json();
  if (!response.ok) throw new Error(doc.error || response.statusText);
  return doc;
}

// ---- status ------------------------------------------------------------------------------
async function pollHealth() {
  const h = await getJSON("/health");
  const set = (id, value) => { document.getElementById(id).textContent = fmt(value); };
  set("run-id", h.run_id);
  const status = document.getElementById("status");
  status.textContent = (h.reason ? `${h.status} (${h.reason})` : h.status) + (h.source === "mlflow" ? ", read from MLflow" : "");
  status.className = `status-${h.status}`;
  set("step", h.step); set("epoch", h.epoch); set("policy-version", h.policy_version); set("restarts", h.restarts);
  set("snapshot", h.snapshot_step === null ? "none yet" : `step ${h.snapshot_step}`);
  set("heartbeat", `${Math.round(h.seconds_since_heartbeat)} s ago`);
  const list = document.getElementById("alerts");
  list.replaceChildren(...h.alerts.slice().reverse().map((a) => el("li", null, a.step === null ? `${a.kind}: ${a.message}` : `${a.kind} at step ${a.step}: ${a.message}`)));
}

// ---- curves ------------------------------------------------------------------------------
async function pollMetrics() {
  if (state.charts === null) state.charts = await getJSON("/api/charts"); // {charts, meanings, term}
  let doc = await getJSON(`/api/metrics?since=${state.since}`);
  if (state.historyId !== null && doc.history_id !== state.historyId) { // steps ran again (rollback, restart)
    state.points = []; state.since = 0; state.drawn = false;
    doc = await getJSON("/api/metrics?since=0");
  }
  state.historyId = doc.history_id;
  state.klLimit = doc.kl_limit;
  state.bands = doc.bands || [];
  if (doc.points.length || !state.drawn) { // redraw only when there is something new
    state.points.push(...doc.points);
    if (state.points.length) state.since = state.points[state.points.length - 1].step;
    drawCharts();
    state.drawn = true;
  }
}

function niceTicks(lo, hi, count) {
  const span = hi - lo;
  const raw = span / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => span / s <= count) || 10 * mag;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

// Each chart plots its keys that the run logged, in the chart's order; a chart with reward_terms also plots every
// logged key that no chart names (the monitor sends only charted keys, so those are the reward terms' means), by name.
function drawCharts() {
  const logged = new Set();
  for (const p of state.points) for (const k of Object.keys(p.values)) logged.add(k);
  const named = new Set(state.charts.charts.flatMap((c) => c.keys));
  const terms = [...logged].filter((k) => !named.has(k)).sort();
  const boxes = state.charts.charts.map((spec) => drawChart(spec, [...spec.keys.filter((k) => logged.has(k)), ...(spec.reward_terms ? terms : [])]));
  document.getElementById("charts").replaceChildren(...boxes);
}

function drawChart(spec, keys) {
  const box = el("div", "chart");
  box.append(el("h2", null, spec.title));
  const series = keys.map((k) => ({key: k, pts: state.points.map((p) => [p.step, p.values[k]]).filter((xy) => xy[1] !== undefined)}));
  const limit = spec.guard_line ? state.klLimit : null;
  const bands = state.bands.filter((b) => keys.includes(b.metric) && (b.low !== null || b.high !== null));
  const values = series.flatMap((s) => s.pts.map((xy) => xy[1])).filter((v) => v !== null);
  if (!values.length) {
    box.append(el("div", "empty", state.points.length ? "not logged by this run" : "waiting for the first step"));
    return box;
  }
  const W = 440, H = 200, L = 56, R = 10, T = 8, B = 24;
  const steps = series.flatMap((s) => s.pts.map((xy) => xy[0]));
  let [x0, x1] = [Math.min(...steps), Math.max(...steps)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  let [y0, y1] = [Math.min(...values), Math.max(...values)];
  if (limit !== null) { y0 = Math.min(y0, limit); y1 = Math.max(y1, limit); }
  for (const b of bands) for (const v of [b.low, b.high]) if (v !== null) { y0 = Math.min(y0, v); y1 = Math.max(y1, v); }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${spec.title}, y axis in ${spec.unit}`});
  root.append(svg("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "#fff", stroke: "#d1d5db"}));
  for (const b of bands) { // the healthy band, shaded
    const top = Y(b.high === null ? y1 : b.high), bottom = Y(b.low === null ? y0 : b.low);
    root.append(svg("rect", {x: L, y: top, width: W - L - R, height: Math.max(bottom - top, 0), fill: "#dcfce7", "fill-opacity": 0.7, class: "band"}));
  }
  for (const t of niceTicks(y0, y1, 4)) {
    root.append(svg("line", {x1: L, x2: W - R, y1: Y(t), y2: Y(t), stroke: "#f3f4f6"}));
    const label = svg("text", {x: L - 4, y: Y(t) + 4, "text-anchor": "end", "font-size": 10, fill: "#6b7280"});
    label.textContent = fmt(t);
    root.append(label);
  }
  for (const t of niceTicks(x0, x1, 5).filter((t) => Number.isInteger(t))) {
    const label = svg("text", {x: X(t), y: H - 8, "text-anchor": "middle", "font-size": 10, fill: "#6b7280"});
    label.textContent = String(t);
    root.append(label);
  }
  if (limit !== null) {
    root.append(svg("line", {x1: L, x2: W - R, y1: Y(limit), y2: Y(limit), stroke: "#dc2626", "stroke-dasharray": "5 4"}));
    const label = svg("text", {x: W - R - 4, y: Y(limit) - 4, "text-anchor": "end", "font-size": 10, fill: "#dc2626"});
    label.textContent = `guard ${fmt(limit)}`;
    root.append(label);
  }
  const legend = el("div", "legend");
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    let run = [];
    const flush = () => {
      if (run.length === 1) root.append(svg("circle", {cx: run[0][0], cy: run[0][1], r: 2.5, fill: color}));
      if (run.length > 1) root.append(svg("polyline", {points: run.map((xy) => xy.join(",")).join(" "), fill: "none", stroke: color, "stroke-width": 1.6}));
      run = [];
    };
    for (const [x, y] of s.pts) {
      if (y === null) { flush(); continue; }
      run.push([X(x).toFixed(1), Y(y).toFixed(1)]);
    }
    flush();
    const last = s.pts.length ? s.pts[s.pts.length - 1][1] : null;
    const item = el("span");
    item.setAttribute("title", state.charts.meanings[s.key] || state.charts.term); // what the key holds, and its unit
    const swatch = el("span", "swatch");
    swatch.style.background = color;
    item.append(swatch, document.createTextNode(`${s.key} ${fmt(last)}`));
    legend.append(item);
  });
  const left = []; // steps outside a band: a red triangle on the curve (at the top edge for NaN), and a line below
  for (const p of state.points) {
    for (const s of series) {
      const reason = (p.outside || {})[s.key];
      if (!reason) continue;
      const v = p.values[s.key];
      const cx = X(p.step), cy = v === null || v === undefined ? T + 6 : Y(v);
      const marker = svg("polygon", {points: `${cx},${cy - 6} ${cx - 5},${cy + 4} ${cx + 5},${cy + 4}`, fill: "#dc2626", class: "band-marker"});
      const title = svg("title");
      title.textContent = `step ${p.step}: ${reason}`;
      marker.append(title);
      root.append(marker);
      left.push(`step ${p.step}: ${reason}`);
    }
  }
  box.append(root, legend);
  if (left.length) box.append(el("div", "band-note", `outside its band at ${left.length} step(s); last: ${left[left.length - 1]}`));
  return box;
}

// ---- samples -----------------------------------------------------------------------------
async function pollSamples() {
  const latest = await getJSON("/api/samples");
  updateStepChoices(latest.steps);
  if (state.sampleStep === "latest") {
    if (!state.samples || state.samples.step !== latest.step) { state.samples = latest; drawSamples(); }
    return;
  }
  if (!state.samples || state.samples.step !== Number(state.sampleStep)) {
    try {
      state.samples = await getJSON(`/api/samples?step=${encodeURIComponent(state.sampleStep)}`);
      note("");
    } catch (err) {
      note(err.message);
      state.sampleStep = "latest"; state.samples = latest;
    }
    drawSamples();
  }
}

function note(text) { document.getElementById("note").textContent = text; }

function updateStepChoices(steps) {
  const select = document.getElementById("sample-step");
  const wanted = ["latest", ...steps.slice().reverse().map(String)];
  const have = [...select.options].map((o) => o.value);
  if (wanted.join() !== have.join()) {
    select.replaceChildren(...wanted.map((v) => { const o = el("option", null, v === "latest" ? "latest" : `step ${v}`); o.value = v; return o; }));
  }
  select.value = wanted.includes(String(state.sampleStep)) ? String(state.sampleStep) : "latest";
}

function sortValue(sample, key) {
  const v = key === "reward" || key === "advantage" ? sample[key] : sample.terms[key];
  return typeof v === "number" ? v : null;
}

function drawSamples() {
  const table = document.getElementById("sample-table");
  const doc = state.samples;
  if (!doc || !doc.samples.length) {
    table.tHead.replaceChildren();
    table.tBodies[0].replaceChildren();
    if (!document.getElementById("note").textContent) note("no samples yet (tracking.samples_per_step > 0 keeps some each step)");
    return;
  }
  const terms = [...new Set(doc.samples.flatMap((s) => Object.keys(s.terms)))].sort();
  const episodes = doc.samples.some((s) => s.num_turns !== null && s.num_turns !== undefined); // older rows lack the field
  const columns = [["reward", true], ["advantage", true], ...terms.map((t) => [t, true]), ["stop reason"],
    ...(episodes ? [["turns"]] : []), ["tokens"], ["policy version"], ["prompt"], ["completion"]];
  const head = el("tr");
  for (const [name, sortable] of columns) {
    const arrow = state.sort.key === name ? (state.sort.desc ? " \u25bc" : " \u25b2") : "";
    const th = el("th", sortable ? "sortable" : null, name + arrow);
    if (sortable) th.addEventListener("click", () => { state.sort = {key: name, desc: state.sort.key === name ? !state.sort.desc : true}; drawSamples(); });
    head.append(th);
  }
  table.tHead.replaceChildren(head);
  const rows = doc.samples.slice().sort((a, b) => {
    const va = sortValue(a, state.sort.key), vb = sortValue(b, state.sort.key);
    if (va === null || vb === null) return (va === null) - (vb === null); // missing values last
    return state.sort.desc ? vb - va : va - vb;
  });
  table.tBodies[0].replaceChildren(...rows.map((s) => {
    const tr = el("tr");
    const num = (v) => el("td", "num" + (v === "failed" ? " failed" : v === null ? " skipped" : ""), v === null ? "skipped" : fmt(v));
    tr.append(el("td", "num" + (s.reward === null ? " failed" : ""), s.reward === null ? "failed" : fmt(s.reward)));
    tr.append(el("td", "num", fmt(s.advantage)));
    for (const t of terms) tr.append(t in s.terms ? num(s.terms[t]) : el("td", "skipped", "-"));
    tr.append(el("td", null, s.stop_reason || s.finish_reason));
    if (episodes) tr.append(el("td", "num", s.num_turns === null || s.num_turns === undefined ? "-" : s.num_turns));
    tr.append(el("td", "num", s.response_tokens), el("td", "num", versionRange(s)));
    const prompt = el("td", "text");
    prompt.append(el("div", null, s.prompt));
    tr.append(prompt, completionCell(s));
    return tr;
  }));
}

// The versions that sampled a response: "1", or "0\u21922" for a generation that took weight updates (a partial
// rollout; rows without version_parts, older ones too, show their policy_version).
function versionRange(s) {
  const parts = s.version_parts || [];
  return parts.length ? `${parts[0].version}\u2192${parts[parts.length - 1].version}` : s.policy_version;
}

// A response whose tokens came from several policy versions, each part in order, with a marker where the weights
// changed (its title says from which token); one text otherwise.
function versionedText(s) {
  const parts = s.version_parts || [];
  if (!parts.length) return el("div", null, s.completion);
  const box = el("div");
  let start = 0;
  for (const [i, p] of parts.entries()) {
    if (i > 0) {
      const mark = el("span", "ver-mark", `v${p.version}`);
      mark.setAttribute("title", `weights updated during the generation: policy version ${p.version} from token ${start + 1}`);
      box.append(mark);
    }
    const text = el("span", null, p.text);
    text.setAttribute("title", `policy version ${p.version}: tokens ${start + 1}-${start + p.tokens}`);
    box.append(text);
    start += p.tokens;
  }
  return box;
}

// An episode turn by turn: the model's turns and the environment's observations set apart, each turn with the
// environment's reward after it; a single-turn row (or one whose turns cannot be told apart) as one text. A segment of
// an agent episode cut where the agent rewrote its history says which segment it is. A sample without a reward starts
// with why (its environment's or reward function's error). Then each judge's raw output on the sample (older rows
// lack the field).
function completionCell(s) {
  const td = el("td", "text");
  if (s.failure) td.append(el("div", "failed failure", "no reward: " + s.failure));
  const segments = s.segments || [];
  if (!segments.length) td.append(versionedText(s));
  else td.append(turnsBox(s, segments));
  for (const [name, text] of Object.entries(s.judge_outputs || {}).sort()) {
    const part = el("div", "seg seg-judge");
    part.append(el("span", "seg-label", `judge ${name}`), el("div", null, text));
    td.append(part);
  }
  return td;
}

function turnsBox(s, segments) {
  const box = el("div");
  if (Number.isInteger(s.segment) && s.segment >= 0) {
    box.append(el("div", "seg-label", `segment ${s.segment + 1}: the agent rewrote its history here, so this part of ` +
      "the episode is trained as a sequence of its own"));
  }
  let turn = 0;
  for (const seg of segments) {
    const part = el("div", `seg seg-${seg.role === "assistant" ? "assistant" : "observation"}`);
    let label = "observation";
    if (seg.role === "assistant") {
      turn += 1;
      const r = (s.turn_rewards || [])[turn - 1];
      label = `turn ${turn}` + (r === null || r === undefined ? "" : ` \u00b7 env reward ${fmt(r)}`);
    }
    part.append(el("span", "seg-label", label), el("div", null, seg.text));
    box.append(part);
  }
  return box;
}

// ---- loop --------------------------------------------------------------------------------
document.getElementById("sample-step").addEventListener("change", (event) => {
  state.sampleStep = event.target.value; state.samples = null; note("");
  pollSamples().catch((err) => note(err.message));
});

async function poll() {
  const results = await Promise.allSettled([pollHealth(), pollMetrics(), pollSamples()]);
  for (const r of results) if (r.status === "rejected") console.warn("rlray page:", r.reason);
  setTimeout(poll, POLL_MS);
}
poll();
