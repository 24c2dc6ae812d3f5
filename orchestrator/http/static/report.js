// The report view: a job's timing panels (GET /anima/jobs/JOB/timing, orchestrator.engine.timing_plot's data) drawn as
// rows of stacked bars in HTML, at the screen's width in the page's own type size: readable on a phone, where
// timing.png (the same data, 1200 px wide) is not. Uses app.js's api() and el().
"use strict";

const PHASES = ["load_s", "init_s", "infer_s", "release_s"];

function seconds(s) { return (s >= 10 ? s.toFixed(1) : s.toFixed(2)) + " s"; }

function legend(names, colours, text) {
  return el("ul", { className: "legend" }, ...names.map((n) => {
    const swatch = el("span", { className: "swatch" });
    swatch.style.background = colours[n] || "#888";
    return el("li", {}, swatch, document.createTextNode(text ? text(n) : n));
  }));
}

// one row: its label, a bar of `parts` ([colour key, seconds]) at `scale` seconds = full width, the total
function barRow(label, parts, scale, colours, note) {
  const bar = el("div", { className: "bar" });
  let total = 0;
  for (const [key, v] of parts) {
    total += v;
    if (!(v > 0)) continue;
    const seg = el("span", { title: key + " " + seconds(v) });
    seg.style.width = (100 * v / scale) + "%";
    seg.style.background = colours[key] || "#888";
    bar.append(seg);
  }
  const row = el("div", { className: "bar-row" }, el("span", { className: "bar-label", textContent: label }),
                 el("span", { className: "bar-total", textContent: seconds(total) }), bar);
  if (note) row.append(el("span", { className: "bar-note", textContent: note }));
  return row;
}

function stepsPanel(p, colours) {
  const names = Object.keys(p.series);
  const totals = p.x.map((_, i) => names.reduce((a, n) => a + p.series[n][i], 0));
  const scale = Math.max(...totals, 1e-9);
  return [legend(names, colours), ...p.x.map((step, i) => barRow(
    "step " + step + (p.computed[i] ? "" : " (forecast)"), names.map((n) => [n, p.series[n][i]]), scale, colours))];
}

function branchesPanel(p, colours) {
  const kinds = Object.keys(p.series);
  const scale = Math.max(...kinds.map((k) => PHASES.reduce((a, f) => a + p.series[k][f], 0)), 1e-9);
  return [legend(PHASES, colours, (f) => f.slice(0, -2)), ...kinds.map((k) => barRow(
    p.labels[k], PHASES.map((f) => [f, p.series[k][f]]), scale, colours, p.notes[k]))];
}

// per stage its RSS over the job as a line the width of the panel (no text inside the drawing), its peak beside it
function memoryPanel(p) {
  const stages = Object.keys(p.series);
  const all = stages.flatMap((s) => p.series[s]);
  const tmax = Math.max(...all.map(([t]) => t), 1e-9), top = Math.max(...all.map(([, mb]) => mb), 1e-9);
  const rows = stages.map((s) => {
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("viewBox", "0 0 100 24");
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("class", "spark");
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", p.series[s].map(([t, mb]) => (100 * t / tmax) + "," + (24 - 22 * mb / top)).join(" "));
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(line);
    const peak = Math.max(...p.series[s].map(([, mb]) => mb));
    return el("div", { className: "bar-row" }, el("span", { className: "bar-label", textContent: s }),
              el("span", { className: "bar-total", textContent: "peak " + Math.round(peak) + " MiB" }), svg);
  });
  const phases = (p.phases || []).map(([state, t0, t1]) => state + " " + t0.toFixed(1) + "–" + t1.toFixed(1) + " s");
  return [el("p", { className: "muted", textContent: "over " + tmax.toFixed(1) + " s" +
                                                     (phases.length ? ": " + phases.join(" · ") : "") }), ...rows];
}

async function openReport(job) {
  const box = $("report");
  let data;
  try { data = await api("/anima/jobs/" + job + "/timing"); } catch (e) { showError(e.message); return; }
  $("report-title").textContent = "Timing of job " + job;
  $("report-about").textContent = data.title + " · " + data.provenance;
  $("report-png").href = viewUrl(job, "timing.png");
  $("report-json").href = viewUrl(job, "report.json");
  const draw = { steps: (p) => stepsPanel(p, data.colours), branches: (p) => branchesPanel(p, data.colours),
                 memory: memoryPanel };
  $("report-panels").replaceChildren(...data.panels.map((p) => el("section", { className: "panel " + p.name },
    el("h3", { textContent: p.title }), ...draw[p.name](p))));
  if (!data.panels.length) $("report-panels").append(el("p", { textContent: "no timing data in this report" }));
  box.hidden = false;
  box.scrollIntoView({ block: "start" });
}

document.addEventListener("DOMContentLoaded", () => {
  $("report-close").addEventListener("click", () => { $("report").hidden = true; });
});
