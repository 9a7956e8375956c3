// The keepstep dashboard page: polls the JSON routes of server.py and draws with plotly.js.
// Live runs are polled every POLL_MS; a finished run is drawn once and left alone.
"use strict";

const POLL_MS = 2000;
const PHASES = ["detect", "agree", "communicator", "restore", "replan", "first-step"];
const METRIC_COLORS = ["#8e44ad", "#3b6fd8", "#1f9d55", "#f3a712", "#e4572e", "#669bbc"];
const PHASE_COLORS = {
  detect: "#e4572e", agree: "#f3a712", communicator: "#a8c686",
  restore: "#669bbc", replan: "#8e7dbe", "first-step": "#b0b7c3",
};
const LAYOUT = {
  margin: { l: 60, r: 20, t: 50, b: 45 },
  paper_bgcolor: "#fff", plot_bgcolor: "#fff",
  font: { family: "system-ui, sans-serif", size: 12 },
};
const CONFIG = { displaylogo: false, responsive: true, displayModeBar: "hover" };

const state = { run: null, timer: null };
// What tests and people poking in the console can read: the last view drawn.
window.keepstep = { view: null, draws: 0 };

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`;
}

function setText(id, text) { document.getElementById(id).textContent = text; }

async function getJSON(path) {
  const reply = await fetch(path, { cache: "no-store" });
  if (!reply.ok) throw new Error(`${path}: ${reply.status}`);
  return reply.json();
}

// Recoveries drawn as shaded bands on the time charts, faults as dashed lines.
function recoveryShapes(view) {
  const shapes = [];
  for (const r of view.recoveries) {
    const end = r.end === null ? view.world.t[view.world.t.length - 1] : r.end;
    shapes.push({
      type: "rect", xref: "x", yref: "paper", x0: r.start, x1: end, y0: 0, y1: 1,
      fillcolor: "#e4572e", opacity: 0.15, line: { width: 0 }, layer: "below",
    });
  }
  for (const f of view.faults) {
    shapes.push({
      type: "line", xref: "x", yref: "paper", x0: f.t, x1: f.t, y0: 0, y1: 1,
      line: { color: "#e4572e", width: 1, dash: "dot" },
    });
  }
  return shapes;
}

function faultAnnotations(view) {
  return view.faults.map((f) => ({
    x: f.t, y: 1, xref: "x", yref: "paper", yanchor: "bottom", showarrow: false,
    text: f.spec || f.kind, font: { size: 10, color: "#e4572e" },
  }));
}

function drawThroughput(view) {
  const trace = {
    x: view.throughput.t, y: view.throughput.samples_per_s, text: view.throughput.step,
    type: "scatter", mode: "lines+markers", name: "samples/s", connectgaps: false,
    line: { color: "#3b6fd8" }, marker: { size: 4 },
    hovertemplate: "t=%{x:.3f} s<br>step %{text}<br>%{y:.0f} samples/s<extra></extra>",
  };
  return Plotly.react("throughput", [trace], {
    ...LAYOUT, title: { text: "Throughput (samples/s)", x: 0.02, xanchor: "left" },
    xaxis: { title: { text: "seconds since training started" } },
    yaxis: { rangemode: "tozero" },
    shapes: recoveryShapes(view), annotations: faultAnnotations(view),
  }, CONFIG);
}

function drawWorld(view) {
  const trace = {
    x: view.world.t, y: view.world.size, text: view.world.step,
    type: "scatter", mode: "lines", line: { shape: "hv", color: "#1f9d55", width: 2 },
    name: "world size",
    hovertemplate: "t=%{x:.3f} s<br>step %{text}<br>world %{y}<extra></extra>",
  };
  return Plotly.react("world", [trace], {
    ...LAYOUT, title: { text: "World size", x: 0.02, xanchor: "left" },
    xaxis: { title: { text: "seconds since training started" } },
    yaxis: { rangemode: "tozero", dtick: 1 },
    shapes: recoveryShapes(view),
  }, CONFIG);
}

// What step.log recorded, one trace per name, against the step (the commits that stand:
// a step redone after a rollback shows its redo). Dotted lines: where recoveries resumed.
function drawMetrics(view) {
  const names = Object.keys(view.metrics);
  const traces = names.map((name, i) => ({
    x: view.metrics[name].step, y: view.metrics[name].value, name,
    type: "scatter", mode: "lines+markers", connectgaps: false,
    line: { color: METRIC_COLORS[i % METRIC_COLORS.length], width: 2 }, marker: { size: 4 },
    hovertemplate: `step %{x}<br>${name} %{y:.6g}<extra></extra>`,
  }));
  const resumed = view.recoveries.filter((r) => r.step !== null && r.step !== undefined);
  const empty = names.length === 0;
  const title = names.join() === "loss" ? "Loss curve" : "Logged metrics";
  const height = empty ? 130 : 320;  // a line of text, not an empty chart's space
  document.getElementById("metrics").style.height = `${height}px`;
  return Plotly.react("metrics", traces, {
    ...LAYOUT, height, title: { text: title, x: 0.02, xanchor: "left" },
    xaxis: { title: { text: "step" }, visible: !empty, zeroline: false },
    yaxis: { visible: !empty },
    showlegend: names.length > 1,
    shapes: (empty ? [] : resumed).map((r) => ({
      type: "line", xref: "x", yref: "paper", x0: r.step, x1: r.step, y0: 0, y1: 1,
      line: { color: "#e4572e", width: 1, dash: "dot" },
    })),
    annotations: empty ? [{
      text: "no metrics logged: keepstep.init(metrics=('loss',)) and step.log(loss=...)",
      xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false,
      font: { size: 13, color: "#667" },
    }] : [],
  }, CONFIG);
}

// One horizontal bar per recovery, split into its phases (seconds from the fault).
function drawRecoveries(view) {
  const labels = view.recoveries.map((r) => r.label);
  const traces = PHASES.map((phase) => ({
    type: "bar", orientation: "h", name: phase, y: labels,
    x: view.recoveries.map((r) => r.phases[phase]),
    marker: { color: PHASE_COLORS[phase] },
    hovertemplate: `%{y}<br>${phase}: %{x:.4f} s<extra></extra>`,
  }));
  const height = Math.max(220, 90 + 40 * labels.length);
  document.getElementById("recoveries").style.height = `${height}px`;
  return Plotly.react("recoveries", traces, {
    ...LAYOUT, barmode: "stack", height,
    title: { text: "Recoveries: MTTR by phase", x: 0.02, xanchor: "left" },
    xaxis: { title: { text: "seconds from the fault to the first commit after it" } },
    yaxis: { autorange: "reversed", type: "category", automargin: true },
    legend: { orientation: "h", traceorder: "normal", x: 1, xanchor: "right", y: 1.02, yanchor: "bottom" },
    margin: { ...LAYOUT.margin, l: 140 },
  }, CONFIG);
}

function fillTable(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      const td = document.createElement("td");
      td.textContent = cell === null || cell === undefined ? "–" : String(cell);
      tr.appendChild(td);
    }
    return tr;
  }));
}

function drawKpis(view) {
  const badge = document.getElementById("status");
  badge.textContent = view.status;
  badge.className = `badge ${view.status}`;
  // Why a run failed, on hover and beside the badge: a red badge alone says too little.
  badge.title = view.failures.join("\n");
  setText("failures", view.failures.join("; "));
  setText("kpi-step", view.steps_total ? `${view.step} / ${view.steps_total}` : `${view.step}`);
  setText("kpi-world", view.world_size);
  setText("kpi-recoveries", view.recoveries.length);
  setText("kpi-mttr", fmtSeconds(view.mttr_p50_s));
  const g = view.goodput.fraction;
  setText("kpi-goodput", g === null ? "–" : `${(100 * g).toFixed(1)} %`);
  const rate = view.goodput.useful_samples_per_s;
  setText("kpi-rate", rate === null ? "–" : rate.toFixed(0));
  fillTable("recovery-table", view.recoveries.map((r) => [
    r.index, r.cause, r.node, r.epoch, r.step, fmtSeconds(r.mttr_s), r.rolled_back_steps, r.reason,
  ]));
}

async function drawRun(name) {
  const view = await getJSON(`/api/runs/${encodeURIComponent(name)}`);
  drawKpis(view);
  await Promise.all([drawThroughput(view), drawWorld(view), drawMetrics(view),
    drawRecoveries(view)]);
  window.keepstep.view = view;
  window.keepstep.draws += 1;
  document.body.dataset.drawn = view.run;
  return view;
}

async function drawCluster() {
  const cluster = await getJSON("/api/trainjobs");
  const section = document.getElementById("cluster");
  section.hidden = !cluster.enabled;
  setText("cluster-error", cluster.error || "");
  fillTable("trainjobs", cluster.items.map((j) => [
    j.namespace, j.name, j.phase, `${j.live_nodes ?? "–"} / ${j.nodes ?? "–"}`, j.world_size,
    j.steps_total ? `${j.step ?? "–"} / ${j.steps_total}` : j.step,
    j.samples_per_s === null || j.samples_per_s === undefined ? null : j.samples_per_s.toFixed(0),
    j.recoveries, fmtSeconds(j.mttr_s),
  ]));
}

async function refresh() {
  clearTimeout(state.timer);
  try {
    const runs = await getJSON("/api/runs");
    const select = document.getElementById("run");
    const names = runs.map((r) => r.run);
    const labels = runs.map((r) => `${r.run} (${r.status})`);
    if (labels.join("\n") !== [...select.options].map((o) => o.text).join("\n")) {
      select.replaceChildren(...runs.map((r, i) => new Option(labels[i], r.run)));
    }
    const wanted = new URLSearchParams(location.search).get("run");
    state.run = state.run || (names.includes(wanted) ? wanted : names[names.length - 1]);
    select.value = state.run;
    const [view] = await Promise.all([state.run ? drawRun(state.run) : null, drawCluster()]);
    const when = new Date().toLocaleTimeString();
    setText("updated", names.length ? `updated ${when}` : `no runs yet (checked ${when})`);
    // The list was read before the run's view: a run that ended in between is still
    // listed live, so poll once more rather than leave its label stale.
    const listed = runs.find((r) => r.run === state.run);
    const live = view === null || [view.status, listed && listed.status].some(
      (s) => s === "live" || s === "starting");
    if (live || document.getElementById("cluster").hidden === false) {
      state.timer = setTimeout(refresh, POLL_MS);
    }
  } catch (error) {
    setText("updated", `error: ${error.message}`);
    state.timer = setTimeout(refresh, POLL_MS);
  }
}

document.getElementById("run").addEventListener("change", (event) => {
  state.run = event.target.value;
  refresh();
});
refresh();
