"""prompt.json `batch` through the real daemon and supervisord with stand-in stages (tests/orch_doubles.py): the
images run one after another, each DENOISE asking for its place in ComfyUI's batch (noise_index, batch_size,
batch_pos), each decoded to its own PNG with its seed and batch place in its metadata, every image in the report and
delivered to `output`; a daemon killed mid-batch resumes only what is missing, to the same latents bitwise."""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrator.terminal.cli import CliError
from tests.doubles_harness import Doubles

W, H = 64, 64


@pytest.fixture(scope="module")
def d():
    root = Path(tempfile.mkdtemp(prefix="anima-batch-"))
    with Doubles.start(root, [(W, H)]) as d:
        yield d


@pytest.fixture(autouse=True)
def _flags(d):
    for name in ("double_step_s", "double_batch_steps"):
        d.flag(name, None)



def _torch_batch(seed: int, batch: int, shape) -> np.ndarray:
    """ComfyUI's prepare_noise for an EmptyLatentImage batch, in torch itself: one randn over [B, C, h, w]."""
    g = torch.Generator("cpu").manual_seed(seed)
    return torch.randn((batch, *shape), generator=g, dtype=torch.float32).numpy()


def _png_text(path: Path) -> dict:
    from PIL import Image
    with Image.open(path) as im:
        return dict(im.text)


def _steps_run(d) -> list[tuple[str, int, int]]:
    p = d.rf.root / "double_batch_steps"
    rows = [line.split() for line in p.read_text().splitlines()] if p.exists() else []
    return [(Path(jd).name, int(pos), int(step)) for jd, pos, step in rows]


def test_a_batch_gives_each_image_its_place_in_the_batch_and_its_own_png(d, tmp_path):
    seed, batch = 11, 3
    job = d.submit({"prompt": "a girl", "seed": seed, "steps": 2, "batch": batch, "output": str(tmp_path)})
    info = d.wait(job, ("done", "failed"))
    assert info.state == "done", info
    jd = d.rf.jobs / job
    latents = [np.load(jd / name) for name in ("latent.npy", "latent_1.npy", "latent_2.npy")]
    want = _torch_batch(seed, batch, latents[0].shape)
    for pos, latent in enumerate(latents):      # the double's latent: the batch noise slice it was asked for
        np.testing.assert_allclose(latent, want[pos], rtol=0, atol=1e-6)   # torch's randn within its float32 ulp
    report = json.loads((jd / "report.json").read_text())
    assert [i["batch_index"] for i in report["images"]] == [0, 1, 2]
    assert [Path(i["image"]).name for i in report["images"]] == [f"{job}.png", f"{job}_1.png", f"{job}_2.png"]
    assert report["image"] == str(tmp_path / f"{job}.png")
    for pos, name in enumerate(("image.png", "image_1.png", "image_2.png")):
        text = _png_text(jd / name)
        assert f"Seed: {seed}," in text["parameters"]
        assert f"Batch size: {batch}, Batch pos: {pos}," in text["parameters"]
        graph = json.loads(text["prompt"])                           # the job's graph makes the same batch
        assert [n["inputs"]["batch_size"] for n in graph.values() if "batch_size" in n["inputs"]] == [batch]
        own = json.loads(text["anima"])
        assert (own["seed"], own["batch"], own["batch_index"]) == (seed, batch, pos)
        delivered = tmp_path / (f"{job}.png" if pos == 0 else f"{job}_{pos}.png")
        assert delivered.read_bytes() == (jd / name).read_bytes()


def test_a_batch_reports_every_images_pass_and_its_progress_names_the_image(d):
    from orchestrator.terminal.cli import _progress_line
    from orchestrator.engine.report import format_table
    d.flag("double_step_s", "0.15")
    job = d.submit({"prompt": "a girl", "seed": 5, "steps": 3, "batch": 3})
    lines, deadline = set(), time.monotonic() + 60
    while True:
        info = d.status(job=job).jobs[0]
        if info.state == "denoising" and info.progress is not None:
            lines.add(_progress_line(info).split("] ", 1)[1].split(" · block")[0])
        if info.state in ("done", "failed"):
            break
        assert time.monotonic() < deadline, d.logs()
        time.sleep(0.03)
    assert info.state == "done", info
    # the CLI's (and the page's) line says which image runs, each restarting at step 1
    for image in (1, 2, 3):
        assert f"image {image}/3 · step 1/3" in lines, lines
    assert lines <= {f"image {i}/3 · step {s}/3" for i in (1, 2, 3) for s in (1, 2, 3)}, lines
    report = json.loads((d.rf.jobs / job / "report.json").read_text())
    # every image's DENOISE counted (the double makes 3 branch calls a step), not the last one's
    assert report["branch_calls"] == 3 * 3 * 3 and len(report["computed_steps"]) == 9
    assert [(p["image"], p["images"], p["pass"]) for p in report["passes"]] == [(i, 3, "first") for i in (1, 2, 3)]
    assert report["branches"]["ffn"]["calls"] == 9 and report["host_s"] == pytest.approx(3 * 0.5)
    assert "27 branch calls, 9 computed steps" in format_table(report)


def test_a_single_image_job_keeps_its_names_and_no_batch_labels(d):
    job = d.submit({"prompt": "a girl", "seed": 4, "steps": 2})
    assert d.wait(job, ("done", "failed")).state == "done"
    jd = d.rf.jobs / job
    assert not (jd / "latent_1.npy").exists() and not (jd / "image_1.png").exists()
    assert "Batch size" not in _png_text(jd / "image.png")["parameters"]
    assert json.loads((jd / "report.json").read_text())["images"] == []


def test_daemon_killed_mid_batch_resumes_only_what_is_missing(d):
    seed, batch, steps = 23, 3, 4
    d.flag("double_step_s", "0.2")
    job = d.submit({"prompt": "a girl", "seed": seed, "steps": steps, "batch": batch})
    jd = d.rf.jobs / job
    deadline = time.monotonic() + 60
    while not any(pos == 1 and step >= 2 for _, pos, step in _steps_run(d)):
        assert time.monotonic() < deadline, d.logs()
        time.sleep(0.05)
    first = (jd / "latent.npy").stat().st_mtime_ns
    old = d.sigkill("orchestrator")           # supervisord restarts it; the job resumes in place
    d.flag("double_step_s", "0.02")
    info = d.wait(job, ("done", "failed"), timeout_s=90)
    assert info.state == "done", info
    assert d.sup.info("orchestrator").pid != old
    assert (jd / "latent.npy").stat().st_mtime_ns == first            # image 0 was not sampled again
    runs = _steps_run(d)
    assert sorted(s for _, pos, s in runs if pos == 0) == list(range(1, steps + 1))
    assert [s for _, pos, s in runs if pos == 1].count(1) == 1        # image 1 went on from its saved step
    want = _torch_batch(seed, batch, np.load(jd / "latent.npy").shape)
    for pos, name in enumerate(("latent.npy", "latent_1.npy", "latent_2.npy")):
        np.testing.assert_allclose(np.load(jd / name), want[pos], rtol=0, atol=1e-6)
    reference = d.submit({"prompt": "a girl", "seed": seed, "steps": 2, "batch": batch})   # run without a kill
    assert d.wait(reference, ("done", "failed")).state == "done"
    for name in ("latent.npy", "latent_1.npy", "latent_2.npy"):
        np.testing.assert_array_equal(np.load(jd / name), np.load(d.rf.jobs / reference / name))
    assert (jd / "image_2.png").exists()


@pytest.mark.parametrize("value, words", [(0, "1..8"), (9, "1..8"), ("2", "integer")])
def test_a_bad_batch_is_refused_naming_the_field(d, value, words):
    before = sorted(p.name for p in d.rf.jobs.iterdir())
    with pytest.raises((CliError, ValueError)) as e:
        d.submit({"prompt": "a girl", "seed": 1, "steps": 2, "batch": value})
    assert "'batch'" in str(e.value) and words in str(e.value), str(e.value)
    assert sorted(p.name for p in d.rf.jobs.iterdir()) == before


def test_a_comfy_graph_with_batch_size_runs_the_batch_and_history_lists_every_image(d):
    import requests
    from tests.comfy_graphs import standard_graph
    from tests.doubles_harness import SOURCE
    names = {"unet": SOURCE["name"], "clip": "any-te.safetensors", "vae": "any-vae.safetensors"}
    g = standard_graph(width=W, height=H, steps=2, seed=31, names=names)
    g["5"]["inputs"]["batch_size"] = 3
    url = d.http_url()
    r = requests.post(url + "prompt", json={"prompt": g}, timeout=30)
    assert r.status_code == 200, r.text
    job = r.json()["prompt_id"]
    assert d.wait(job, ("done", "failed")).state == "done"
    jd = d.rf.jobs / job
    want = _torch_batch(31, 3, np.load(jd / "latent.npy").shape)
    for pos, name in enumerate(("latent.npy", "latent_1.npy", "latent_2.npy")):
        np.testing.assert_allclose(np.load(jd / name), want[pos], rtol=0, atol=1e-6)
    outputs = requests.get(url + f"history/{job}", timeout=30).json()[job]["outputs"]
    listed = [i["filename"] for node in outputs.values() for i in node["images"]]
    assert listed == ["image.png", "image_1.png", "image_2.png"]
    for name in listed:
        img = requests.get(url + "view", params={"filename": name, "subfolder": job, "type": "output"}, timeout=30)
        assert img.status_code == 200 and img.content == (jd / name).read_bytes()
    graph = json.loads(_png_text(jd / "image_2.png")["prompt"])          # the graph as sent, batch and all
    assert graph["5"]["inputs"]["batch_size"] == 3
    g["5"]["inputs"]["batch_size"] = 9
    r = requests.post(url + "prompt", json={"prompt": g}, timeout=30)
    assert r.status_code == 400 and "batch_size" in r.text, r.text


def test_a1111_batch_size_and_n_iter_return_every_image_with_seeds_numbered_as_a1111_does(d):
    import base64
    import io
    import requests
    from PIL import Image
    prompt, seed = "a girl", 40
    r = requests.post(d.http_url() + "sdapi/v1/txt2img", json={"prompt": prompt, "seed": seed, "steps": 1, "width": W,
                                                               "height": H, "batch_size": 2, "n_iter": 2}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    info = json.loads(body["info"])
    assert info["all_seeds"] == [seed, seed + 1, seed + 2, seed + 3] and info["batch_size"] == 2
    assert len(body["images"]) == 4 and len(info["infotexts"]) == 4
    for k, b64 in enumerate(body["images"]):
        with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
            assert f"Seed: {seed + k}," in im.text["parameters"]
            # the double decodes its latent cond + seed % 7 (cond: the prompt's length) to one grey level
            assert np.asarray(im)[0, 0, 0] == len(prompt) + (seed + k) % 7
        assert f"Seed: {seed + k}," in info["infotexts"][k]
    for field, value in (("batch_size", 9), ("n_iter", 0), ("batch_size", "two")):
        r = requests.post(d.http_url() + "sdapi/v1/txt2img", json={"prompt": prompt, field: value}, timeout=30)
        assert r.status_code == 422 and field in r.text, r.text


def test_a_batch_through_the_real_stages_equals_in_process_sampling_per_place(default_pipeline, pipeline_assets):
    """The one real-pipeline batch job (tiny bundle): each image's final latent equals in-process LatentSampler +
    DiTRunner at its place in the batch (tests/test_img2img_sampling.py shows those places equal ComfyUI's batch
    tensor run through one sampler), with euler_ancestral's per-step noise the batch's; the images differ."""
    from models.packs.pack import load_pack
    from models.runtime.dit_runner import DiTRunner
    from models.sampling.denoise import denoise
    from models.sampling.img2img import LatentPlan, LatentSampler, start_or_resume_latent
    pipe, (_, pack_dir) = default_pipeline, pipeline_assets
    threads = pipe.toml_args["threads"]
    pack = load_pack(pack_dir)
    g, c = pack.geometry, pack.config
    shape = (c.latent_channels, g.latent_h, g.latent_w)
    job = pipe.submit({"prompt": "1girl, silver hair", "negative_prompt": "worst quality", "seed": 91, "steps": 2,
                       "cfg": 4.0, "sampler": "euler_ancestral", "scheduler": "karras", "spectrum": False,
                       "batch": 2})
    info = pipe.wait(job, timeout_s=600)
    assert info.state == "done", f"{info.error_stage}: {info.error}\n{pipe.logs()}"
    jd = pipe.job_dir(job)
    cond, uncond = np.load(jd / "cond.npy"), np.load(jd / "uncond.npy")
    runner = DiTRunner(pack, threads=threads)
    latents = [np.load(jd / name) for name in ("latent.npy", "latent_1.npy")]
    for pos, latent in enumerate(latents):
        s = LatentSampler(steps=2, cfg=4.0, sampler="euler_ancestral", scheduler="karras", spectrum=None,
                          plan=LatentPlan(batch_size=2, batch_pos=pos))
        state = start_or_resume_latent(s, 91, shape, noise_index=pos)
        np.testing.assert_array_equal(latent, s.result(denoise(runner, s, state, cond, uncond)))
    assert not np.array_equal(latents[0], latents[1])
    assert [Path(i["image"]).name for i in pipe.report(job)["images"]] == ["image.png", "image_1.png"]


def test_a_crash_leaves_no_batch_temporaries_behind(tmp_path):
    """At a daemon's start a batch's own temporaries go (latent_N.npy's always, as latent.npy's), and a stage's stale
    ones in a batch image's state folder (batch_N/) as in the job folder; a fresh one (a stage may be writing) stays."""
    from orchestrator.engine.jobs import JOB_FILE, JobStore
    store = JobStore(tmp_path)
    jd = store.root / "20260101-120000-a1b2c3"
    (jd / "batch_1").mkdir(parents=True)
    (jd / JOB_FILE).write_text("{}")
    mine, stale, fresh = jd / ".latent_1.npy.k3j2.tmp", jd / "batch_1" / ".state.json.a1.tmp", \
        jd / "batch_1" / ".state.json.b2.tmp"
    for p in (mine, stale, fresh):
        p.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    removed = store.clean()
    assert not mine.exists() and not stale.exists() and fresh.exists(), removed
