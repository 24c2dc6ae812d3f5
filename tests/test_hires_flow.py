"""prompt.json `hires` through the real daemon and supervisord with stand-in stages (tests/orch_doubles.py), two fake
packs (64x64, 96x96): the first pass's latent kept as latent.npy, upscaled as LatentUpscaleBy and sampled again on the
96x96 pack from it (the double gives 2 * init_latent + denoise: the test sees the upscaled latent that reached the
scheduler), decoded at 96x96 with A1111's hires labels; a daemon killed mid second pass resumes it to the same latent
bitwise; a second-pass size without a pack is refused at submit naming the sizes there are."""
from __future__ import annotations

import io
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from orchestrator.cli import CliError
from orchestrator.inputs import save_upload
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


def _wait(d, job: str, states, timeout_s: float = 60.0, pred=None):
    deadline = time.monotonic() + timeout_s
    info = None
    while time.monotonic() < deadline:
        try:
            info = d.status(job=job).jobs[0]
        except CliError:                                   # the daemon restarting
            info = None
        if info is not None and info.state in states and (pred is None or pred(info)):
            return info
        time.sleep(0.05)
    raise AssertionError(f"job {job} never reached {states}: {info}\n{d.logs()}")


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
    info = _wait(d, job, ("done", "failed"))
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
    assert report["computed_steps"] == [1, 2, 3]                 # the last DENOISE: the hires pass's 3 steps


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
    old = d.sup.info("orchestrator").pid
    d.close_client()
    os.kill(old, signal.SIGKILL)                              # supervisord restarts it; the job resumes in place
    d.flag("double_step_s", "0.02")
    info = _wait(d, job, ("done", "failed"), timeout_s=90)
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
    from orchestrator.comfy_graph import graph_to_job
    from tests.test_comfy_hires_graph import hires_graph
    spec = graph_to_job(hires_graph(scale_by=1.0), sizes=SIZES).spec
    assert spec["hires"] == {"method": "nearest-exact", "scale": 1.0, "steps": 4, "denoise": 0.5}
    job = d.submit(spec)
    info = _wait(d, job, ("done", "failed"))
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
    info = _wait(d, job, ("done", "failed"))
    assert info.state == "done", info
    jd = d.rf.jobs / job
    vae = torch.from_numpy(denormalize(np.load(jd / "latent.npy"))[None])
    want = 2 * normalize(_torch_bislerp(vae, 12, 12)[0].numpy()) + np.float32(0.5)
    np.testing.assert_allclose(np.load(jd / "hires_latent.npy"), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("hires, extra, field, words", [
    ({"scale": 2.0}, {}, "hires", "128x128 has no model pack; the sizes with a pack: 64x64, 96x96"),
    ({"width": 96}, {}, "hires", "either scale, or both width and height"),
    ({"scale": 1.5, "denoise": 0}, {}, "hires.denoise", "(0, 1]"),
    ({"scale": 1.5, "method": "lanczos"}, {}, "hires.method", "lanczos scales pixels"),
    ({"scale": 1.5}, {"batch": 2}, "hires", "batch"),
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
    from orchestrator.jobs import JOB_FILE, JobStore
    store = JobStore(tmp_path)
    jd = store.root / "20260101-120000-c3d4e5"
    (jd / "hires").mkdir(parents=True)
    (jd / JOB_FILE).write_text("{}")
    mine, stale, fresh = jd / ".hires_latent.npy.k3.tmp", jd / "hires" / ".s.json.a1.tmp", jd / "hires" / ".s.json.b2.tmp"
    for p in (mine, stale, fresh):
        p.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    removed = store.clean()
    assert not mine.exists() and not stale.exists() and fresh.exists(), removed


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
                         ({"hr_scale": 2.0}, "hires"), ({"hr_prompt": "other"}, "hr_prompt")):
        r = requests.post(url, json={**base, **extra}, timeout=30)
        assert r.status_code == 422 and field in r.text, (extra, r.text)
