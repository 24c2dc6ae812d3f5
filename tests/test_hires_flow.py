"""prompt.json `hires` through the real daemon and supervisord with stand-in stages (tests/orch_doubles.py), two fake
packs (64x64, 96x96): the first pass's latent kept as latent.npy, upscaled as LatentUpscaleBy and sampled again on the
96x96 pack from it (the double gives 2 * init_latent + denoise: the test sees the upscaled latent that reached the
scheduler), decoded at 96x96 with A1111's hires labels; a daemon killed mid second pass resumes it to the same latent
bitwise; a second-pass size without a pack is refused at submit naming the sizes there are. On the same doubles, the
plan's conditioning-operation and ImageCrop steps killed at each step (daemon, encoder, VAE) and resumed bitwise."""
from __future__ import annotations

import io
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from orchestrator.terminal.cli import CliError
from orchestrator.engine.inputs import save_upload
from orchestrator.engine.report import format_table
from tests.doubles_harness import Doubles

SIZES = [(64, 64), (96, 96)]


@pytest.fixture(scope="module")
def d():
    root = Path(tempfile.mkdtemp(prefix="anima-hires-"))
    with Doubles.start(root, SIZES) as d:
        yield d


@pytest.fixture(autouse=True)
def _flags(d):
    d.flag("double_step_s", None)


def _init_image(d, name: str, seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    assert save_upload(d.rf.root, "input", "h", name, buf.getvalue(), overwrite=True) == name
    return f"h/{name} [input]"



def _torch_upscaled(latent: np.ndarray, size: tuple, mode: str) -> np.ndarray:
    """ComfyUI's common_upscale for these modes is torch's interpolate (align_corners False for bilinear)."""
    x = torch.from_numpy(latent[None])
    kw = {"align_corners": False} if mode == "bilinear" else {}
    return F.interpolate(x, size=size, mode=mode, **kw)[0].numpy()


@pytest.mark.parametrize("method", ["bilinear", "nearest-exact"])
def test_hires_upscales_the_first_latent_and_samples_it_again_on_the_larger_pack(d, method):
    job = d.submit({"prompt": "a girl", "seed": 3, "steps": 2, "denoise": 0.8,
                    "init_image": _init_image(d, "first.png", 1),
                    "hires": {"scale": 1.5, "method": method, "steps": 3, "denoise": 0.5}})
    info = d.wait(job, ("done", "failed"))
    assert info.state == "done", info
    jd = d.rf.jobs / job
    first = np.load(jd / "latent.npy")
    np.testing.assert_array_equal(first, (2 * np.load(jd / "init_latent.npy") + np.float32(0.8)).astype(np.float32))
    hires = np.load(jd / "hires_latent.npy")
    assert hires.shape == (first.shape[0], 12, 12)
    want = 2 * _torch_upscaled(first, (12, 12), method) + 0.5
    np.testing.assert_allclose(hires, want, rtol=0, atol=1e-5)
    with Image.open(jd / "image.png") as im:
        assert im.size == (96, 96)
        params = im.text["parameters"]
    label = {"bilinear": "Latent", "nearest-exact": "Latent (nearest-exact)"}[method]
    assert "Size: 64x64," in params and "Denoising strength: 0.5," in params
    assert f"Hires upscale: 1.5, Hires steps: 3, Hires upscaler: {label}," in params
    report = json.loads((jd / "report.json").read_text())
    # both sampling passes counted: the first pass's 2 steps and the hires pass's 3 (the double makes 3 calls a step)
    assert report["computed_steps"] == [1, 2, 1, 2, 3] and report["branch_calls"] == 3 * (2 + 3)
    assert [(p["image"], p["pass"], p["branch_calls"]) for p in report["passes"]] == [(1, "first", 6),
                                                                                      (1, "hires", 9)]
    assert report["branches"]["self"]["calls"] == 2 + 3
    assert "15 branch calls, 5 computed steps" in format_table(report)


def test_daemon_killed_mid_second_pass_resumes_it_to_the_same_latent(d):
    d.flag("double_step_s", "0.3")
    job = d.submit({"prompt": "a girl", "seed": 5, "steps": 1, "denoise": 0.8,
                    "init_image": _init_image(d, "resume.png", 2),
                    "hires": {"width": 96, "height": 96, "method": "bilinear", "steps": 6, "denoise": 0.6}})
    jd = d.rf.jobs / job
    state = jd / "hires" / "state.json"
    deadline = time.monotonic() + 60
    while not (state.exists() and json.loads(state.read_text() or "{}").get("step", 0) >= 2):
        assert time.monotonic() < deadline, d.logs()
        time.sleep(0.05)
    first = (jd / "latent.npy").stat().st_mtime_ns
    d.sigkill("orchestrator")                                 # supervisord restarts it; the job resumes in place
    d.flag("double_step_s", "0.02")
    info = d.wait(job, ("done", "failed"), timeout_s=90)
    assert info.state == "done", info
    assert (jd / "latent.npy").stat().st_mtime_ns == first            # the first pass was not sampled again
    report = json.loads((jd / "report.json").read_text())
    assert report["resumed_from"] >= 2                                # the second pass went on from its step
    first_latent = np.load(jd / "latent.npy")
    want = 2 * _torch_upscaled(first_latent, (12, 12), "bilinear") + 0.6
    np.testing.assert_allclose(np.load(jd / "hires_latent.npy"), want, rtol=0, atol=1e-5)
    with Image.open(jd / "image.png") as im:
        assert im.size == (96, 96) and "Hires resize: 96x96," in im.text["parameters"]


def test_a_graphs_text_to_image_hires_fix_at_the_first_size_runs_on_the_one_pack(d):
    """ComfyUI's refine pass (KSampler -> LatentUpscaleBy 1.0 -> KSampler denoise 0.5) mapped by the graph front: a
    text-to-image job whose second pass is on the first pass's pack (its arena had no init latent slot: the job
    failed there before)."""
    from orchestrator.http.comfy_graph import graph_to_job
    from tests.test_comfy_hires_graph import hires_graph
    spec = graph_to_job(hires_graph(scale_by=1.0), sizes=SIZES).spec
    assert spec["hires"] == {"method": "nearest-exact", "scale": 1.0, "steps": 4, "denoise": 0.5}
    job = d.submit(spec)
    info = d.wait(job, ("done", "failed"))
    assert info.state == "done", info
    jd = d.rf.jobs / job
    want = 2 * _torch_upscaled(np.load(jd / "latent.npy"), (8, 8), "nearest-exact") + 0.5
    np.testing.assert_allclose(np.load(jd / "hires_latent.npy"), want, rtol=0, atol=1e-6)
    with Image.open(jd / "image.png") as im:
        assert im.size == (64, 64) and "Hires upscale: 1.0, Hires steps: 4," in im.text["parameters"]


def test_bislerp_upscales_the_latent_in_vae_space_as_comfyui(d):
    """ComfyUI's LatentUpscale sees a KSampler's LATENT in VAE space (process_latent_out: z * std + mean); bislerp
    slerps across channels, so upscaling the model-space latent gave another latent (max difference ~1.5 on a
    random one). Reference: ComfyUI's bislerp written in torch (tests/test_hires_batch.py) on the VAE-space latent."""
    from models.vae.latent import denormalize, normalize
    from tests.test_hires_batch import _torch_bislerp
    job = d.submit({"prompt": "a girl", "seed": 4, "steps": 2, "denoise": 0.8,
                    "init_image": _init_image(d, "bs.png", 4),
                    "hires": {"scale": 1.5, "method": "bislerp", "steps": 2, "denoise": 0.5}})
    info = d.wait(job, ("done", "failed"))
    assert info.state == "done", info
    jd = d.rf.jobs / job
    vae = torch.from_numpy(denormalize(np.load(jd / "latent.npy"))[None])
    want = 2 * normalize(_torch_bislerp(vae, 12, 12)[0].numpy()) + np.float32(0.5)
    np.testing.assert_allclose(np.load(jd / "hires_latent.npy"), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("hires, extra, field, words", [
    ({"scale": 2.0}, {}, "hires", "128x128 has no model pack; the sizes with a pack: 64x64, 96x96"),
    ({"width": 96}, {}, "hires", "either scale, or both width and height"),
    ({"scale": 1.5, "denoise": 0}, {}, "hires.denoise", "(0, 1]"),
    # int(steps / denoise) sigmas: refused at submit, not after the whole first pass
    ({"scale": 1.5, "denoise": 1e-7}, {}, "hires.denoise", "the limit is 10000 (ComfyUI's KSampler steps maximum)"),
    ({"scale": 1.5, "method": "lanczos"}, {}, "hires.method", "lanczos scales pixels"),
    ({"scale": 1.5, "sampler": "heun"}, {"spectrum": True}, "hires.sampler", "Spectrum does not apply to sampler"),
    ({"scale": 1.5, "space": "pixel", "method": "bislerp"}, {}, "hires.method", "bislerp scales latents"),
    ({"scale": 1.25, "space": "pixel"}, {}, "hires", "80x80 has no model pack"),
])
def test_bad_hires_is_refused_at_submit_naming_the_field(d, hires, extra, field, words):
    before = sorted(p.name for p in d.rf.jobs.iterdir())
    with pytest.raises((CliError, ValueError)) as e:
        d.submit({"prompt": "a girl", "seed": 1, "steps": 2, "width": 64, "height": 64, "hires": hires, **extra})
    assert f"'{field}'" in str(e.value) and words in str(e.value), str(e.value)
    assert sorted(p.name for p in d.rf.jobs.iterdir()) == before


def test_a_crash_leaves_no_hires_temporaries_behind(tmp_path):
    """At a daemon's start hires_latent.npy's temporaries go (the daemon's own), and a stage's stale ones in the
    second pass's state folder hires/; a fresh one (a stage may be writing it) stays."""
    from orchestrator.engine.jobs import JOB_FILE, JobStore
    store = JobStore(tmp_path)
    jd = store.root / "20260101-120000-c3d4e5"
    (jd / "hires").mkdir(parents=True)
    (jd / "hires_1").mkdir()
    (jd / JOB_FILE).write_text("{}")
    mine = [jd / ".hires_latent.npy.k3.tmp", jd / ".first_1.png.k4.tmp", jd / ".hires_init.npy.k5.tmp",
            jd / ".hires_cond.npy.k6.tmp", jd / ".hires_latent_2.npy.k7.tmp", jd / ".base.png.k8.tmp",
            jd / ".base_1.png.k9.tmp"]
    stale = [jd / "hires" / ".s.json.a1.tmp", jd / "hires_1" / ".s.json.a2.tmp"]
    fresh = jd / "hires" / ".s.json.b2.tmp"
    for p in (*mine, *stale, fresh):
        p.write_bytes(b"x")
    old = time.time() - 3600
    for p in stale:
        os.utime(p, (old, old))
    removed = store.clean()
    assert not any(p.exists() for p in (*mine, *stale)) and fresh.exists(), removed


def test_a1111_enable_hr_returns_the_upscaled_image(d):
    import base64
    import requests
    url = d.http_url() + "sdapi/v1/txt2img"
    base = {"prompt": "a girl", "seed": 8, "steps": 1, "width": 64, "height": 64, "enable_hr": True}
    r = requests.post(url, json={**base, "hr_scale": 1.5, "hr_upscaler": "Latent (nearest-exact)",
                                 "hr_second_pass_steps": 2, "denoising_strength": 0.4}, timeout=120)
    assert r.status_code == 200, r.text
    with Image.open(io.BytesIO(base64.b64decode(r.json()["images"][0]))) as im:
        assert im.size == (96, 96)                       # int(64 * 1.5), as A1111 computes the second size
        assert "Denoising strength: 0.4, Hires upscale" not in im.text["parameters"]     # A1111's resize form
        assert "Hires resize: 96x96, Hires steps: 2, Hires upscaler: Latent (nearest-exact)," in im.text["parameters"]
    job = json.loads(r.json()["info"])["extra_generation_params"]["Job"]
    first = np.load(d.rf.jobs / job / "latent.npy")
    want = 2 * _torch_upscaled(first, (12, 12), "nearest-exact") + 0.4
    np.testing.assert_allclose(np.load(d.rf.jobs / job / "hires_latent.npy"), want, rtol=0, atol=1e-5)
    for extra, field in (({"hr_upscaler": "R-ESRGAN 4x+"}, "hr_upscaler"), ({"hr_resize_x": 96}, "hr_resize_x"),
                         ({"hr_scale": 2.0}, "hires"), ({"hr_upscaler": "Latent (antialiased)"}, "hr_upscaler"),
                         ({"hr_sampler_name": "PLMS"}, "hr_sampler_name"), ({"hr_scheduler": "Nope"}, "hr_scheduler"),
                         ({"hr_checkpoint_name": "other.safetensors"}, "hr_checkpoint_name"),
                         ({"hr_prompt": "a <lora:x:1>"}, "hr_prompt"), ({"hr_cfg": 99}, "hr_cfg")):
        r = requests.post(url, json={**base, **extra}, timeout=30)
        assert r.status_code == 422 and field in r.text, (extra, r.text)


def _log(d, name: str, job: str) -> list[dict]:
    """The doubles' JSON lines (RUN/double_denoises, RUN/double_encodes) of one job."""
    p = d.rf.root / name
    rows = [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []
    return [r for r in rows if job in r.get("job_dir", job)]


def test_the_second_pass_runs_with_its_own_settings_and_prompts(d):
    """hires' sampler, scheduler, cfg, seed and prompts reach the second DENOISE (and only it); its prompts are
    encoded in the first pass's encoder session, kept as hires_cond/uncond.npy, labelled as A1111 labels them."""
    before = len(_log(d, "double_encodes", ""))
    job = d.submit({"prompt": "a girl", "negative_prompt": "bad", "seed": 3, "steps": 2, "cfg": 4.0,
                    "sampler": "euler", "scheduler": "simple",
                    "hires": {"scale": 1.5, "steps": 3, "denoise": 0.5, "sampler": "heun", "scheduler": "karras",
                              "cfg": 6.5, "seed": 77, "prompt": "a tall girl, red", "negative_prompt": "blurry"}})
    info = d.wait(job, ("done", "failed"))
    assert info.state == "done", info
    jd = d.rf.jobs / job
    first, second = _log(d, "double_denoises", job)
    assert (first["sampler"], first["scheduler"], first["cfg"], first["seed"], first["steps"]) == \
        ("euler", "simple", 4.0, 3, 2)
    assert (first["cond"], first["uncond"]) == (len("a girl"), len("bad"))      # the encoder double: len(prompt)
    assert (second["sampler"], second["scheduler"], second["cfg"], second["seed"], second["steps"]) == \
        ("heun", "karras", 6.5, 77, 3)
    assert (second["cond"], second["uncond"]) == (len("a tall girl, red"), len("blurry"))
    assert second["spectrum"] is False and first["spectrum"] is True     # Spectrum does not fit heun: off for it
    assert (second["width"], second["height"]) == (96, 96)
    encodes = _log(d, "double_encodes", "")[before:]
    assert [(e["prompt"], e["negative"]) for e in encodes] == [("a girl", "bad"), ("a tall girl, red", "blurry")]
    assert encodes[0]["pid"] == encodes[1]["pid"]                          # one encoder session for both
    np.testing.assert_array_equal(np.load(jd / "hires_cond.npy"), np.full((512, 128), 16.0, np.float32))
    with Image.open(jd / "image.png") as im:
        params = im.text["parameters"]
    assert ("Hires upscaler: Latent (nearest-exact), Hires sampler: Heun, Hires schedule type: Karras, "
            "Hires CFG Scale: 6.5, Hires prompt: \"a tall girl, red\", Hires negative prompt: blurry, "
            "Hires seed: 77,") in params, params


def _first_image(latent: np.ndarray) -> np.ndarray:
    """The VAE double's picture of a latent (tests/orch_doubles.py): int(latent[0]) % 256 per 8x8 block, grey."""
    cells = (latent[0].astype(np.int64) % 256).astype(np.uint8)
    return np.repeat(np.repeat(cells, 8, 0), 8, 1)[..., None].repeat(3, 2)


def _scaled_reference(pixels: np.ndarray, size: tuple, method: str) -> np.ndarray:
    """ComfyUI's ImageScale in torch / Pillow directly: interpolate on u8 / 255, or Pillow's LANCZOS on 8 bits."""
    if method == "lanczos":
        im = Image.fromarray(pixels).resize((size[1], size[0]), resample=Image.Resampling.LANCZOS)
        return np.asarray(im, dtype=np.float32).transpose(2, 0, 1) / np.float32(255.0)
    x = torch.from_numpy(pixels.astype(np.float32) / 255.0).movedim(-1, 0)[None]
    return F.interpolate(x, size=size, mode=method)[0].numpy()


def _encoded_reference(unit: np.ndarray) -> np.ndarray:
    """The VAE double's VAE_ENCODE of the [0, 1] image, without its jitter (< 1e-3): 8x8 means of 2 x - 1."""
    image = np.clip(unit, 0, 1) * 2 - 1
    _, h, w = image.shape
    pooled = image.reshape(3, h // 8, 8, w // 8, 8).mean(axis=(2, 4))
    return pooled[np.arange(16) % 3]


@pytest.mark.parametrize("method", ["lanczos", "bicubic"])
def test_the_pixel_path_decodes_scales_and_encodes_each_image_of_a_batch(d, method):
    job = d.submit({"prompt": "a girl", "seed": 4, "steps": 2, "batch": 2,
                    "hires": {"scale": 1.5, "space": "pixel", "method": method, "steps": 2, "denoise": 0.7}})
    info = d.wait(job, ("done", "failed"))
    assert info.state == "done", info
    jd = d.rf.jobs / job
    rows = _log(d, "double_denoises", job)
    assert [(r["batch_size"], r["batch_pos"], r["width"]) for r in rows] == [(2, 0, 64), (2, 1, 64), (2, 0, 96),
                                                                              (2, 1, 96)]
    for pos, suffix in enumerate(("", "_1")):
        first = np.load(jd / f"latent{suffix}.npy")
        with Image.open(jd / f"first{suffix}.png") as im:
            pixels = np.asarray(im.convert("RGB"))
        np.testing.assert_array_equal(pixels, _first_image(first))        # the first pass's latent, decoded
        start = np.load(jd / f"hires_init{suffix}.npy")
        want = _encoded_reference(_scaled_reference(pixels, (96, 96), method))
        np.testing.assert_allclose(start, want, rtol=0, atol=1.1e-3)          # the double's jitter is < 1e-3
        hires = np.load(jd / f"hires_latent{suffix}.npy")
        np.testing.assert_array_equal(hires, (2 * start + np.float32(0.7)).astype(np.float32))
        with Image.open(jd / f"image{suffix}.png") as im:
            assert im.size == (96, 96)
            p = im.text["parameters"]
        upscaler = {"lanczos": "Lanczos", "bicubic": "bicubic"}[method]
        assert f"Batch size: 2, Batch pos: {pos}," in p and f"Hires upscaler: {upscaler}," in p, p
    report = json.loads((jd / "report.json").read_text())
    assert [i["latent"].rsplit("/", 1)[1] for i in report["images"]] == ["hires_latent.npy", "hires_latent_1.npy"]
    from orchestrator.engine.job_files import JOB_FILES, names
    table = {n for f in JOB_FILES for n in names(f)}
    left = {p.name for p in jd.iterdir() if p.is_file()} - {"state.json"}     # the scheduler double's step state
    assert {"first_1.png", "hires_init_1.npy", "hires_latent_1.npy", "latent_1.npy", "report.json"} <= left
    assert left <= table, left - table             # every file the flow left is in the job folder's one table


@pytest.mark.parametrize("space", ["latent", "pixel"])
def test_keep_base_keeps_and_delivers_each_first_image_in_the_vae_sessions_the_job_has_anyway(d, space, tmp_path):
    """hires.keep_base: each image's first pass decoded as the VAE decodes it (base.png, base_1.png: the first size,
    the job's metadata), copied next to `output` as NAME_base.png; the latent path decodes them in the final decodes'
    VAE session, the pixel path keeps its own decode of them (no first.png): no VAE start more than without it."""
    pixel = space == "pixel"
    hires = {"scale": 1.5, "steps": 2, "denoise": 0.5, **({"space": "pixel", "method": "bilinear"} if pixel else {})}
    out = tmp_path / "pic.png"
    job = d.submit({"prompt": "a girl", "seed": 4, "steps": 2, "batch": 2, "output": str(out),
                    "hires": {**hires, "keep_base": True}})
    info = d.wait(job, ("done", "failed"))
    assert info.state == "done", info
    jd = d.rf.jobs / job
    for pos, suffix in enumerate(("", "_1")):
        with Image.open(jd / f"base{suffix}.png") as im:
            assert im.size == (64, 64)
            want = _first_image(np.load(jd / f"latent{suffix}.npy"))
            np.testing.assert_array_equal(np.asarray(im.convert("RGB")), want)
            assert f"Batch pos: {pos}," in im.text["parameters"] and "Hires upscale: 1.5" in im.text["parameters"]
        assert (tmp_path / f"pic_base{suffix}.png").read_bytes() == (jd / f"base{suffix}.png").read_bytes()
        with Image.open(jd / f"image{suffix}.png") as im:
            assert im.size == (96, 96)
    assert not (jd / "first.png").exists()
    report = json.loads((jd / "report.json").read_text())
    assert report["base_images"] == [str(tmp_path / "pic_base.png"), str(tmp_path / "pic_base_1.png")]
    assert report["stage_starts"]["vae"] == (2 if pixel else 1)
    assert report["teardown"]["vae_running_during_denoise"] is False


def test_a_pixel_hires_batch_killed_mid_encode_and_mid_second_pass_resumes_to_the_same_latents(d):
    """Killed while the VAE encodes image 0's scaled picture, then while image 1's second pass samples: first.png is
    not decoded again, hires_init*.npy not encoded again, image 0's second pass not sampled again."""
    d.flag("double_vae_encode_s", "4")
    job = d.submit({"prompt": "a girl", "seed": 6, "steps": 1, "batch": 2,
                    "hires": {"width": 96, "height": 96, "space": "pixel", "method": "bilinear", "steps": 6,
                              "denoise": 0.6}})
    jd = d.rf.jobs / job
    deadline = time.monotonic() + 60
    while not (d.rf.root / "double_vae_encoding").exists():
        assert time.monotonic() < deadline, d.logs()
        time.sleep(0.05)
    (d.rf.root / "double_vae_encoding").unlink()
    assert (jd / "first.png").exists() and not (jd / "hires_init.npy").exists()
    first_png = (jd / "first.png").stat().st_mtime_ns
    d.sigkill("orchestrator")                                 # supervisord restarts it; the job resumes in place
    d.flag("double_step_s", "0.3")
    state = jd / "hires_1" / "state.json"
    while not (state.exists() and json.loads(state.read_text() or "{}").get("step", 0) >= 2):
        assert time.monotonic() < deadline + 60, d.logs()
        time.sleep(0.05)
    kept = {n: (jd / n).stat().st_mtime_ns for n in ("first.png", "first_1.png", "hires_init.npy",
                                                      "hires_init_1.npy", "hires_latent.npy")}
    d.sigkill("orchestrator")
    d.flag("double_step_s", "0.02")
    info = d.wait(job, ("done", "failed"), timeout_s=90)
    assert info.state == "done", info
    assert (jd / "first.png").stat().st_mtime_ns == first_png
    assert {n: (jd / n).stat().st_mtime_ns for n in kept} == kept
    assert json.loads((jd / "report.json").read_text())["resumed_from"] >= 2
    for suffix in ("", "_1"):
        start = np.load(jd / f"hires_init{suffix}.npy")
        np.testing.assert_array_equal(np.load(jd / f"hires_latent{suffix}.npy"),
                                      (2 * start + np.float32(0.6)).astype(np.float32))
        with Image.open(jd / f"first{suffix}.png") as im:
            want = _encoded_reference(_scaled_reference(np.asarray(im.convert("RGB")), (96, 96), "bilinear"))
        np.testing.assert_allclose(start, want, rtol=0, atol=1.1e-3)


def test_a1111_hires_fields_map_onto_prompt_json_hires():
    from orchestrator.http.a1111 import hires_of, to_spec
    body = {"prompt": "a girl", "negative_prompt": "bad", "width": 64, "height": 64, "sampler_name": "DPM++ 2M",
            "scheduler": "Karras", "cfg_scale": 5, "enable_hr": True, "hr_scale": 1.5}
    spec = to_spec(body)
    assert hires_of({**body, "hr_upscaler": "Lanczos"}, spec) == {
        "width": 96, "height": 96, "space": "pixel", "method": "lanczos", "steps": 0, "denoise": 0.75}
    got = hires_of({**body, "hr_upscaler": "Nearest", "hr_prompt": "a tall girl", "hr_negative_prompt": "bad",
                    "hr_sampler_name": "Euler a", "hr_scheduler": "Use same scheduler", "hr_cfg": 6.5}, spec)
    assert (got["space"], got["method"]) == ("pixel", "nearest-exact")
    assert {k: got[k] for k in ("prompt", "sampler", "cfg")} == {"prompt": "a tall girl", "sampler": "euler_ancestral",
                                                                 "cfg": 6.5}
    assert "negative_prompt" not in got and "scheduler" not in got       # the same as the first pass's: not its own
    got = hires_of({**body, "hr_sampler_name": "Use same sampler", "hr_scheduler": "Exponential", "hr_prompt": ""},
                   spec)
    assert got["scheduler"] == "exponential" and "sampler" not in got and "prompt" not in got
    assert hires_of({**body, "enable_hr": False}, spec) is None


def test_a1111_pixel_hires_with_a_batch_and_its_own_settings(d):
    """enable_hr with "Lanczos", hr_prompt, hr_sampler_name, hr_scheduler, Forge's hr_cfg and batch_size 2: two jobs
    (seeds seed, seed + 1), each decoded, scaled, encoded and sampled again with the second pass's settings, each PNG
    with A1111's labels for them."""
    import base64
    import requests
    url = d.http_url() + "sdapi/v1/txt2img"
    r = requests.post(url, json={"prompt": "a girl", "seed": 20, "steps": 1, "width": 64, "height": 64,
                                 "batch_size": 2, "enable_hr": True, "hr_scale": 1.5, "hr_upscaler": "Lanczos",
                                 "hr_second_pass_steps": 2, "denoising_strength": 0.5, "hr_prompt": "a tall girl",
                                 "hr_sampler_name": "DPM++ 2M", "hr_scheduler": "Karras", "hr_cfg": 5.5},
                      timeout=120)
    assert r.status_code == 200, r.text
    info = json.loads(r.json()["info"])
    assert info["all_seeds"] == [20, 21] and len(r.json()["images"]) == 2
    params = r.json()["parameters"]                   # what ran, both passes' samplers in A1111's labels
    assert {k: params[k] for k in ("sampler_name", "scheduler", "hr_sampler_name", "hr_scheduler", "seed")} == {
        "sampler_name": "Euler", "scheduler": "SGM Uniform", "hr_sampler_name": "DPM++ 2M", "hr_scheduler": "Karras",
        "seed": 20}
    for k, b64 in enumerate(r.json()["images"]):
        with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
            assert im.size == (96, 96)
            p = im.text["parameters"]
        assert f"Seed: {20 + k}," in p and "Hires upscaler: Lanczos, Hires sampler: DPM++ 2M, " \
            "Hires schedule type: Karras, Hires CFG Scale: 5.5, Hires prompt: a tall girl" in p, p
        job = json.loads(im.text["anima"])["job"]
        second = _log(d, "double_denoises", job)[-1]
        assert (second["sampler"], second["scheduler"], second["cfg"], second["seed"], second["cond"]) == \
            ("dpmpp_2m", "karras", 5.5, 20 + k, len("a tall girl"))
        jd = d.rf.jobs / job
        with Image.open(jd / "first.png") as im:
            pixels = np.asarray(im.convert("RGB"))
        want = _encoded_reference(_scaled_reference(pixels, (96, 96), "lanczos"))
        np.testing.assert_allclose(np.load(jd / "hires_init.npy"), want, rtol=0, atol=1.1e-3)


SPLIT = {"prompt": "a girl", "seed": 8, "steps": 6, "cfg": 4.0, "end_step": 3, "leftover_noise": True,
         "hires": {"steps": 6, "denoise": 1.0, "start_step": 3, "add_noise": False, "cfg": 1.5, "sampler": "euler"}}


def test_split_sampling_killed_inside_and_between_its_passes_resumes_them(d):
    """A chained second pass (split sampling: the first window 0..3 with its leftover noise, the second 3..end
    without noise, its own cfg and sampler) on the first pack, killed inside the first pass, as its latent is kept
    (between the passes) and inside the second: neither pass is sampled again from its start, each DENOISE carries
    its own window, and the latents are bitwise those of the same job undisturbed."""
    from models.vae.latent import denormalize, normalize
    quiet = d.submit(SPLIT)
    assert d.wait(quiet, ("done", "failed")).state == "done"
    d.flag("double_step_s", "0.3")
    job = d.submit(SPLIT)
    jd = d.rf.jobs / job

    def kill_when(done) -> None:
        deadline = time.monotonic() + 60
        while not done():
            assert time.monotonic() < deadline, d.logs()
            time.sleep(0.02)
        d.sigkill("orchestrator")                                 # supervisord restarts it; the job resumes in place

    def step(state: Path) -> int:
        return json.loads(state.read_text() or "{}").get("step", 0) if state.exists() else 0
    kill_when(lambda: step(jd / "state.json") >= 2)                          # inside the first pass
    kill_when(lambda: (jd / "latent.npy").exists())                          # between the passes
    first = (jd / "latent.npy").stat().st_mtime_ns
    kill_when(lambda: step(jd / "hires" / "state.json") >= 2)                # inside the second
    d.flag("double_step_s", "0.02")
    info = d.wait(job, ("done", "failed"), timeout_s=90)
    assert info.state == "done", info
    assert (jd / "latent.npy").stat().st_mtime_ns == first               # the first pass was not sampled again
    assert json.loads((jd / "report.json").read_text())["resumed_from"] >= 2
    qd = d.rf.jobs / quiet
    for name in ("latent.npy", "hires_latent.npy"):
        np.testing.assert_array_equal(np.load(jd / name), np.load(qd / name))
    # the double: 2 * the second pass's start + denoise; the start is the first latent through VAE space and back
    np.testing.assert_array_equal(np.load(jd / "hires_latent.npy"),
                                  (2 * normalize(denormalize(np.load(jd / "latent.npy"))) + np.float32(1.0)))
    rows = _log(d, "double_denoises", job)
    firsts = [r for r in rows if not r["job_dir"].endswith("hires")]
    seconds = [r for r in rows if r["job_dir"].endswith("hires")]
    assert len(firsts) >= 2 and len(seconds) >= 2                      # each pass resumed once at least
    assert {(r["start_step"], r["end_step"], r["add_noise"], r["leftover_noise"], r["cfg"]) for r in firsts} == \
        {(None, 3, True, True, 4.0)}
    assert {(r["start_step"], r["end_step"], r["add_noise"], r["leftover_noise"], r["cfg"], r["sampler"],
             r["width"]) for r in seconds} == {(3, None, False, False, 1.5, "euler", 64)}


def test_an_end_step_past_the_schedule_samples_to_the_end_in_both_passes(d):
    """end_step 10000 (KSamplerAdvanced's default end_at_step, ComfyUI's "to the end") in either pass: the job runs
    to the end (it failed building the DENOISE, whose step fields stop at the wire's bound)."""
    job = d.submit({**SPLIT, "end_step": 10000, "leftover_noise": False,
                    "hires": {**SPLIT["hires"], "end_step": 10000}})
    info = d.wait(job, ("done", "failed"))
    assert info.state == "done", info
    assert [(r["start_step"], r["end_step"]) for r in _log(d, "double_denoises", job)] == [(None, None), (3, None)]


def test_a_graph_saving_base_and_hires_images_gets_each_from_history_and_view(d):
    """POST /prompt of the pixel hires graph with SaveImage "57" on the first VAEDecode: /history lists base.png under
    "57" and image.png under "9", and /view serves each as the job folder holds it."""
    import requests
    from tests.test_comfy_hires_graph import _base_saved
    url = d.http_url()
    graph = _base_saved("ImageScaleBy")
    info = requests.get(url + "object_info", timeout=30).json()
    for node in graph.values():                      # the loaders name the files this run folder has
        for name, spec in info[node["class_type"]]["input"]["required"].items():
            if name.endswith("_name") and spec[0]:
                node["inputs"][name] = spec[0][0]
    r = requests.post(url + "prompt", json={"prompt": graph}, timeout=60)
    assert r.status_code == 200, r.text
    pid = r.json()["prompt_id"]
    info = d.wait(pid, ("done", "failed"))
    assert info.state == "done", info
    outputs = requests.get(url + f"history/{pid}", timeout=30).json()[pid]["outputs"]
    assert {k: [i["filename"] for i in v["images"]] for k, v in outputs.items()} == {"9": ["image.png"],
                                                                                   "57": ["base.png"]}
    for node, name in (("9", "image.png"), ("57", "base.png")):
        got = requests.get(url + "view", params=outputs[node]["images"][0], timeout=30)
        assert got.status_code == 200 and got.content == (d.rf.jobs / pid / name).read_bytes()
    with Image.open(d.rf.jobs / pid / "base.png") as im:
        assert im.size == (64, 64) and json.loads(im.text["prompt"])["57"]["class_type"] == "SaveImage"


# ---------------------------------------------------------------- the conditioning operations' and ImageCrop's steps
# killed at each step (SIGKILL of the daemon and of the encoder or the VAE) and resumed: every file a step writes as
# the same job's undisturbed run wrote it (a PNG's pixels bitwise, its text chunks but the job's id); a daemon start
# clears every job-folder temporary a crash can leave (the daemon's always, a stage's when stale)

# ConditioningAverage positive, ConditioningZeroOut negative, a batch of 2 cut by ImageCrop: EncodeText[positive:average
# negative:zero_out], Denoise[0], Denoise[1], Decode[0], Decode[1] (decoded*.png), CropImage[0], CropImage[1], Deliver
OPS_JOB = {"prompt": "1girl, silver hair", "negative_prompt": "worst quality", "seed": 9, "steps": 3, "batch": 2,
           "positive": [{"text": "1girl, silver hair", "average": {"text": "a red fox", "weight": 0.6}}],
           "negative": [{"text": "worst quality", "zero_out": True}],
           "crop": {"width": 40, "height": 24, "x": 8, "y": 48}}


def _until(d, done, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"never {what}\n{d.logs()}"
        time.sleep(0.02)


def _in_double(d, marker: str, holds: str = "") -> bool:
    """The double's marker file is there (and names `holds`): it is inside that request now."""
    p = d.rf.root / marker
    return p.exists() and p.read_text().endswith(holds)


def _encodes(d, job: str) -> list[dict]:
    return [r for r in _log(d, "double_encodes", "") if r["job"] == job]


def _step_files(jd: Path, job: str) -> dict:
    """What a job's steps wrote: contexts, token counts and latents as bytes; each PNG as its pixels and its text
    chunks with the job's id as JOB (the one field two jobs' PNGs differ in)."""
    out = {}
    for p in sorted(jd.iterdir()):
        if p.suffix == ".npy" or p.name == "text.json":
            out[p.name] = p.read_bytes()
        elif p.suffix == ".png" and p.name != "timing.png":
            with Image.open(p) as im:
                out[p.name] = (im.size, np.asarray(im).tobytes(),
                               {k: v.replace(job, "JOB") for k, v in im.text.items()})
    return out


def _plant_crash_leftovers(jd: Path) -> tuple[list[Path], Path]:
    """A temporary of every job-folder file (JOB_FILES, each name it takes) as a crash leaves them: the daemon's
    fresh, a stage's stale; and one fresh stage temporary (a live stage may still be writing it). -> (all that a daemon
    start must remove, the one it must keep)."""
    from orchestrator.engine.job_files import JOB_FILES, STAGE, names
    old, planted = time.time() - 3600, []
    for f in JOB_FILES:
        for name in names(f):
            p = jd / f".{name}.crash.tmp"
            p.write_bytes(b"torn")
            if f.writer == STAGE:
                os.utime(p, (old, old))
            planted.append(p)
    fresh = jd / ".decoded.png.live.tmp"
    fresh.write_bytes(b"being written")
    return planted, fresh


def test_conditioning_ops_and_image_crop_resume_bitwise_after_kills_at_each_step(d):
    """OPS_JOB killed: the encoder and then the daemon inside the ENCODE, the daemon inside image 1's Denoise, the VAE
    inside image 0's DECODE and the daemon inside image 1's (image 0's decoded.png whole, its cut not made). Each
    resume sends the entries again (the double's contexts show them) and runs no step whose outputs are whole: no
    context encoded, no latent sampled, no image decoded twice; the daemon starts clear the crash's temporaries."""
    quiet = d.submit(OPS_JOB)
    assert d.wait(quiet, ("done", "failed")).state == "done"
    slow = "1.0"                                          # seconds a double holds a request a test kills inside
    try:
        d.flag("double_encode_s", slow)
        job = d.submit(OPS_JOB)
        jd = d.rf.jobs / job
        _until(d, lambda: _in_double(d, "double_encoding"), "inside the ENCODE")
        (d.rf.root / "double_encoding").unlink()
        d.flag("double_encode_s", slow)                    # the retried ENCODE is slow too
        d.sigkill("encoder")
        _until(d, lambda: _in_double(d, "double_encoding"), "inside the retried ENCODE")
        d.sigkill("orchestrator")
        d.flag("double_step_s", "0.15")
        _until(d, lambda: (jd / "batch_1" / "state.json").exists(), "inside image 1's Denoise")
        kept = {n: (jd / n).stat().st_mtime_ns for n in ("cond.npy", "uncond.npy", "latent.npy")}
        encodes = len(_encodes(d, job))
        planted, fresh = _plant_crash_leftovers(jd)
        d.sigkill("orchestrator")
        d.flag("double_step_s", "0.02")
        d.flag("double_decode_s", slow)
        _until(d, lambda: _in_double(d, "double_decoding", "/decoded.png"), "inside image 0's DECODE", 90)
        kept["latent_1.npy"] = (jd / "latent_1.npy").stat().st_mtime_ns
        d.sigkill("vae")
        _until(d, lambda: _in_double(d, "double_decoding", "/decoded_1.png"), "inside image 1's DECODE")
        kept["decoded.png"] = (jd / "decoded.png").stat().st_mtime_ns
        assert not (jd / "image.png").exists()
        d.sigkill("orchestrator")
        d.flag("double_decode_s", None)
        info = d.wait(job, ("done", "failed"), timeout_s=90)
    finally:
        for name in ("double_encode_s", "double_encoding", "double_decode_s", "double_decoding"):
            d.flag(name, None)
    assert info.state == "done", info
    assert not [p for p in planted if p.exists()] and fresh.exists()
    assert {n: (jd / n).stat().st_mtime_ns for n in kept} == kept
    rows = _encodes(d, job)
    assert len(rows) == encodes and len(rows) >= 2                 # the killed ENCODE sent again, none after
    assert {json.dumps(r["entries"]) for r in rows} == {json.dumps([
        {"text": "1girl, silver hair", "strength": 1.0, "start": 0.0, "end": 1.0, "zero_out": False,
         "average": {"text": "a red fox", "weight": 0.6}},
        {"text": "worst quality", "strength": 1.0, "start": 0.0, "end": 1.0, "zero_out": True, "average": None}])}
    np.testing.assert_array_equal(np.load(jd / "cond.npy")[0], np.float32(0.6 * 18 + 0.4 * 9))
    np.testing.assert_array_equal(np.load(jd / "uncond.npy")[0], np.float32(0))
    files = _step_files(jd, job)
    assert {n: v[0] for n, v in files.items() if n.endswith(".png")} == {
        "decoded.png": (64, 64), "decoded_1.png": (64, 64), "image.png": (40, 16), "image_1.png": (40, 16)}
    assert files == _step_files(d.rf.jobs / quiet, quiet)
