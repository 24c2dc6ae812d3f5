"""The web page in a real browser: Debian's Chromium, headless, driven by Playwright, against the real pipeline with
two packs (128x128, the default, and 64x128). Submit from the page, see the progress advance (step, block, ETA),
see the image at the chosen size; the gallery shows the job with its settings and its timing plot; cancel; a phone
sized window has no sideways scrolling, nor has the timing report view there; the icon; the hires-with-a-mask warning. No Chromium is a failure, not a skip (`make test` installs it)."""
from __future__ import annotations

import io
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from PIL import Image

from tests.pipeline_harness import Pipeline, board_stage_toml, tiny_assets

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]          # --headless: Playwright's headless=True adds it
JOB_MS = 600_000
# the daemon prices each new shape on the board model (a search of simulated steps): seconds on a quiet machine,
# past Playwright's 30 s default on a loaded one
ESTIMATE_MS = 120_000


@pytest.fixture(scope="module")
def pipe(pipeline_assets):
    """The session's 128x128 pack and a 64x128 pack built beside it (the page offers both sizes); a models folder of
    its own, hard links to the session's files (a test adds LoRAs to its loras/); the board's encoder on ONNX Runtime
    (the page is the subject, not transformers' start-up), the torch VAE (an uploaded image is encoded: the CPU
    bundle has no VAE encoder)."""
    shared, pack = pipeline_assets
    _, tall = tiny_assets(pack.parent, (64, 128))
    encoder = board_stage_toml(shared, pack.parent, stages=("encoder",))
    own = Path(tempfile.mkdtemp(prefix="anima-page-models-"))
    models = shutil.copytree(shared, own / "models", copy_function=os.link)
    p = Pipeline.start(models, pack, threads=1, packs=[tall], timing_plot=True, extra_toml=encoder)
    try:
        p.http_url()
        yield p
    finally:
        assert p.stop() == []
        assert p.leftover_segments() == []
        shutil.rmtree(own, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: the page test needs Debian's chromium (`apt-get install -y chromium`, "
                    "which `make test` runs as root)")
    from playwright.sync_api import sync_playwright
    profile = Path(tempfile.mkdtemp(prefix="anima-chromium-"))           # a fresh --user-data-dir
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(profile), executable_path=str(CHROMIUM), headless=True,
                                                    args=FLAGS, viewport={"width": 1100, "height": 900},
                                                    bypass_csp=True)   # the page's CSP forbids the eval() of
        # Playwright's wait_for_function; the header itself is checked in test_http_settings
        try:
            yield ctx
        finally:
            ctx.close()
            shutil.rmtree(profile, ignore_errors=True)


WATCH = """() => {
  window.__seen = [];
  const note = () => window.__seen.push([document.getElementById('bar').value,
                                        document.getElementById('live-text').textContent]);
  new MutationObserver(note).observe(document.getElementById('live-text'),
                                     {childList: true, characterData: true, subtree: true});
}"""


def _open(ctx, url: str):
    page = ctx.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_function("document.getElementById('size').options.length > 0")
    page.wait_for_function("document.getElementById('conn').textContent === 'live'")
    return page, errors


def _estimate_shows(page, test: str) -> None:
    page.wait_for_function(f"document.getElementById('estimate').{test}", timeout=ESTIMATE_MS)


def test_submit_see_progress_and_the_image(pipe, browser):
    url = pipe.http_url()
    page, errors = _open(browser, url)
    sizes = page.eval_on_selector_all("#size option", "os => os.map(o => o.value)")
    assert sizes == ["128x128", "64x128"]
    # the job priced beside Generate (the daemon's ESTIMATE: modelled board seconds), again as a setting changes
    _estimate_shows(page, "textContent.includes('[modelled]')")
    assert "× 2 passes" in page.text_content("#estimate")
    page.fill("#prompt", "1girl, red scarf, snow")
    page.fill("#negative", "worst quality")
    page.fill("#cfg", "1")
    _estimate_shows(page, "textContent.includes('× 1 pass,')")
    assert page.is_visible("#negative-hint")                 # cfg 1: the negative prompt changes nothing
    page.fill("#cfg", "4")
    assert not page.is_visible("#negative-hint")
    page.fill("#seed", "77")
    page.fill("#steps", "3")
    page.select_option("#size", "64x128")
    _estimate_shows(page, "title.includes('calls=3 passes=2')")
    page.evaluate(WATCH)
    page.click("#go")
    page.wait_for_function("document.getElementById('live-state').textContent === 'done'", timeout=JOB_MS)
    seen = page.evaluate("window.__seen")
    # the phase in the CLI's words (orchestrator/engine/progress_text.py), from the first line on: queued, not "starting"
    texts = [t for _, t in seen]
    assert texts[0] == "queued" or texts[0].startswith("queued ("), seen
    assert not {"starting", "encoding"} & set(texts) and "done" in texts, seen
    # progress advanced: denoising lines with step/block/ETA, the bar only going up, several distinct values
    denoising = [(b, t) for b, t in seen if t.startswith("step ")]
    assert any("block " in t and "ETA " in t and "ETA ?" not in t for _, t in denoising), seen
    assert len({t.split(" · ETA")[0] for _, t in denoising}) >= 2, seen        # more than one step/block position
    bars = [b for b, _ in denoising]
    assert bars == sorted(bars) and len(set(bars)) >= 2, seen
    assert [b for b, _ in seen] == sorted(b for b, _ in seen), seen            # never backwards, start to end
    # the image, at the size picked: the second pack's
    # shown with the end (the same message lights "done"); visible once loaded: an image still loading has no box
    assert page.evaluate("!document.getElementById('results').hidden && !!document.getElementById('result')")
    page.wait_for_function("document.getElementById('result').complete")
    page.wait_for_selector("#result", state="visible", timeout=JOB_MS)
    assert page.evaluate("[document.getElementById('result').naturalWidth, "
                         "document.getElementById('result').naturalHeight]") == [64, 128]
    job = page.text_content("#live-job").split()[-1]
    png = Image.open(io.BytesIO((pipe.job_dir(job) / "image.png").read_bytes()))
    assert png.size == (64, 128) and "Seed: 77" in png.text["parameters"]
    import json
    est = json.loads((pipe.job_dir(job) / "report.json").read_text())["estimate"]     # priced before it ran
    assert est["label"] == "modelled" and (est["calls"], est["passes"], est["size"]) == (3, 2, [64, 128])
    # the gallery: the job with its settings; a timing plot next to report.json shows in its card
    page.wait_for_selector(f"#job-{job} .badge.done")
    card = page.wait_for_selector(f"#job-{job}")
    text = card.inner_text()
    assert "1girl, red scarf, snow" in text and "64x128 · seed 77 · 3 steps · cfg 4 · spectrum on" in text
    assert "spectrum on · euler / sgm_uniform" in text
    assert card.query_selector("img.image") is not None
    # the job's own timing plot (drawn by the daemon before the job was done), as the page loads it
    plot = Image.open(pipe.job_dir(job) / "timing.png")
    page.wait_for_selector(f"#job-{job} img.timing")
    page.wait_for_function(f"document.querySelector('#job-{job} img.timing').naturalWidth === {plot.size[0]}")
    # the pickers: every sampler and scheduler; Spectrum switched off, saying why, for a sampler it does not fit
    assert page.input_value("#sampler") == "euler" and page.input_value("#scheduler") == "sgm_uniform"
    assert len(page.eval_on_selector_all("#sampler option", "os => os.map(o => o.value)")) == 22
    assert "karras" in page.eval_on_selector_all("#scheduler option", "os => os.map(o => o.value)")
    page.select_option("#sampler", "heun")
    assert page.is_disabled("#spectrum") and not page.is_checked("#spectrum")
    assert "Spectrum does not apply to sampler 'heun'" in page.get_attribute("label.check", "title")
    page.select_option("#sampler", "er_sde")
    assert not page.is_disabled("#spectrum")
    assert errors == []


def test_cancel_from_the_page(pipe, browser):
    page, errors = _open(browser, pipe.http_url())
    page.fill("#prompt", "a job to cancel")
    page.fill("#steps", "20")
    page.click("#go")
    page.wait_for_function("['encoding', 'denoising'].includes(document.getElementById('live-state').textContent)",
                           timeout=JOB_MS)
    page.click("#cancel")
    page.wait_for_function("document.getElementById('live-state').textContent === 'cancelled'", timeout=JOB_MS)
    job = page.text_content("#live-job").split()[-1]
    assert pipe.status(job).state == "cancelled"
    page.wait_for_selector(f"#job-{job} .badge.cancelled")
    assert errors == []


def test_fits_a_phone(pipe, browser):
    page = browser.new_page()
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(pipe.http_url())
    page.wait_for_selector(".job")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    box = page.query_selector("#go").bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 390 and box["height"] >= 36      # a finger-sized button
    cols = page.evaluate("getComputedStyle(document.getElementById('gallery')).gridTemplateColumns.split(' ').length")
    assert cols == 2


def _seconds(t: float) -> str:
    """report.js's figure for t seconds."""
    return (f"{t:.1f}" if t >= 10 else f"{t:.2f}") + " s"


def test_the_timing_report_reads_on_a_phone(pipe, browser):
    """The gallery's timing plot (timing.png, 1200 px wide) shrank to a third of a phone's width: unreadable. Its
    panels now open in the page's report view, drawn at the screen's width in the page's type: at 390 px no sideways
    scrolling, every bar inside the screen, the labels at least 11 px, one row per sampler step whose total is the
    step's wall time from report.json."""
    job = pipe.submit({"prompt": "a girl, for her timing", "seed": 4, "steps": 3, "width": 64, "height": 128})
    assert pipe.wait(job, timeout_s=JOB_MS / 1000).state == "done"
    report = pipe.report(job)
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(pipe.http_url())
    page.wait_for_selector(f"#job-{job} img.timing")
    page.click(f"#job-{job} img.timing")
    page.wait_for_selector("#report .panel.steps .bar-row")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    for sel in ("#report", "#report .bar", "#report .spark", "#report .bar-label"):
        boxes = [e.bounding_box() for e in page.query_selector_all(sel)]
        assert boxes and all(b["x"] >= 0 and b["x"] + b["width"] <= 390 + 0.5 for b in boxes), (sel, boxes)
    sizes = page.eval_on_selector_all("#report .bar-label, #report .legend li",
                                      "es => es.map(e => parseFloat(getComputedStyle(e).fontSize))")
    assert min(sizes) >= 11, sizes
    keys = ("infer_s", "lifecycle_s", "host_s", "transport_s")
    want = [_seconds(max(float(s["wall_s"]), sum(float(s.get(k, 0.0)) for k in keys))) for s in report["steps"]]
    got = page.eval_on_selector_all("#report .panel.steps .bar-total", "es => es.map(e => e.textContent)")
    assert got == want and len(got) == 3
    kinds = {k for k, v in report["branches"].items() if v.get("calls")}
    labels = page.eval_on_selector_all("#report .panel.branches .bar-label", "es => es.map(e => e.textContent)")
    assert {x.split(" (")[0] for x in labels} >= kinds, labels
    assert page.is_visible("#report .panel.memory .spark")
    page.click("#report-close")
    assert page.is_hidden("#report")
    assert errors == []


def test_the_icon_and_the_hires_mask_warning(pipe, browser, tmp_path):
    """/favicon.ico was a 404; the page's hires fix with a painted mask repaints the whole picture in its second
    pass, which only the docs said: the hires box now warns while both are set."""
    import xml.etree.ElementTree as ET
    page, errors = _open(browser, pipe.http_url())
    r = page.request.get(pipe.http_url() + "favicon.ico")
    assert r.status == 200 and r.headers["content-type"].startswith("image/svg+xml")
    assert ET.fromstring(r.body()).tag == "{http://www.w3.org/2000/svg}svg"
    assert page.get_attribute("link[rel=icon]", "href") == "/favicon.ico"
    _start_from(page, _picture(tmp_path / "warn.png"))
    page.select_option("#mask-mode", "paint")
    page.check("#hires-on")
    assert page.is_hidden("#hires-mask-hint")                  # nothing painted yet: no mask
    box = page.query_selector("#mask-canvas").bounding_box()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    assert page.is_visible("#hires-mask-hint")
    assert "repaints the whole picture" in page.inner_text("#hires-mask-hint")
    page.uncheck("#hires-on")
    assert page.is_hidden("#hires-mask-hint")
    page.check("#hires-on")
    assert page.is_visible("#hires-mask-hint")
    page.click("#mask-clear")
    assert page.is_hidden("#hires-mask-hint")
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.select_option("#mask-mode", "")
    assert page.is_hidden("#hires-mask-hint")
    assert errors == []


def test_spectrum_comes_back_and_several_loras_with_their_strengths(pipe, browser):
    """Reported: switching back from a two-call sampler left Spectrum unchecked (the next job ran without it); the
    page offered one LoRA per job and no text-encoder strength; gallery cards did not show a job's LoRAs."""
    from models.lora.choice import MAX_LORAS
    from models.lora.synth import write_lora
    from stages.config import load_config
    loras = load_config(pipe.root / "pipeline.toml").models_dir / "loras"
    loras.mkdir(exist_ok=True)
    for i, name in enumerate(("ink", "sketch")):      # text-encoder LoRAs: a plain pack takes them (the encoder's)
        write_lora("tiny", 60 + i, loras / f"{name}.safetensors", "comfy", rank=2, groups=("adapter", "te"))
    page, errors = _open(browser, pipe.http_url())
    # Spectrum: the user's choice is back once the sampler that ruled it out is gone, checked or not
    for wanted in (True, False):
        page.set_checked("#spectrum", wanted)
        page.select_option("#sampler", "heun")
        assert page.is_disabled("#spectrum") and not page.is_checked("#spectrum")
        page.select_option("#sampler", "euler")
        assert not page.is_disabled("#spectrum") and page.is_checked("#spectrum") == wanted
    page.set_checked("#spectrum", True)
    page.wait_for_selector("#lora-box:not([hidden])")
    # LoRA rows: one to start with, as many as the server takes, each with two strengths
    assert len(page.query_selector_all("#lora-rows .lora")) == 1
    while not page.is_disabled("#lora-add"):
        page.click("#lora-add")
    assert len(page.query_selector_all("#lora-rows .lora")) == MAX_LORAS
    while len(page.query_selector_all("#lora-rows .lora")) > 2:
        page.click("#lora-rows .lora:last-child .lora-remove")
    assert not page.is_disabled("#lora-add")
    chosen = [("ink.safetensors", "0.5", "0.25"), ("sketch.safetensors", "1", "0.75")]
    for row, (name, model, te) in zip(page.query_selector_all("#lora-rows .lora"), chosen):
        row.query_selector(".lora-name").select_option(name)
        row.query_selector(".lora-strength").fill(model)
        row.query_selector(".lora-clip").fill(te)
    page.fill("#prompt", "a job with two LoRAs")
    page.fill("#steps", "20")
    page.click("#go")
    page.wait_for_function("document.getElementById('live-job').textContent.startsWith('job ')")
    job = page.text_content("#live-job").split()[-1]
    import json
    spec = json.loads((pipe.job_dir(job) / "job.json").read_text())["spec"]
    assert [(x["name"], x["strength"], x["clip_strength"]) for x in spec["loras"]] == \
        [(n, float(s), float(t)) for n, s, t in chosen]
    assert spec["spectrum"] not in (False, None)
    card = page.wait_for_selector(f"#job-{job} .loras")
    assert card.inner_text() == "LoRA " + " · ".join(f"{n} {s} / text encoder {t}" for n, s, t in chosen)
    page.click("#cancel")
    page.wait_for_function("document.getElementById('live-state').textContent === 'cancelled'", timeout=JOB_MS)
    assert errors == []


# ---------------------------------------------------------------- img2img, inpaint, batch and hires from the page

def _picture(path: Path, size=(128, 128)) -> Path:
    """A smooth RGB picture (not a flat one: the encoder sees something) written as a PNG for the file input."""
    import numpy as np
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    Image.fromarray(np.stack([xx * 2, yy * 2, (xx + yy) % 256], -1).astype(np.uint8), "RGB").save(path)
    return path


def _spec(pipe, job: str) -> dict:
    import json
    return json.loads((pipe.job_dir(job) / "job.json").read_text())["spec"]


def _start_from(page, picture: Path) -> None:
    page.set_input_files("#init-file", str(picture))
    page.wait_for_function("document.getElementById('init-thumb').naturalWidth > 0 && "
                           "document.getElementById('mask-canvas').width > 0")


def _submitted(page, after: str = "") -> str:
    """The job the page queued last: a new id in the live box (`after`, the one it showed before)."""
    page.wait_for_function("([old]) => { const t = document.getElementById('live-job').textContent;"
                           "return t.startsWith('job ') && t !== 'job ' + old; }", arg=[after], timeout=JOB_MS)
    return page.text_content("#live-job").split()[-1]


def test_img2img_from_an_uploaded_image_as_a_batch_of_two(pipe, browser, tmp_path):
    """(One job for both: each costs ~20 s of stage start-ups here.) The image to start from goes up through
    /upload/image and the job names it with the slider's denoise; a batch of 2 shows both images, in the result area
    and in the gallery card."""
    page, errors = _open(browser, pipe.http_url())
    assert page.is_hidden("#denoise")                              # text-to-image: denoise 1, no slider
    _start_from(page, _picture(tmp_path / "start.png"))
    # the image's size has a pack: it is picked, no resize mode asked for; another size asks for one
    assert page.input_value("#size") == "128x128" and page.is_hidden("#resize-mode")
    assert page.text_content("#denoise-out") == "0.60"
    page.select_option("#size", "64x128")
    assert page.is_visible("#resize-mode") and page.input_value("#resize-mode") == "1"
    page.select_option("#size", "128x128")
    assert page.is_hidden("#resize-mode")
    page.eval_on_selector("#denoise", "e => { e.value = '0.45'; e.dispatchEvent(new Event('input')); }")
    assert page.text_content("#denoise-out") == "0.45"
    page.fill("#prompt", "1girl, from a picture")
    page.fill("#seed", "5")
    page.fill("#steps", "2")
    page.fill("#batch", "2")
    page.click("#go")
    job = _submitted(page)
    page.wait_for_function("document.getElementById('live-state').textContent === 'done'", timeout=JOB_MS)
    spec = _spec(pipe, job)
    assert spec["init_image"] == "page/start.png [input]" and spec["denoise"] == 0.45 and spec["batch"] == 2
    assert spec.get("resize_mode") is None and spec.get("mask") is None
    # the upload the job names holds the file's bytes; the job kept its own copy
    assert (pipe.root / "input" / "page" / "start.png").read_bytes() == (tmp_path / "start.png").read_bytes()
    assert (pipe.job_dir(job) / "init_image.png").is_file()
    # both images of the batch, in batch order, at the job's size; two different pictures (each its own place in the
    # batch's noise)
    page.wait_for_function("Array.from(document.querySelectorAll('#results img.result')).every(i => i.complete)")
    srcs = page.eval_on_selector_all("#results img.result", "is => is.map(i => [i.src, i.naturalWidth])")
    assert [s.split("filename=")[1].split("&")[0] for s, _ in srcs] == ["image.png", "image_1.png"]
    assert [w for _, w in srcs] == [128, 128]
    a, b = (Image.open(pipe.job_dir(job) / n) for n in ("image.png", "image_1.png"))
    assert a.tobytes() != b.tobytes()
    page.wait_for_selector(f"#job-{job} .badge.done")
    page.wait_for_function(f"document.querySelectorAll('#job-{job} img.image').length === 2")
    assert "from page/start.png [input] · denoise 0.45 · batch 2" in page.inner_text(f"#job-{job}")
    # clear: back to text-to-image
    page.click("#init-clear")
    assert page.is_hidden("#denoise") and page.is_hidden("#init-thumb")
    assert errors == []


DROP = """([name, b64]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const dt = new DataTransfer();
  dt.items.add(new File([bytes], name, {type: 'image/png'}));
  return dt;
}"""


def test_paint_a_mask_and_grow_it(pipe, browser, tmp_path):
    """The image dropped onto the form; a stroke painted on the canvas over it goes up as the job's mask (white where
    painted, A1111's rule); grow mask is grow_mask_by. A file that is not an image is refused next to the image."""
    import base64
    from orchestrator.engine.prompt_spec import MAX_BATCH
    page, errors = _open(browser, pipe.http_url())
    assert page.get_attribute("#batch", "max") == str(MAX_BATCH)
    from models.sampling.bounds import CFG, STEPS        # the form's bounds are the one record's (/anima/info)
    assert [float(page.get_attribute(f"#{f}", a)) for f in ("steps", "cfg", "hires-steps") for a in ("min", "max")] \
        == [STEPS.lo, STEPS.hi, CFG.lo, CFG.hi, 0, STEPS.hi]
    (tmp_path / "notes.png").write_text("not a picture")
    page.set_input_files("#init-file", str(tmp_path / "notes.png"))
    err = page.wait_for_selector("#init-box .field-error")
    assert "image" in err.inner_text() and page.is_hidden("#init-controls")
    data = base64.b64encode(_picture(tmp_path / "paint.png").read_bytes()).decode()
    page.dispatch_event("#form", "drop", {"dataTransfer": page.evaluate_handle(DROP, ["paint.png", data])})
    page.wait_for_function("document.getElementById('mask-canvas').width === 128")
    assert page.query_selector("#init-box .field-error") is None
    # the thumbnail is a data: URL, which the page's CSP allows (a blob: one it blocks; this browser bypasses the CSP
    # for Playwright's own scripts, so the rule is checked here)
    from orchestrator.http.app import PAGE_CSP
    assert page.get_attribute("#init-thumb", "src").startswith("data:image/png") and "img-src 'self' data:" in PAGE_CSP
    page.select_option("#mask-mode", "paint")
    page.eval_on_selector("#brush", "e => { e.value = '20'; e.dispatchEvent(new Event('input')); }")
    box = page.query_selector("#mask-canvas").bounding_box()
    at = lambda fx, fy: (box["x"] + fx * box["width"], box["y"] + fy * box["height"])     # noqa: E731
    page.mouse.move(*at(0.2, 0.25))
    page.mouse.down()
    for fx in (0.3, 0.4, 0.5):
        page.mouse.move(*at(fx, 0.25))
    page.mouse.up()
    page.check("#erase")                                         # erase the stroke's far end again: a click's dot
    page.mouse.click(*at(0.5, 0.25))
    page.uncheck("#erase")
    page.fill("#grow", "6")
    page.fill("#prompt", "1girl, a painted mask")
    page.fill("#steps", "20")
    page.click("#go")
    job = _submitted(page)
    spec = _spec(pipe, job)
    assert spec["mask"] == "page/mask.png [input]" and spec["grow_mask_by"] == 6 and spec.get("mask_channel") is None
    # the job's mask (kept at submit, 255 = repaint): white along the stroke, black far from it. The stroke's middle
    # in image pixels, from where the mouse went on the displayed canvas (128 px image)
    import numpy as np
    mask = np.asarray(Image.open(pipe.job_dir(job) / "mask.png"))
    assert mask.shape == (128, 128)
    for fx in (0.2, 0.3, 0.4):
        assert mask[round(0.25 * 128), round(fx * 128)] == 255, fx
    assert mask[round(0.25 * 128), round(0.5 * 128)] == 0                     # erased
    assert mask[100, 100] == 0 and mask[round(0.25 * 128), 100] == 0 and mask[10, 10] == 0
    page.click("#cancel")
    page.wait_for_function("document.getElementById('live-state').textContent === 'cancelled'", timeout=JOB_MS)
    # clear: the canvas is empty again
    page.click("#mask-clear")
    assert page.evaluate("(() => { const c = document.getElementById('mask-canvas');"
                         "return Math.max(...c.getContext('2d').getImageData(0, 0, c.width, c.height).data); })()") == 0
    # a mask file instead: uploaded as it is, the job's mask is its white
    grey = np.zeros((128, 128), np.uint8)
    grey[:, 64:] = 255
    Image.fromarray(grey, "L").save(tmp_path / "right.png")
    page.select_option("#mask-mode", "file")
    assert page.is_hidden("#mask-canvas") and page.is_hidden("#brush")
    # a mask file that is not an image: refused in the mask row when it comes back, and once again (not twice) by a
    # Generate that needs it; no job is queued
    page.set_input_files("#mask-file", str(tmp_path / "notes.png"))
    page.wait_for_selector("[data-field~=mask] .field-error")
    page.click("#go")
    page.wait_for_function("document.querySelectorAll('[data-field~=mask] .field-error').length === 1 && "
                           "!document.getElementById('go').disabled")
    assert page.text_content("#live-job") == "job " + job
    page.set_input_files("#mask-file", str(tmp_path / "right.png"))
    page.fill("#grow", "")
    page.click("#go")
    job = _submitted(page, after=job)
    spec = _spec(pipe, job)
    assert spec["mask"] == "page/right.png [input]" and spec.get("grow_mask_by") is None
    assert np.array_equal(np.asarray(Image.open(pipe.job_dir(job) / "mask.png")), grey)
    page.click("#cancel")
    page.wait_for_function("document.getElementById('live-state').textContent === 'cancelled'", timeout=JOB_MS)
    assert errors == []


def test_hires_controls(pipe, browser):
    page, errors = _open(browser, pipe.http_url())
    # the methods come from the server (both spaces); the second sizes are the other sizes with a pack
    from models.sampling.latent_ops import IMAGE_SCALE_METHODS, UPSCALE_METHODS
    assert page.eval_on_selector_all("#hires-method option", "os => os.map(o => o.value)") == \
        [f"latent:{m}" for m in UPSCALE_METHODS] + [f"pixel:{m}" for m in IMAGE_SCALE_METHODS]
    assert page.is_hidden("#hires-scale")
    page.check("#hires-on")
    assert page.input_value("#hires-denoise") == "0.5" and page.input_value("#hires-method") == "latent:nearest-exact"
    page.select_option("#size", "64x128")
    assert page.eval_on_selector_all("#hires-to option", "os => os.map(o => o.value)") == ["scale", "128x128"]
    # scale 2 of 64x128 is 128x256, which has no pack: the refusal lands in the hires box, naming the sizes
    page.fill("#prompt", "1girl, hires")
    page.fill("#hires-scale", "2")
    page.click("#go")
    err = page.wait_for_selector("#hires-box .field-error")
    assert "128x256 has no model pack" in err.inner_text() and "128x128" in err.inner_text()
    assert page.is_hidden("#error")
    # a size with a pack: the job carries hires as the controls set it
    page.select_option("#hires-to", "128x128")
    assert page.is_hidden("#hires-scale")
    page.select_option("#hires-method", "latent:bilinear")
    page.fill("#hires-steps", "2")
    page.fill("#hires-denoise", "0.4")
    page.fill("#steps", "20")
    page.click("#go")
    job = _submitted(page)
    assert page.query_selector("#hires-box .field-error") is None           # the last refusal is gone
    h = _spec(pipe, job)["hires"]
    assert (h["width"], h["height"], h["scale"], h["method"], h["space"], h["steps"], h["denoise"]) == \
        (128, 128, None, "bilinear", "latent", 2, 0.4)
    page.wait_for_selector(f"#job-{job}")
    assert "hires 128x128 bilinear denoise 0.40 2 steps" in page.inner_text(f"#job-{job}")
    page.click("#cancel")
    page.wait_for_function("document.getElementById('live-state').textContent === 'cancelled'", timeout=JOB_MS)
    assert errors == []
