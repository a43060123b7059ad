// rolloutlake live dashboard: sealed-step metrics and group decisions over server-sent
// events, drawn with uPlot (vendored). Streams are read with fetch, not EventSource, so
// the bearer token travels in the Authorization header instead of the URL.
"use strict";

const TOKEN_KEY = "rolloutlake.token";
const RENDER_DELAY_MS = 50;   // coalesces a burst of events (the backlog) into one redraw
const LENGTHS_EVERY_MS = 2000; // the length histogram is a heavier read: at most this often
const GROUP_ROWS = 15;

const C = {
  kept: "#1a7f37", surplus: "#8c959f", right: "#0969da", wrong: "#fb8500",
  aborted: "#cf222e", missing: "#bf3989", timeout: "#6e7781", cancelled: "#8250df",
  raw: "#0969da", unfiltered: "#cf222e", episode: "#1a7f37", cost: "#6639ba", time: "#57606a",
};
const OTHER = ["#953800", "#0550ae", "#4d2d00", "#7d4e00", "#116329", "#a40e26"];
const DASHES = [[], [8, 4], [2, 3], [12, 4, 2, 4]];

// -- token and HTTP -------------------------------------------------------------------
const params = new URLSearchParams(location.search);
if (params.has("token")) {
  sessionStorage.setItem(TOKEN_KEY, params.get("token"));
  params.delete("token");  // keep the token out of history, bookmarks and screenshots
  history.replaceState(null, "", location.pathname + (params.size ? "?" + params : ""));
}
const token = sessionStorage.getItem(TOKEN_KEY) || "";
const authHeaders = (extra = {}) => (token ? { ...extra, Authorization: "Bearer " + token } : extra);
const $ = (id) => document.getElementById(id);

class AuthError extends Error {}

async function getJSON(url) {
  const resp = await fetch(url, { headers: authHeaders() });
  if (resp.status === 401 || resp.status === 403) throw new AuthError((await resp.json()).detail);
  if (!resp.ok) throw new Error(`${url}: HTTP ${resp.status}`);
  return resp.json();
}

function askToken(message) {
  $("auth").hidden = false;
  $("dashboard").hidden = true;
  $("auth-message").textContent = message || "This gateway needs a bearer token with read scope.";
  setStatus("error", "not authorized");
}

// Server-sent events over fetch; reconnects with Last-Event-ID so nothing is lost or repeated.
async function follow(url, onEvent) {
  let lastId = null;
  for (;;) {
    try {
      const resp = await fetch(url, { headers: authHeaders(lastId ? { "Last-Event-ID": lastId } : {}) });
      if (resp.status === 401 || resp.status === 403) return askToken((await resp.json()).detail);
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      setStatus("live");
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        const blocks = (buf + value).split("\n\n");
        buf = blocks.pop();
        for (const block of blocks) {
          let id = null, type = "message", data = "";
          for (const line of block.split("\n")) {
            if (line.startsWith("id: ")) id = line.slice(4);
            else if (line.startsWith("event: ")) type = line.slice(7);
            else if (line.startsWith("data: ")) data += line.slice(6);
          }
          if (!data) continue;
          if (id !== null) lastId = id;
          onEvent(type, JSON.parse(data));
        }
      }
    } catch (err) {
      console.warn("stream", url, err);
    }
    setStatus("error", "reconnecting…");
    await new Promise((r) => setTimeout(r, 1000));
  }
}

// -- state ----------------------------------------------------------------------------
const stats = { events: 0, renders: 0, lastRenderMs: 0, maxRenderMs: 0, steps: {}, renderedAt: 0 };
const charts = {};
const runs = [];          // {id, steps: [], metrics: [], sealedAt: []}
const groups = [];        // latest group decisions of the first run, newest first
let lengths = null;
window.dash = { stats, charts, runs };

function setStatus(kind, text) {
  const el = $("status");
  el.className = "status " + kind;
  if (kind === "live") {
    const first = runs[0];
    const n = first ? first.steps.length : 0;
    const last = n ? `step ${first.steps[n - 1]} sealed ${fmtTime(first.sealedAt[n - 1])}` : "no sealed step yet";
    el.textContent = `live · ${n} steps · ${last}`;
  } else {
    el.textContent = text;
  }
}

const fmtTime = (iso) => (iso ? new Date(iso).toLocaleTimeString([], { hour12: false }) : "-");
const fmt = (v, d = 3) => (v === undefined || v === null || Number.isNaN(v) ? "-" : (+v).toFixed(d));

// -- series ---------------------------------------------------------------------------
const DROP = "rollout/dynamic_filter/drop_";

function reasonColor(reason, i) {
  if (/^zero_std_1(\.0)?$/.test(reason)) return C.right;
  if (/^zero_std_0(\.0)?$/.test(reason)) return C.wrong;
  if (reason === "group_has_aborted") return C.aborted;
  if (reason === "group_has_missing_reward") return C.missing;
  if (reason === "group_timeout") return C.timeout;
  return OTHER[i % OTHER.length];
}

function zeroStd(m, one) {
  const re = one ? /^rollout\/(dynamic_filter\/drop_zero_std_|zero_std\/count_)1(\.0)?$/
                 : /^rollout\/(dynamic_filter\/drop_zero_std_|zero_std\/count_)0(\.0)?$/;
  // No key means no such group in the step (Miles omits zero counts): plot 0, not a gap.
  let total = 0;
  for (const k in m) if (re.test(k)) total += m[k];
  return total;
}

const perRun = (label, color, get, extra = {}) => ({ label, color, get, ...extra });

// Each chart: which runs it shows, its series (functions of a step's metrics) and axes.
function chartSpecs() {
  const first = runs[0];
  const reasons = new Set();
  for (const m of first.metrics) for (const k in m) if (k.startsWith(DROP)) reasons.add(k.slice(DROP.length));
  const layers = [
    perRun("kept", C.kept, (m) => m["rollout/groups_kept"]),
    perRun("surplus", C.surplus, (m) => m["rollout/groups_surplus"]),
    ...[...reasons].sort().map((r, i) => perRun("dropped " + r, reasonColor(r, i), (m) => m[DROP + r] ?? 0)),
    perRun("cancelled at seal", C.cancelled, (m) => m["rollout/groups_cancelled"] ?? m["rollout/cancelled/groups"]),
  ];
  return {
    groups: { runs: [first], series: layers, stacked: true, axes: ["groups"], fromZero: true },
    reward: { runs, series: [
      perRun("raw_reward (kept)", C.raw, (m) => m["rollout/raw_reward"]),
      perRun("raw_reward_unfiltered", C.unfiltered, (m) => m["rollout/raw_reward_unfiltered"]),
      perRun("episode_raw_reward", C.episode, (m) => m["rollout/episode_raw_reward"]),
    ], axes: ["reward"] },
    zerostd: { runs, series: [
      perRun("all right (reward 1)", C.right, (m) => zeroStd(m, true)),
      perRun("all wrong (reward 0)", C.wrong, (m) => zeroStd(m, false)),
    ], axes: ["groups"], fromZero: true },
    cost: { runs, series: [
      perRun("prompts issued / kept group", C.cost, (m) => {
        const kept = m["rollout/groups_kept"];
        return kept ? m["rollout/prompts_issued"] / kept : null;
      }),
      perRun("rollout time (s)", C.time, (m) => m["perf/rollout_time"], { scale: "s" }),
    ], axes: ["prompts / kept group", "seconds"] },
    bias: { runs, series: [
      perRun("completion bias", C.unfiltered, (m) => m["rollout/completion_bias"]),
      perRun("cancelled groups", C.cancelled, (m) => m["rollout/cancelled/groups"] ?? m["rollout/groups_cancelled"], { scale: "n" }),
    ], axes: ["share never finished", "groups"], fromZero: true },
  };
}

function alignedX(shown) {
  if (shown.length === 1) return { x: shown[0].steps, index: null };
  const all = new Set();
  for (const r of shown) for (const s of r.steps) all.add(s);
  const x = Float64Array.from(all).sort();
  const index = new Map();
  x.forEach((s, i) => index.set(s, i));
  return { x, index };
}

function buildData(spec) {
  const { x, index } = alignedX(spec.runs);
  const data = [x];
  for (const run of spec.runs) {
    for (const s of spec.series) {
      const y = new Array(x.length).fill(null);
      for (let i = 0; i < run.steps.length; i++) {
        const v = s.get(run.metrics[i]);
        y[index ? index.get(run.steps[i]) : i] = v === undefined ? null : v;
      }
      data.push(y);
    }
  }
  if (!spec.stacked) return data;
  // Stacked bars: each layer is drawn as the running total, top layer first, so the
  // lower layers paint over it; the legend shows the layer's own value.
  const raw = data.slice(1);
  const cum = [];
  let acc = new Array(x.length).fill(0);
  for (const y of raw) {
    acc = acc.map((a, i) => a + (y[i] || 0));
    cum.push(acc);
  }
  spec.raw = raw;
  return [x, ...cum.reverse()];
}

function seriesOptions(spec) {
  const out = [{ label: "step" }];
  const multi = spec.runs.length > 1;
  if (spec.stacked) {
    const layers = [...spec.series].reverse();
    const n = layers.length;
    layers.forEach((s, j) => out.push({
      label: s.label, stroke: s.color, fill: s.color + "cc", width: 0,
      paths: uPlot.paths.bars({ size: [1, 40], gap: 0 }), points: { show: false },
      value: (u, v, si, i) => (i == null || !u._raw ? "-" : fmt(u._raw[n - si][i], 0)),
    }));
    return out;
  }
  spec.runs.forEach((run, ri) => spec.series.forEach((s) => out.push({
    label: multi ? `${run.id} · ${s.label}` : s.label,
    stroke: s.color, width: 2, dash: DASHES[ri % DASHES.length], scale: s.scale || "y",
    spanGaps: true, points: { show: false }, value: (u, v) => fmt(v),
  })));
  return out;
}

function axesOptions(spec) {
  const font = "13px system-ui, sans-serif";
  const axes = [{ label: "step", font, labelFont: font }, { label: spec.axes[0], font, labelFont: font, size: 60 }];
  if (spec.axes[1]) {
    const scale = spec.series.find((s) => s.scale).scale;
    axes.push({ label: spec.axes[1], scale, side: 1, grid: { show: false }, font, labelFont: font, size: 60 });
  }
  return axes;
}

// Counts read wrong on an axis that starts at the smallest value: those start at 0.
function scalesOptions(spec) {
  const scales = { x: { time: false } };
  if (spec.fromZero) {
    const range = (u, min, max) => [0, max > 0 ? max * 1.1 : 1];
    for (const key of new Set(["y", ...spec.series.map((s) => s.scale).filter(Boolean)])) {
      scales[key] = { range };
    }
  }
  return scales;
}

function chartSize(el) {
  return { width: Math.max(300, el.clientWidth), height: 250 };
}

function draw(name, spec) {
  const el = $("chart-" + name);
  const data = buildData(spec);
  const signature = seriesOptions(spec).map((s) => s.label).join("|");
  let chart = charts[name];
  if (!chart || chart._signature !== signature) {
    // New series (a drop reason seen for the first time, an overlay): rebuild the chart.
    if (chart) chart.destroy();
    chart = new uPlot({
      ...chartSize(el), series: seriesOptions(spec), axes: axesOptions(spec),
      scales: scalesOptions(spec), legend: { live: true },
      cursor: { drag: { x: true, y: false } },
    }, data, el);
    chart._signature = signature;
    charts[name] = chart;
  } else {
    chart.setData(data);
  }
  chart._raw = spec.raw;
}

function drawLengths() {
  if (!lengths || !lengths.edges.length) return;
  const el = $("chart-lengths");
  const e = lengths.edges;
  const x = e.slice(0, -1).map((v, i) => (v + e[i + 1]) / 2);
  const classes = [["kept", C.kept], ["dropped", C.wrong], ["cancelled", C.cancelled]];
  // Shares, not counts: kept rows outnumber the rest, and the shapes are what differ.
  const data = [x, ...classes.map(([c]) => {
    const n = lengths.n[c] || 1;
    return lengths.counts[c].map((k) => k / n);
  })];
  const series = [{ label: "tokens" }, ...classes.map(([c, color]) => ({
    label: `${c} (n=${lengths.n[c]}, mean ${fmt(lengths.mean[c], 0)})`, stroke: color,
    fill: color + "33", width: 2, paths: uPlot.paths.stepped({ align: 1 }), points: { show: false },
    value: (u, v) => fmt(v, 3),
  }))];
  const signature = series.map((s) => s.label).join("|");
  if (charts.lengths) charts.lengths.destroy();  // labels carry n and mean: rebuild
  const font = "13px system-ui, sans-serif";
  charts.lengths = new uPlot({
    ...chartSize(el), series, scales: { x: { time: false } },
    axes: [{ label: "response length (tokens)", font, labelFont: font },
           { label: "share of class", font, labelFont: font, size: 60 }],
  }, data, el);
  charts.lengths._signature = signature;
}

function renderSummary() {
  const parts = runs.map((run) => {
    const n = run.steps.length;
    if (!n) return `<span><b>${run.id}</b>: no sealed step yet</span>`;
    const m = run.metrics[n - 1];
    let dropped = 0;
    for (const k in m) if (k.startsWith(DROP)) dropped += m[k];
    return `<span><b>${run.id}</b> step <b>${run.steps[n - 1]}</b>: kept <b>${fmt(m["rollout/groups_kept"], 0)}</b>,
      dropped <b>${fmt(dropped, 0)}</b>, cancelled <b>${fmt(m["rollout/groups_cancelled"], 0)}</b>,
      raw_reward <b>${fmt(m["rollout/raw_reward"])}</b>, unfiltered <b>${fmt(m["rollout/raw_reward_unfiltered"])}</b>,
      completion bias <b>${fmt(m["rollout/completion_bias"], 2)}</b></span>`;
  });
  $("summary").innerHTML = parts.join("");
}

let renderTimer = null;
function scheduleRender() {
  if (renderTimer === null) renderTimer = setTimeout(render, RENDER_DELAY_MS);
}

function render() {
  renderTimer = null;
  const t0 = performance.now();
  const specs = chartSpecs();
  for (const name in specs) draw(name, specs[name]);
  renderSummary();
  setStatus("live");
  stats.lastRenderMs = performance.now() - t0;
  stats.maxRenderMs = Math.max(stats.maxRenderMs, stats.lastRenderMs);
  stats.renders += 1;
  stats.renderedAt = Date.now();
  for (const run of runs) stats.steps[run.id] = run.steps.length ? run.steps[run.steps.length - 1] : null;
}

// -- group table and audit -------------------------------------------------------------
function renderGroups() {
  const run = runs[0].id;
  $("groups-body").innerHTML = groups.map((g) => {
    const kind = g.reason === "cancelled_at_seal" ? "cancelled" : g.decision;
    return `<tr><td>${g.group_index}</td><td>${g.step ?? "-"}</td>
      <td><span class="badge ${kind}">${g.decision}</span></td><td>${g.reason ?? ""}</td>
      <td>${fmt(g.mean_reward)}</td><td>${fmtTime(g.decided_at)}</td>
      <td><a href="/v1/runs/${encodeURIComponent(run)}/groups/${g.group_index}" data-group="${g.group_index}">audit</a></td></tr>`;
  }).join("");
}

async function openAudit(groupIndex) {
  const run = runs[0].id;
  $("audit").hidden = false;
  $("audit-title").textContent = `run ${run} · group ${groupIndex}`;
  $("audit-body").textContent = "loading…";
  try {
    const body = await getJSON(`/v1/runs/${encodeURIComponent(run)}/groups/${groupIndex}`);
    $("audit-body").textContent = JSON.stringify(body, null, 2);
  } catch (err) {
    $("audit-body").textContent = String(err);
  }
}

let lengthsTimer = null;
function scheduleLengths() {
  if (lengthsTimer !== null) return;
  lengthsTimer = setTimeout(async () => {
    try {
      lengths = await getJSON(`/v1/runs/${encodeURIComponent(runs[0].id)}/response-lengths`);
      drawLengths();
    } catch (err) {
      console.warn("lengths", err);
    }
    lengthsTimer = null;
  }, LENGTHS_EVERY_MS);
}

// -- pages ----------------------------------------------------------------------------
async function showRuns() {
  $("title").textContent = "runs";
  $("runs").hidden = false;
  try {
    const list = await getJSON("/v1/dashboard/runs");
    $("runs-body").innerHTML = list.map((r) => `<tr><td><a href="/runs/${encodeURIComponent(r.run_id)}">${r.run_id}</a></td>
      <td>${r.steps}</td><td>${r.last_step}</td><td>${new Date(r.last_sealed_at).toLocaleString()}</td></tr>`).join("")
      || `<tr><td colspan="4">no run has a sealed step yet</td></tr>`;
    setStatus("live", "");
    $("status").textContent = `${list.length} runs`;
  } catch (err) {
    if (err instanceof AuthError) askToken(err.message); else setStatus("error", String(err));
  }
}

function showRun(ids) {
  $("dashboard").hidden = false;
  $("compare-form").hidden = false;
  $("title").textContent = ids.join(" vs ");
  document.title = `rolloutlake · ${ids.join(" vs ")}`;
  $("compare").value = ids.slice(1).join(",");
  for (const id of ids) {
    const run = { id, steps: [], metrics: [], sealedAt: [] };
    runs.push(run);
    follow(`/v1/runs/${encodeURIComponent(id)}/metrics/stream`, (type, ev) => {
      if (type !== "step") return;
      run.steps.push(ev.step);
      run.metrics.push(ev.metrics);
      run.sealedAt.push(ev.sealed_at);
      stats.events += 1;
      scheduleRender();
      if (run === runs[0]) scheduleLengths();
    });
  }
  follow(`/v1/runs/${encodeURIComponent(ids[0])}/decisions/stream`, (type, g) => {
    if (type !== "group") return;
    groups.unshift(g);
    groups.length = Math.min(groups.length, GROUP_ROWS);
    renderGroups();
  });
  scheduleLengths();
}

$("auth-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value);
  location.reload();
});
$("compare-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const q = $("compare").value.trim();
  location.search = q ? "?compare=" + encodeURIComponent(q) : "";
});
$("groups-body").addEventListener("click", (e) => {
  const a = e.target.closest("a[data-group]");
  if (!a) return;
  e.preventDefault();  // the audit route needs the Authorization header: fetch it here
  openAudit(a.dataset.group);
});
$("audit-close").addEventListener("click", () => { $("audit").hidden = true; });
window.addEventListener("resize", () => {
  for (const name in charts) charts[name].setSize(chartSize($("chart-" + name)));
});

const match = location.pathname.match(/^\/runs\/([^/]+)$/);
if (match) {
  const compare = (params.get("compare") || "").split(",").map((s) => s.trim()).filter(Boolean);
  showRun([decodeURIComponent(match[1]), ...compare.filter((c) => c !== match[1])]);
} else {
  showRuns();
}
