"""The web page in a real browser: Debian's Chromium, headless, driven by Playwright, against the real pipeline with
two packs (128x128, the default, and 64x128). Submit from the page, see the progress advance (step, block, ETA),
see the image at the chosen size; the gallery shows the job with its settings and its timing plot; cancel; a phone
sized window has no sideways scrolling. No Chromium is a failure, not a skip (`make test` installs it)."""
from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path

import pytest
from PIL import Image

from tests.pipeline_harness import Pipeline, tiny_assets

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]          # --headless: Playwright's headless=True adds it
JOB_MS = 600_000


@pytest.fixture(scope="module")
def pipe():
    cache = Path(tempfile.mkdtemp(prefix="anima-page-assets-"))
    p = None
    try:
        models, pack = tiny_assets(cache, (128, 128))
        _, tall = tiny_assets(cache, (64, 128))
        p = Pipeline.start(models, pack, threads=1, packs=[tall], timing_plot=True)
        p.http_url()
        yield p
    finally:
        if p is not None:
            assert p.stop() == []
            assert p.leftover_segments() == []
        shutil.rmtree(cache, ignore_errors=True)


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


def test_submit_see_progress_and_the_image(pipe, browser):
    url = pipe.http_url()
    page, errors = _open(browser, url)
    sizes = page.eval_on_selector_all("#size option", "os => os.map(o => o.value)")
    assert sizes == ["128x128", "64x128"]
    page.fill("#prompt", "1girl, red scarf, snow")
    page.fill("#negative", "worst quality")
    page.fill("#seed", "77")
    page.fill("#steps", "3")
    page.select_option("#size", "64x128")
    page.evaluate(WATCH)
    page.click("#go")
    page.wait_for_function("document.getElementById('live-state').textContent === 'done'", timeout=JOB_MS)
    seen = page.evaluate("window.__seen")
    # progress advanced: denoising lines with step/block/ETA, the bar only going up, several distinct values
    denoising = [(b, t) for b, t in seen if t.startswith("step ")]
    assert any("block " in t and "ETA " in t and "ETA ?" not in t for _, t in denoising), seen
    assert len({t.split(" · ETA")[0] for _, t in denoising}) >= 2, seen        # more than one step/block position
    bars = [b for b, _ in denoising]
    assert bars == sorted(bars) and len(set(bars)) >= 2, seen
    assert [b for b, _ in seen] == sorted(b for b, _ in seen), seen            # never backwards, start to end
    # the image, at the size picked: the second pack's
    assert page.is_visible("#result")
    page.wait_for_function("document.getElementById('result').complete")
    assert page.evaluate("[document.getElementById('result').naturalWidth, "
                         "document.getElementById('result').naturalHeight]") == [64, 128]
    job = page.text_content("#live-job").split()[-1]
    png = Image.open(io.BytesIO((pipe.job_dir(job) / "image.png").read_bytes()))
    assert png.size == (64, 128) and "Seed: 77" in png.text["parameters"]
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
