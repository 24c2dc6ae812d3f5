// The Anima page: a form that queues a job (POST /anima/jobs), live progress over /ws (anima.progress, anima.job),
// cancel, and a gallery of past jobs (GET /anima/jobs) with their settings and timing plots. An image to start from
// and its mask (a file, or painted) go up through ComfyUI's /upload/image and the job names them. No build step.
"use strict";

const $ = (id) => document.getElementById(id);
const KINDS = ["self", "cross", "ffn"];
const clientId = "page-" + Math.random().toString(36).slice(2) + Date.now().toString(36);
let info = null;            // GET /anima/info
let current = null;         // the job this page submitted and follows
let currentBatch = 1;       // its images: image.png, image_1.png ... (the server names a batch's files so)
let currentHires = false;   // it has a hires pass (each image sampled twice)
let liveSeen = false;       // a live message about it came (newer than any listing asked for before)
let oldest = null;          // the gallery's oldest job id (paging back)
let ws = null;
let spectrumWanted = true;  // the user's own choice, put back when the sampler (or cache) that ruled it out goes

// ------------------------------------------------------------------ requests

function token() { return localStorage.getItem("anima_token") || ""; }

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (token()) headers["Authorization"] = "Bearer " + token();
  // a FormData body (an upload) gets its multipart Content-Type, with the boundary, from fetch itself
  if (options.body !== undefined && !(options.body instanceof FormData)) headers["Content-Type"] = "application/json";
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

// A refusal that names a field goes next to the control that set it (`data-field` lists the fields a control sets;
// "hires.denoise" is the hires box's); one that names none, or a field no control sets, under the Generate button
function fieldError(field, text) {
  const key = String(field || "").split(/[.[]/)[0];
  const box = key ? document.querySelector('[data-field~="' + CSS.escape(key) + '"]') : null;
  if (!box) { showError(text + (field ? " (" + field + ")" : "")); return; }
  // once: an upload's refusal is said when it comes back and again by a Generate that was waiting on it
  if (Array.from(box.querySelectorAll(".field-error")).some((e) => e.textContent === text)) return;
  box.append(el("span", { className: "error field-error", role: "alert", textContent: text }));
}

function clearErrors() {
  showError("");
  for (const e of document.querySelectorAll(".field-error")) e.remove();
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
  body.batch = Number($("batch").value);
  if ($("hires-on").checked) body.hires = hiresBody();
  return body;
}

// prompt.json's hires: a scale or one of the sizes with a pack, a method of a space the server lists
function hiresBody() {
  const [space, method] = $("hires-method").value.split(":");
  const h = { space, method, steps: Number($("hires-steps").value), denoise: Number($("hires-denoise").value) };
  if ($("hires-to").value === "scale") h.scale = Number($("hires-scale").value);
  else [h.width, h.height] = $("hires-to").value.split("x").map(Number);
  return h;
}

// the second size: a scale, or a size that has a pack (the second pass runs on it) other than the first pass's
function hiresSizes() {
  const keep = $("hires-to").value;
  $("hires-to").replaceChildren(el("option", { value: "scale", textContent: "scale" }));
  for (const [w, h] of info.sizes) {
    if (w + "x" + h !== $("size").value) $("hires-to").append(el("option", { value: w + "x" + h,
                                                                       textContent: w + " × " + h }));
  }
  $("hires-to").value = Array.from($("hires-to").options, (o) => o.value).includes(keep) ? keep : "scale";
  $("hires-scale-box").hidden = $("hires-to").value !== "scale";
}

async function submit(ev) {
  ev.preventDefault();
  clearErrors();
  if (!$("prompt").value.trim()) { showError("Write a prompt first."); return; }
  $("go").disabled = true;
  try {
    const body = formBody();
    await imageFields(body);
    const r = await api("/anima/jobs", { method: "POST", body: JSON.stringify(body) });
    current = r.job;
    currentBatch = body.batch || 1;
    currentHires = !!body.hires;
    startLive(r.job, r.text);
    loadGallery(true);
  } catch (e) {
    fieldError(e.body && e.body.field, e.message);
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

// ------------------------------------------------------------------ the image to start from, its mask

const UPLOAD_FOLDER = "page";   // RUN/input/page/: the page's uploads, apart from a ComfyUI client's own
let init = null;                // {width, height, upload: a promise of the job's init_image name}
let maskUpload = null;          // a mask file's upload (mask mode "file"): a promise of its name
let painted = false;            // a stroke on the canvas since the image came or the mask was cleared
let stroke = null;              // the stroke being painted: its last point

// ComfyUI's /upload/image (type input); -> the name LoadImage and prompt.json take ("page/NAME.png [input]"). The
// server names its refusal's field "image" (the form's); `field` is the job's field it was for
async function upload(blob, filename, field) {
  const form = new FormData();
  form.append("image", blob, filename);
  form.append("type", "input");
  form.append("subfolder", UPLOAD_FOLDER);
  try {
    const r = await api("/upload/image", { method: "POST", body: form });
    return (r.subfolder ? r.subfolder + "/" : "") + r.name + " [" + r.type + "]";
  } catch (e) {
    e.body = Object.assign({}, e.body, { field });
    throw e;
  }
}

function setInitFile(file) {
  clearInit(true);
  if (!file) return;
  clearErrors();
  const mine = { width: 0, height: 0 };
  mine.upload = upload(file, file.name || "image.png", "init_image");
  mine.upload.catch((e) => { if (init === mine) { clearInit(); fieldError("init_image", e.message); } });
  init = mine;
  $("init-thumb").onload = () => {
    mine.width = $("init-thumb").naturalWidth;
    mine.height = $("init-thumb").naturalHeight;
    const size = mine.width + "x" + mine.height;          // the image's own size, when a pack has it
    if (Array.from($("size").options, (o) => o.value).includes(size)) { $("size").value = size; sizeChanged(); }
    resetMask();
    resizeChoice();
  };
  // a data: URL, which the page's CSP (img-src 'self' data:) allows; a blob: one it does not
  const reader = new FileReader();
  reader.onload = () => { if (init === mine) $("init-thumb").src = reader.result; };
  reader.readAsDataURL(file);
  $("denoise").value = 0.6;                              // text-to-image is denoise 1; from an image, 0.6 to start
  denoiseText();
  $("init-controls").hidden = $("init-clear").hidden = false;
}

function clearInit(keepInput) {                 // keepInput: the file input holds the new file (not for a drop)
  init = null;
  if (keepInput !== true) $("init-file").value = "";
  $("init-thumb").removeAttribute("src");
  $("init-controls").hidden = $("init-clear").hidden = $("resize-box").hidden = true;
  $("mask-mode").value = "";
  maskMode();
}

function denoiseText() { $("denoise-out").textContent = Number($("denoise").value).toFixed(2); }

// A1111's resize modes, offered when the image is not the size picked (the job refuses a size that differs without)
function resizeChoice() {
  $("resize-box").hidden = !init || !init.width || init.width + "x" + init.height === $("size").value;
}

function maskMode() {
  const mode = $("mask-mode").value;
  $("mask-canvas").hidden = mode !== "paint";
  for (const e of document.querySelectorAll(".paint-only")) e.hidden = mode !== "paint";
  for (const e of document.querySelectorAll(".mask-only")) e.hidden = !mode;
  $("mask-file-box").hidden = mode !== "file";
  if (mode !== "file") { maskUpload = null; $("mask-file").value = ""; }
  hiresMaskHint();
}

// a job's second pass is not masked (docs/workflows.md): with a mask and the hires fix both set, say so
function hiresMaskHint() {
  const mode = $("mask-mode").value;
  const masked = !!init && ((mode === "paint" && painted) || (mode === "file" && !!maskUpload));
  $("hires-mask-hint").hidden = !($("hires-on").checked && masked);
}

// the canvas holds the image's own pixels (the CSS scales it over the thumbnail): the mask is the image's size
function resetMask() {
  const c = $("mask-canvas");
  c.width = init ? init.width : 0;
  c.height = init ? init.height : 0;
  c.getContext("2d").clearRect(0, 0, c.width, c.height);
  painted = false;
  hiresMaskHint();
}

function canvasPoint(ev) {
  const c = $("mask-canvas"), r = c.getBoundingClientRect();
  return { x: (ev.clientX - r.left) * c.width / r.width, y: (ev.clientY - r.top) * c.height / r.height,
           scale: c.width / r.width };
}

// white paints the part to repaint (A1111's rule, read when mask_channel is left out); erase takes it away
function paint(from, to) {
  const ctx = $("mask-canvas").getContext("2d");
  ctx.globalCompositeOperation = $("erase").checked ? "destination-out" : "source-over";
  ctx.strokeStyle = ctx.fillStyle = "#fff";
  ctx.lineWidth = Number($("brush").value) * to.scale;   // the brush is in screen pixels, as the user sees it
  ctx.lineCap = ctx.lineJoin = "round";
  ctx.beginPath();
  if (from === to) {                                      // a click: a dot
    ctx.arc(to.x, to.y, ctx.lineWidth / 2, 0, 2 * Math.PI);
    ctx.fill();
  } else {
    ctx.moveTo(from.x, from.y);
    ctx.lineTo(to.x, to.y);
    ctx.stroke();
  }
  painted = true;
}

function paintEvents() {
  const c = $("mask-canvas");
  c.addEventListener("pointerdown", (ev) => {
    ev.preventDefault();
    c.setPointerCapture(ev.pointerId);
    stroke = canvasPoint(ev);
    paint(stroke, stroke);
  });
  c.addEventListener("pointermove", (ev) => {
    if (!stroke) return;
    const p = canvasPoint(ev);
    paint(stroke, p);
    stroke = p;
  });
  for (const end of ["pointerup", "pointercancel"]) c.addEventListener(end, () => { stroke = null; hiresMaskHint(); });
}

// the painted mask as an opaque PNG at the image's size: black (kept) under the white strokes
function maskBlob() {
  const src = $("mask-canvas"), out = document.createElement("canvas");
  out.width = src.width;
  out.height = src.height;
  const ctx = out.getContext("2d");
  ctx.fillStyle = "#000";
  ctx.fillRect(0, 0, out.width, out.height);
  ctx.drawImage(src, 0, 0);
  return new Promise((ok, bad) => out.toBlob((b) => (b ? ok(b) : bad(new Error("the mask could not be drawn"))),
                                            "image/png"));
}

// the job's init_image, denoise, resize_mode, mask and grow_mask_by (uploads finished first)
async function imageFields(body) {
  if (!init) return;
  body.init_image = await init.upload;
  body.denoise = Number($("denoise").value);
  if (!$("resize-box").hidden) body.resize_mode = Number($("resize-mode").value);
  const mode = $("mask-mode").value;
  if (mode === "paint" && painted) body.mask = await upload(await maskBlob(), "mask.png", "mask");
  else if (mode === "file" && maskUpload) body.mask = await maskUpload;
  if (body.mask && $("grow").value.trim() !== "") body.grow_mask_by = Number($("grow").value);
}

function imageEvents() {
  $("init-file").addEventListener("change", () => setInitFile($("init-file").files[0]));
  $("init-clear").addEventListener("click", () => clearInit());
  $("denoise").addEventListener("input", denoiseText);
  $("mask-mode").addEventListener("change", maskMode);
  $("mask-clear").addEventListener("click", resetMask);
  $("mask-file").addEventListener("change", () => {
    const file = $("mask-file").files[0];
    maskUpload = file ? upload(file, file.name || "mask.png", "mask") : null;
    if (maskUpload) maskUpload.catch((e) => fieldError("mask", e.message));   // and again at Generate
  });
  const form = $("form");                      // an image dropped anywhere on the form is the one to start from
  form.addEventListener("dragover", (ev) => {
    if (Array.from(ev.dataTransfer.types).includes("Files")) { ev.preventDefault(); form.classList.add("drop"); }
  });
  form.addEventListener("dragleave", () => form.classList.remove("drop"));
  form.addEventListener("drop", (ev) => {
    form.classList.remove("drop");
    const file = Array.from(ev.dataTransfer.files).find((f) => f.type.startsWith("image/"));
    if (!file) return;
    ev.preventDefault();
    $("init-file").value = "";                           // the input's old file is not the one used now
    setInitFile(file);
  });
  paintEvents();
}

// ------------------------------------------------------------------ live progress

function fmtEta(s) {
  if (s === null || s === undefined) return "?";
  s = Math.max(0, Math.round(s));
  return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
}

// the phase's words are the daemon's (orchestrator/engine/progress_text.py), the CLI's too: `text` in each message
function startLive(job, text) {
  $("live").hidden = false;
  $("live-job").textContent = "job " + job;
  setState("queued");
  liveSeen = false;
  $("bar").value = 0;
  $("live-text").textContent = text;
  $("results").hidden = true;
  $("cancel").disabled = false;
}

function setState(state) {
  $("live-state").textContent = state;
  $("live-state").className = "badge " + state;
}

function onProgress(p) {
  // a job's end is anima.job's to show (state, error, the images at once): a progress line that already says
  // "done" would light the badge before the images are there
  if (p.job !== current || ["done", "failed", "cancelled"].includes(p.state)) return;
  liveSeen = true;
  setState(p.state);
  if (p.state === "encoding") $("bar").value = 0.02;
  else if (p.state === "decoding") $("bar").value = 0.98;
  else if (p.state === "denoising" && p.step) {
    // the bar over the whole job: this pass's place among the job's passes (batch images, a hires pass)
    const blocks = p.blocks || 28, images = p.images || 1, passes = images * (currentHires ? 2 : 1);
    const index = (p.pass === "hires" ? images : 0) + (p.image || 1) - 1;
    const within = (3 * p.block + KINDS.indexOf(p.branch) + 1) / (3 * blocks);
    const frac = (index + (p.step - 1 + within) / p.steps) / passes;
    $("bar").value = Math.max($("bar").value, Math.min(0.97, 0.03 + 0.94 * frac));
  }
  if (p.text) $("live-text").textContent = p.text;
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
    showResults(d.job, currentBatch);
  } else {
    $("live-text").textContent = d.state + (d.error ? ": " + d.error : "");
  }
  current = null;
}

// every image of the job: image.png, then image_1.png ... for a batch
function showResults(job, count) {
  const box = $("results");
  box.replaceChildren();
  for (let i = 0; i < count; i++) {
    const url = viewUrl(job, i ? "image_" + i + ".png" : "image.png");
    const img = el("img", { className: "result", src: url,
                            alt: count > 1 ? "image " + (i + 1) + " of " + count : "the new image" });
    if (!i) img.id = "result";
    box.append(el("a", { href: url, target: "_blank", rel: "noopener" }, img));
  }
  box.classList.toggle("several", count > 1);
  box.hidden = false;
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
                s.sampler ? s.sampler + " / " + s.scheduler : "", ...workflowText(s), j.api]
    .filter(Boolean).join(" · ");
  const c = el("article", { className: "job", id: "job-" + j.job });
  const images = imageFiles(j.files);
  if (images.length) {
    const box = el("div", { className: images.length > 1 ? "images several" : "images" });
    for (const url of images) {
      box.append(el("a", { href: url, target: "_blank", rel: "noopener" },
                    el("img", { className: "image", src: url, alt: s.prompt || "", loading: "lazy" })));
    }
    c.append(box);
  }
  c.append(el("div", { className: "prompt", textContent: s.prompt || "" }));
  c.append(el("div", { className: "meta", textContent: meta }));
  if ((s.loras || []).length) {
    c.append(el("div", { className: "meta loras", textContent: "LoRA " + s.loras.map(loraText).join(" · ") }));
  }
  const state = el("span", { className: "badge " + j.state, textContent: j.state });
  c.append(el("div", { className: "meta" }, state, document.createTextNode(" " + j.job +
    (j.error ? " — " + j.error_stage + ": " + j.error : ""))));
  if (j.files.timing) {                  // its panels open in the report view (report.js), drawn to fit the screen
    const plot = el("a", { href: j.files.timing, title: "the timing panels" },
                    el("img", { className: "timing", src: j.files.timing, alt: "timing plot", loading: "lazy" }));
    plot.addEventListener("click", (ev) => { ev.preventDefault(); openReport(j.job); });
    c.append(plot);
  }
  if (j.files.report) c.append(el("a", { href: j.files.report, target: "_blank", rel: "noopener",
                                         textContent: "report.json" }));
  return c;
}

// a job's images in batch order: image, image_1, image_2 ... (job_json names its files by their stem)
function imageFiles(files) {
  const pos = (k) => (k === "image" ? 0 : Number(k.slice(6)));
  return Object.keys(files).filter((k) => /^image(_[0-9]+)?$/.test(k)).sort((a, b) => pos(a) - pos(b))
    .map((k) => files[k]);
}

// the card's words for an image to start from, a mask, a batch and a hires pass
function workflowText(s) {
  const out = [];
  if (s.init_image) out.push("from " + s.init_image + " · denoise " + Number(s.denoise).toFixed(2));
  if (s.mask) out.push("mask " + s.mask + (s.grow_mask_by !== null && s.grow_mask_by !== undefined ?
                                           " grown " + s.grow_mask_by : ""));
  if (s.batch > 1) out.push("batch " + s.batch);
  const h = s.hires;
  if (h) out.push("hires " + (h.scale ? "×" + h.scale : h.width + "x" + h.height) + " " + h.method + " denoise " +
                  Number(h.denoise).toFixed(2) + (h.steps ? " " + h.steps + " steps" : ""));
  return out;
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
  for (const j of r.jobs) {
    g.append(card(j));
    // the followed job began before the page knew its id: its phase from the listing until a live message says more
    if (j.job === current && !liveSeen && j.progress) { onProgress(j.progress); liveSeen = false; }
  }
  if (r.jobs.length) oldest = r.jobs[r.jobs.length - 1].job;
  $("more").hidden = !r.more;
}

// ------------------------------------------------------------------ start

function sizeChanged() {
  hiresSizes();
  resizeChoice();
  packSampling();
}

// the settings the chosen size's pack records for its model (Turbo: cfg 1, its steps ...) fill the form
function packSampling() {
  const rec = (info.sampling || {})[$("size").value];
  if (!rec) return;
  $("steps").value = rec.steps;
  $("cfg").value = rec.cfg;
  $("sampler").value = rec.sampler;
  $("scheduler").value = rec.scheduler;
  spectrumFits();
  negativeHint();
}

// at cfg 1 no unconditional pass runs: a negative prompt changes nothing, and the page says so beside it
function negativeHint() {
  const one = Math.abs(Number($("cfg").value) - 1) < 1e-9;
  $("negative-hint").hidden = !(one && $("negative").value.trim());
}

// the job's modelled board seconds beside Generate, asked again (debounced) whenever a setting changes
let estimateTimer = null, estimateSeq = 0;
function scheduleEstimate() {
  clearTimeout(estimateTimer);
  estimateTimer = setTimeout(showEstimate, 400);
}

async function showEstimate() {
  const seq = ++estimateSeq;
  const body = formBody();
  if (!body.prompt.trim()) body.prompt = "1girl";      // the text changes no figure of the price
  if (init) {                                 // the price of img2img follows its denoise; the mask changes nothing
    try { body.init_image = await init.upload; body.denoise = Number($("denoise").value); } catch (e) { return; }
  }
  try {
    const r = await api("/anima/estimate", { method: "POST", body: JSON.stringify(body) });
    if (seq !== estimateSeq) return;
    $("estimate").textContent = "estimate ≈ " + fmtEta(r.job_s) + " on the board (encode " + r.encode_s.toFixed(0) +
      " s, denoise " + r.denoise_s.toFixed(0) + " s: " + r.calls + " calls × " + r.passes + " pass" +
      (r.passes > 1 ? "es" : "") + ", decode " + r.decode_s.toFixed(0) + " s) [" + r.label + "]";
    $("estimate").title = r.line + (r.notes.length ? "\n" + r.notes.join("\n") : "");
  } catch (e) {
    if (seq === estimateSeq) $("estimate").textContent = "no estimate: " + e.message;
  }
}

// the hires box from /anima/info: the methods of every space the server runs, its scale bound and default denoise
function hiresChoices() {
  const hi = info.hires;
  for (const [space, methods] of Object.entries(hi.methods)) {
    for (const name of methods) {
      const text = space === "latent" ? name : name + " (" + space + ")";
      $("hires-method").append(el("option", { value: space + ":" + name, textContent: text }));
    }
  }
  $("hires-method").value = "latent:" + hi.method;
  $("hires-scale").max = hi.max_scale;
  $("hires-denoise").value = hi.denoise;
  $("hires-steps").max = info.limits.steps;
  $("hires-on").addEventListener("change", () => { $("hires-controls").hidden = !$("hires-on").checked; });
  $("hires-to").addEventListener("change", hiresSizes);
  hiresSizes();
}

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
  $("steps").min = info.least.steps;
  $("steps").max = info.limits.steps;
  $("cfg").value = info.defaults.cfg;
  $("cfg").min = info.least.cfg;
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
  $("batch").max = info.limits.batch;
  hiresChoices();
  $("size").addEventListener("change", sizeChanged);
  imageEvents();
  $("sampler").addEventListener("change", spectrumFits);
  $("cache").addEventListener("change", spectrumFits);
  spectrumFits();
  packSampling();
  for (const id of ["cfg", "negative"]) $(id).addEventListener("input", negativeHint);
  for (const kind of ["input", "change"]) $("form").addEventListener(kind, scheduleEstimate);
  $("form").addEventListener("change", hiresMaskHint);        // the hires box, the mask mode, a mask file
  negativeHint();
  scheduleEstimate();
  connect();
  fillGallery(true);
}

document.addEventListener("DOMContentLoaded", start);
