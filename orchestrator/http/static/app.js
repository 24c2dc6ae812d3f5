// The Anima page: a form that queues a job (POST /anima/jobs), live progress over /ws (anima.progress, anima.job),
// cancel, and a gallery of past jobs (GET /anima/jobs) with their settings and timing plots. No build step.
"use strict";

const $ = (id) => document.getElementById(id);
const KINDS = ["self", "cross", "ffn"];
const clientId = "page-" + Math.random().toString(36).slice(2) + Date.now().toString(36);
let info = null;            // GET /anima/info
let current = null;         // the job this page submitted and follows
let oldest = null;          // the gallery's oldest job id (paging back)
let ws = null;
let spectrumWanted = true;  // the user's own choice, put back when the sampler (or cache) that ruled it out goes

// ------------------------------------------------------------------ requests

function token() { return localStorage.getItem("anima_token") || ""; }

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (token()) headers["Authorization"] = "Bearer " + token();
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, Object.assign({}, options, { headers }));
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  if (resp.status === 401) { $("token-box").hidden = false; }
  if (!resp.ok) {
    const msg = body && (typeof body.error === "string" ? body.error : (body.error && body.error.message)) ||
      resp.status + " " + resp.statusText;
    const err = new Error(msg);
    err.status = resp.status; err.body = body;
    throw err;
  }
  return body;
}

function viewUrl(job, name) {
  return "/view?filename=" + encodeURIComponent(name) + "&subfolder=" + encodeURIComponent(job) + "&type=output";
}

// ------------------------------------------------------------------ the form

function showError(text) {
  $("error").textContent = text || "";
  $("error").hidden = !text;
}

// Spectrum does not fit samplers that call the model twice per step: the checkbox is off and says why
function spectrumFits() {
  const s = info.samplers.find((x) => x.name === $("sampler").value);
  // a step cache and Spectrum both decide which model calls to skip: the job takes one of them
  const why = $("cache").value ? "a step cache is on (it and Spectrum cannot be combined)" : (s ? s.spectrum : null);
  $("spectrum").disabled = Boolean(why);
  $("spectrum").checked = why ? false : spectrumWanted;
  $("spectrum").parentElement.title = why || "";
}

function formBody() {
  const [w, h] = $("size").value.split("x").map(Number);
  const body = { prompt: $("prompt").value, negative_prompt: $("negative").value, steps: Number($("steps").value),
                 cfg: Number($("cfg").value), width: w, height: h, sampler: $("sampler").value,
                 scheduler: $("scheduler").value, spectrum: $("spectrum").checked, client_id: clientId };
  if ($("cache").value) body.cache = { kind: $("cache").value };
  if ($("seed").value.trim() !== "") body.seed = $("seed").value.trim();   // digits: 64-bit seeds overflow a Number
  const loras = Array.from(document.querySelectorAll("#lora-rows .lora"), (r) => ({
    name: r.querySelector(".lora-name").value, strength: Number(r.querySelector(".lora-strength").value),
    clip_strength: Number(r.querySelector(".lora-clip").value) })).filter((l) => l.name);
  if (loras.length) body.loras = loras;
  return body;
}

async function submit(ev) {
  ev.preventDefault();
  showError("");
  if (!$("prompt").value.trim()) { showError("Write a prompt first."); return; }
  $("go").disabled = true;
  try {
    const r = await api("/anima/jobs", { method: "POST", body: JSON.stringify(formBody()) });
    current = r.job;
    startLive(r.job, r.position);
    loadGallery(true);
  } catch (e) {
    const field = e.body && e.body.field ? " (" + e.body.field + ")" : "";
    showError(e.message + field);
    $("go").disabled = false;
  }
}

async function cancel() {
  if (!current) return;
  $("cancel").disabled = true;
  try { await api("/anima/jobs/" + encodeURIComponent(current) + "/cancel", { method: "POST", body: "{}" }); }
  catch (e) { showError(e.message); }
}

// one row per LoRA: its name, its strength on the model (DiT) and on the text encoder; as many as the server takes
function strengthInput(cls, title) {
  return el("input", { className: cls, type: "number", min: -100, max: 100, step: 0.05, value: 1, title,
                       inputMode: "decimal" });
}

function addLoraRow() {
  const rows = $("lora-rows");
  if (rows.children.length >= info.limits.loras) return;
  const pick = el("select", { className: "lora-name" }, el("option", { value: "", textContent: "none" }));
  for (const name of info.loras || []) pick.append(el("option", { value: name, textContent: name }));
  const row = el("div", { className: "row lora" }, el("label", {}, "LoRA ", pick),
                 el("label", {}, "Model ", strengthInput("lora-strength", "strength on the model (DiT)")),
                 el("label", {}, "Text encoder ", strengthInput("lora-clip", "strength on the text encoder")));
  row.append(el("button", { type: "button", className: "lora-remove", textContent: "Remove",
                            onclick: () => { row.remove(); loraButtons(); } }));
  rows.append(row);
  loraButtons();
}

function loraButtons() {
  $("lora-add").disabled = $("lora-rows").children.length >= info.limits.loras;
}

function loraText(l) {
  const te = l.clip_strength === null || l.clip_strength === undefined ? "" : " / text encoder " + l.clip_strength;
  return l.name + " " + l.strength + te;
}

// ------------------------------------------------------------------ live progress

function fmtEta(s) {
  if (s === null || s === undefined) return "?";
  s = Math.max(0, Math.round(s));
  return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
}

function startLive(job, position) {
  $("live").hidden = false;
  $("live-job").textContent = "job " + job;
  setState("queued");
  $("bar").value = 0;
  $("live-text").textContent = position ? position + " job(s) ahead" : "starting";
  $("result-link").hidden = true;
  $("cancel").disabled = false;
}

function setState(state) {
  $("live-state").textContent = state;
  $("live-state").className = "badge " + state;
}

function onProgress(p) {
  if (p.job !== current) return;
  setState(p.state);
  if (p.state === "encoding") { $("bar").value = 0.02; $("live-text").textContent = "encoding the prompt"; }
  else if (p.state === "decoding") { $("bar").value = 0.98; $("live-text").textContent = "decoding the image"; }
  else if (p.state === "denoising" && p.step) {
    const blocks = p.blocks || 28;
    const within = (3 * p.block + KINDS.indexOf(p.branch) + 1) / (3 * blocks);
    $("bar").value = Math.min(0.97, 0.03 + 0.94 * (p.step - 1 + within) / p.steps);
    const what = p.forecast ? "forecast" : "block " + (p.block + 1) + "/" + blocks + " " + p.branch;
    $("live-text").textContent = "step " + p.step + "/" + p.steps + " · " + what + " · ETA " + fmtEta(p.eta_s);
  }
}

function onJobEnd(d) {
  loadGallery(true);
  if (d.job !== current) return;
  setState(d.state);
  $("cancel").disabled = true;
  $("go").disabled = false;
  if (d.state === "done") {
    $("bar").value = 1;
    $("live-text").textContent = "done";
    const url = viewUrl(d.job, "image.png");
    $("result").src = url;
    $("result-link").href = url;
    $("result-link").hidden = false;
  } else {
    $("live-text").textContent = d.state + (d.error ? ": " + d.error : "");
  }
  current = null;
}

function connect() {
  const proto = location.protocol === "https:" ? "wss://" : "ws://";
  ws = new WebSocket(proto + location.host + "/ws?clientId=" + encodeURIComponent(clientId));
  ws.onopen = () => { $("conn").textContent = "live"; $("conn").classList.add("on"); };
  ws.onclose = () => {
    $("conn").textContent = "offline"; $("conn").classList.remove("on");
    setTimeout(connect, 2000);
  };
  ws.onmessage = (ev) => {
    let msg;
    try { msg = JSON.parse(ev.data); } catch (e) { return; }
    if (msg.type === "anima.progress") onProgress(msg.data);
    else if (msg.type === "anima.job") onJobEnd(msg.data);
  };
}

// ------------------------------------------------------------------ gallery

function el(tag, props, ...children) {
  const e = document.createElement(tag);
  Object.assign(e, props || {});
  for (const c of children) if (c) e.append(c);
  return e;
}

function card(j) {
  const s = j.spec || {};
  const meta = [s.width && s.height ? s.width + "x" + s.height : "", "seed " + s.seed, s.steps + " steps",
                "cfg " + s.cfg, "spectrum " + (s.spectrum ? "on" : "off"),
                s.cache ? "cache " + s.cache.kind : "",
                s.sampler ? s.sampler + " / " + s.scheduler : "", j.api].filter(Boolean).join(" · ");
  const c = el("article", { className: "job", id: "job-" + j.job });
  if (j.files.image) {
    const a = el("a", { href: j.files.image, target: "_blank", rel: "noopener" },
                 el("img", { className: "image", src: j.files.image, alt: s.prompt || "", loading: "lazy" }));
    c.append(a);
  }
  c.append(el("div", { className: "prompt", textContent: s.prompt || "" }));
  c.append(el("div", { className: "meta", textContent: meta }));
  if ((s.loras || []).length) {
    c.append(el("div", { className: "meta loras", textContent: "LoRA " + s.loras.map(loraText).join(" · ") }));
  }
  const state = el("span", { className: "badge " + j.state, textContent: j.state });
  c.append(el("div", { className: "meta" }, state, document.createTextNode(" " + j.job +
    (j.error ? " — " + j.error_stage + ": " + j.error : ""))));
  if (j.files.timing) {
    c.append(el("a", { href: j.files.timing, target: "_blank", rel: "noopener" },
                el("img", { className: "timing", src: j.files.timing, alt: "timing plot", loading: "lazy" })));
  }
  if (j.files.report) c.append(el("a", { href: j.files.report, target: "_blank", rel: "noopener",
                                         textContent: "report.json" }));
  return c;
}

let galleryTimer = null;
function loadGallery(fresh) {
  if (fresh) { clearTimeout(galleryTimer); galleryTimer = setTimeout(() => fillGallery(true), 150); }
  else fillGallery(false);
}

async function fillGallery(fresh) {
  const q = fresh || !oldest ? "" : "&before=" + encodeURIComponent(oldest);
  let r;
  try { r = await api("/anima/jobs?limit=24" + q); } catch (e) { return; }
  const g = $("gallery");
  if (fresh) g.replaceChildren();
  for (const j of r.jobs) g.append(card(j));
  if (r.jobs.length) oldest = r.jobs[r.jobs.length - 1].job;
  $("more").hidden = !r.more;
}

// ------------------------------------------------------------------ start

async function start() {
  $("form").addEventListener("submit", submit);
  $("cancel").addEventListener("click", cancel);
  $("more").addEventListener("click", () => loadGallery(false));
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const t = $("token").value.trim();
    localStorage.setItem("anima_token", t);
    document.cookie = "anima_token=" + encodeURIComponent(t) + "; path=/; SameSite=Strict";
    location.reload();
  });
  try { info = await api("/anima/info"); } catch (e) { showError(e.message); return; }
  $("model").textContent = info.model + " · " + info.version;
  for (const [w, h] of info.sizes) $("size").append(el("option", { value: w + "x" + h, textContent: w + " × " + h }));
  $("steps").value = info.defaults.steps;
  $("steps").max = info.limits.steps;
  $("cfg").value = info.defaults.cfg;
  $("cfg").max = info.limits.cfg;
  $("spectrum").checked = spectrumWanted = info.defaults.spectrum;
  $("spectrum").addEventListener("change", () => { spectrumWanted = $("spectrum").checked; });
  $("lora-box").hidden = !(info.loras || []).length;     // a LoRA-ready pack applies them; a plain one says so
  $("lora-add").addEventListener("click", addLoraRow);
  addLoraRow();
  for (const s of info.samplers) {
    const calls = s.nfe === "1" ? "" : " (" + s.nfe + " model calls per step)";
    $("sampler").append(el("option", { value: s.name, textContent: s.name + calls }));
  }
  for (const name of info.schedulers) $("scheduler").append(el("option", { value: name, textContent: name }));
  $("sampler").value = info.defaults.sampler;
  $("scheduler").value = info.defaults.scheduler;
  for (const c of info.caches || []) {
    const what = c.name + " (reuse " + c.reuse_threshold + ", " + c.start_percent + "–" + c.end_percent + ")";
    $("cache").append(el("option", { value: c.kind, textContent: what }));
  }
  $("sampler").addEventListener("change", spectrumFits);
  $("cache").addEventListener("change", spectrumFits);
  spectrumFits();
  connect();
  fillGallery(true);
}

document.addEventListener("DOMContentLoaded", start);
