"""End to end under a real supervisord with the REAL stages on the embedded tiny bundle (128x128 pack, FP16):
PNG + metadata, report fields, teardown read from supervisord, strict block order (executor trace), final latent
bitwise equal to in-process sampling; `supervisorctl restart executor` mid-job; every program SIGKILLed once mid-job;
no /dev/shm segment and no stray process left."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.sampling.denoise import denoise, make_sampler, start_or_resume
from models.sampling.spectrum import SpectrumSettings
from models.packs.pack import load_pack
from models.dit.partition import KINDS
from protocol import messages as m
from tests.pipeline_harness import Pipeline, reference_runner

THREADS = 1           # the stages and the in-process reference run ONNX Runtime with the same thread count
# 4 steps, Spectrum warm-up 1: computed [1, 2, 4], forecast [3] (the forecast path and its saved history are exercised)
PROMPT = {"prompt": "1girl, silver hair, (blue eyes:1.2)", "negative_prompt": "worst quality", "seed": 1234,
          "steps": 4, "cfg": 4.0, "sampler": "euler", "scheduler": "sgm_uniform", "spectrum": {"warmup": 1}}
JOB_TIMEOUT_S = 600.0
_PIXELS: dict = {}    # job -> PNG pixels of the finished PROMPT jobs of this module


@pytest.fixture(scope="module")
def assets(pipeline_assets):
    return pipeline_assets


@pytest.fixture(scope="module")
def pipe(default_pipeline):
    assert default_pipeline.toml_args["threads"] == THREADS      # the in-process reference runs with the same threads
    return default_pipeline


@pytest.fixture(scope="module")
def runner(assets):
    """The in-process DiT (same pack and threads as the stages) for this module's references: one set of sessions."""
    r = reference_runner(assets[1], threads=THREADS)
    yield r
    r.close()


@pytest.fixture(scope="module")
def reference(assets, runner):
    """In-process sampling (models.sampling.denoise + DiTRunner, same pack, seed, settings and threads) from a job folder's
    contexts; computed once, every job of this module has the same prompt."""
    cache = {}

    def get(job_dir: Path) -> np.ndarray:
        if "latent" not in cache:
            spec = json.loads((job_dir / "job.json").read_text())["spec"]
            pack = load_pack(assets[1])
            g, c = pack.geometry, pack.config
            sampler = make_sampler(spec["steps"], spec["cfg"], spec["scheduler"],
                                   SpectrumSettings(**spec["spectrum"]), spec["sampler"])
            state = start_or_resume(sampler, spec["seed"], (c.latent_channels, g.latent_h, g.latent_w))
            cond, uncond = np.load(job_dir / "cond.npy"), np.load(job_dir / "uncond.npy")    # [512, Dc] f32
            final = denoise(runner, sampler, state, cond, uncond)
            cache.update(latent=sampler.result(final), computed=final.computed, forecast=final.forecast,
                         cond=cond, uncond=uncond)
        return cache
    return get


def _expected_order(computed: list[int], blocks: int) -> list[tuple]:
    return [(s, b, k) for s in computed for b in range(blocks) for k in KINDS]


def _served_order(trace: list[dict]) -> list[tuple]:
    """(step, block, branch) in the order the executor served them, a resent call that was served twice once."""
    out = []
    for t in trace:
        key = (t["step"], t["block"], t["branch"])
        if not out or out[-1] != key:
            out.append(key)
    return out


def _check_clean(pipe: Pipeline) -> None:
    assert pipe.leftover_segments() == [], "a /dev/shm segment outlived its job"
    assert pipe.strays() == [], f"stray processes: {pipe.strays()}"
    assert pipe.stage_children() == [], "a stage left child processes"
    infos = pipe.sup.all_info()
    assert infos["encoder"].state != "RUNNING" and infos["vae"].state != "RUNNING"


def test_job_end_to_end(pipe, assets, reference):
    t0 = time.monotonic()
    job = pipe.submit(PROMPT)
    info = pipe.wait(job, timeout_s=JOB_TIMEOUT_S)
    assert info.state == "done", f"{info.error_stage}: {info.error}\n{pipe.logs()}"
    pack = load_pack(assets[1])
    blocks = pack.config.blocks

    # the PNG and its metadata text chunks
    img = Image.open(info.image)
    img.load()
    assert img.format == "PNG" and img.size == (128, 128) and img.mode == "RGB"
    meta = img.text
    own = json.loads(meta["anima"])                      # the project's own fields (ComfyUI's chunks: test_daily_use)
    assert own["prompt"] == PROMPT["prompt"] and own["negative_prompt"] == PROMPT["negative_prompt"]
    assert (own["seed"], own["steps"], own["cfg"]) == (1234, 4, 4.0)
    assert (own["sampler"], own["scheduler"], own["spectrum"]["enabled"]) == ("euler", "sgm_uniform", True)
    assert own["model_sha256"] == pack.source["sha256"] and len(own["model_sha256"]) == 64
    assert "Seed: 1234" in meta["parameters"] and f"Model hash: {pack.source['sha256'][:10]}" in meta["parameters"]
    assert np.asarray(img).std() > 0                     # decoded, not a constant
    assert own["latent_space"] == "model" and "SaveLatent" in own["latent_note"]
    _PIXELS[job] = np.asarray(img).copy()

    # the report's interface fields
    ref = reference(pipe.job_dir(job))
    r = pipe.report(job)
    assert r["computed_steps"] == ref["computed"] == [1, 2, 4] and r["forecast_steps"] == [3]
    assert r["branch_calls"] == 3 * blocks * len(ref["computed"])
    assert r["executor_backend"] == "onnx" and [(p["image"], p["pass"]) for p in r["passes"]] == [(1, "first")]
    td = r["teardown"]
    assert td["encoder_running_during_denoise"] is False and td["vae_running_during_denoise"] is False
    assert td["samples"] >= 3                            # recorded from supervisord during the run
    for name in ("encoder", "scheduler", "executor", "vae"):
        assert r["stages"][name]["wall_s"] > 0 and r["stages"][name]["peak_rss_mb"] > 10, (name, r["stages"])
    for kind in KINDS:
        b = r["branches"][kind]
        assert b["calls"] == blocks * len(ref["computed"])
        assert b["infer_s"] > 0 and b["load_s"] >= 0 and b["init_s"] > 0 and b["release_s"] >= 0
    assert r["transport_s"] > 0 and r["host_s"] > 0
    assert r["latent"]["space"] == "model" and r["text"]["truncated"] is False
    est = r["estimate"]                                   # priced when the report was written, as before the run
    assert est["label"] == "modelled" and est["size"] == [128, 128] and est["encode_s"] > 0     # no cache: encoded
    assert not (pipe.job_dir(job) / "timing.png").exists()       # the harness sets timing_plot_timeout_s = 0
    assert r["text"]["t5_tokens_prompt"] > 5 and r["text"]["t5_tokens_negative"] >= 2
    # the branch calls' critical path (visible lifecycle + inference; the default policy prefetches, so load/init
    # mostly run behind other work) fits in the scheduler's wall time
    assert r["stages"]["scheduler"]["wall_s"] >= sum(b["visible_s"] + b["infer_s"] for b in r["branches"].values())

    # strict block order, each call once, as served by the executor
    trace = pipe.trace(job)
    assert [(t["step"], t["block"], t["branch"]) for t in trace] == _expected_order(ref["computed"], blocks)
    assert {t["attempt"] for t in trace} == {1} and len({t["pid"] for t in trace}) == 1

    # the final latent equals in-process sampling bitwise (same host ops, same ORT graphs and thread count)
    latent = np.load(pipe.job_dir(job) / "latent.npy")   # [16, 16, 16] f32
    np.testing.assert_array_equal(latent, ref["latent"])
    _check_clean(pipe)
    print(f"\nend-to-end job: {time.monotonic() - t0:.1f} s (report wall {r['wall_s']:.1f} s)")


def test_restart_executor_mid_job(pipe, reference):
    job = pipe.submit(PROMPT)
    info = pipe.restart_mid_job(job, "executor", lambda p: p.block >= 8, JOB_TIMEOUT_S)
    trace = pipe.trace(job)
    assert len({t["pid"] for t in trace}) == 2           # served by both executors
    ref = reference(pipe.job_dir(job))
    assert _served_order(trace) == _expected_order(ref["computed"], 28)
    np.testing.assert_array_equal(np.load(pipe.job_dir(job) / "latent.npy"), ref["latent"])
    with Image.open(info.image) as img:
        _PIXELS[job] = np.asarray(img).copy()                # the second run of the same job (the next test)
    _check_clean(pipe)


def test_same_job_twice_same_png_pixels(pipe, assets):
    """Run twice, the same job gives byte-identical PNG pixels, and they are clip(255 x) truncated of the array the
    VAE decodes from the job's latent.npy (same tiles and threads). The two runs are the first test's job and the
    executor-restart test's (the same prompt; its restart leaves the latent bitwise, as that test asserts, and the
    encode and decode are as undisturbed); a job is run here for each of them that did not run."""
    from models.setup.models_dir import resolve_models
    from models.vae import VAE
    while len(_PIXELS) < 2:
        job = pipe.submit(PROMPT)
        info = pipe.wait(job, timeout_s=JOB_TIMEOUT_S)
        assert info.state == "done", f"{info.error_stage}: {info.error}\n{pipe.logs()}"
        with Image.open(info.image) as img:
            _PIXELS[job] = np.asarray(img).copy()
    (a, pa), (b, pb) = list(_PIXELS.items())[:2]
    assert pa.tobytes() == pb.tobytes()
    latent = np.load(pipe.job_dir(b) / "latent.npy")
    np.testing.assert_array_equal(latent, np.load(pipe.job_dir(a) / "latent.npy"))
    tile = m.TileSettings()                              # what the orchestrator's DECODE asks for
    vae = VAE.open(resolve_models(assets[0], {}, need=("vae",)).vae, threads=THREADS)
    arr = vae.decode(latent, tile=tile.tile, overlap=tile.overlap).array          # [3, 128, 128] f32 in [0, 1]
    want = np.clip(255.0 * arr, 0, 255).astype(np.uint8).transpose(1, 2, 0)      # ComfyUI's SaveImage
    assert pb.tobytes() == np.ascontiguousarray(want).tobytes()
    _check_clean(pipe)


def _readies(pipe: Pipeline, program: str) -> int:
    """How many times the program said it is READY (its log line), i.e. how often its work request could follow."""
    log = pipe.rf.logs / f"{program}.log"
    return log.read_text(errors="replace").count(f"{program} ready on") if log.exists() else 0


def _kill_once_ready(pipe: Pipeline, job: str, program: str, state: str, before: int) -> int | None:
    """SIGKILL `program` right after its next READY (the ENCODE/DECODE request follows at once) while the job is in
    `state`; None when the job left that state first."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while _readies(pipe, program) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    info = pipe.status(job)
    return pipe.kill(program) if info is not None and info.state == state else None


def test_every_program_sigkilled_once_mid_job(pipe, reference):
    """One job; SIGKILL in turn: the encoder while encoding, the scheduler and the executor while denoising, the
    orchestrator mid-denoise, the VAE while decoding. It finishes with the undisturbed result, nothing leaks."""
    readies = {name: _readies(pipe, name) for name in ("encoder", "vae")}
    job = pipe.submit(PROMPT)
    killed = {}
    # 1) encoder: once it is READY (ENCODE follows at once); the tiny encode takes about a second
    killed["encoder"] = _kill_once_ready(pipe, job, "encoder", "encoding", readies["encoder"])
    # 2) scheduler, mid-step
    pipe.wait(job, ("denoising",), JOB_TIMEOUT_S, pred=lambda i: i.progress is not None and i.progress.block >= 10,
              poll_s=0.05)
    killed["scheduler"] = pipe.kill("scheduler")
    # 3) executor, once the restarted scheduler has gone on (a step past its resume point)
    pipe.wait(job, ("denoising",), JOB_TIMEOUT_S, poll_s=0.05,
              pred=lambda i: i.progress is not None and i.progress.step >= 2 and i.progress.block >= 5)
    killed["executor"] = pipe.kill("executor")
    # 4) orchestrator, while the scheduler goes on (the new daemon resumes the job from the job folder)
    pipe.wait(job, ("denoising",), JOB_TIMEOUT_S, poll_s=0.05,
              pred=lambda i: i.progress is not None and (i.progress.step, i.progress.block) >= (2, 20))
    killed["orchestrator"] = pipe.kill("orchestrator")
    # 5) VAE, once it is READY (DECODE follows at once)
    killed["vae"] = _kill_once_ready(pipe, job, "vae", "decoding", readies["vae"])
    info = pipe.wait(job, timeout_s=JOB_TIMEOUT_S)
    assert info.state == "done", f"{info.error_stage}: {info.error}\n{pipe.logs()}"
    assert None not in killed.values(), f"a kill missed its moment: {killed}"
    ref = reference(pipe.job_dir(job))
    np.testing.assert_array_equal(np.load(pipe.job_dir(job) / "cond.npy"), ref["cond"])
    np.testing.assert_array_equal(np.load(pipe.job_dir(job) / "latent.npy"), ref["latent"])
    r = pipe.report(job)
    assert r["resumed_from"] >= 1 and r["computed_steps"] == [1, 2, 4]
    assert Image.open(info.image).size == (128, 128)
    for name, pid in killed.items():
        assert pipe.pid(name) != pid
    _check_clean(pipe)


def test_a_stochastic_multistep_sampler_killed_mid_job_resumes_bitwise(pipe, assets, runner):
    """er_sde (its previous denoised values and the noise generator's position travel in the step state) on karras
    with Spectrum: the scheduler SIGKILLed in step 2 resumes from step 1's state and ends on the in-process latent."""
    prompt = {**PROMPT, "sampler": "er_sde", "scheduler": "karras"}
    job = pipe.submit(prompt)
    pipe.wait(job, ("denoising",), JOB_TIMEOUT_S, poll_s=0.05,
              pred=lambda i: i.progress is not None and (i.progress.step, i.progress.block) >= (2, 10))
    pipe.kill("scheduler")
    info = pipe.wait(job, timeout_s=JOB_TIMEOUT_S)
    assert info.state == "done", f"{info.error_stage}: {info.error}\n{pipe.logs()}"
    job_dir = pipe.job_dir(job)
    pack = load_pack(assets[1])
    g, c = pack.geometry, pack.config
    sampler = make_sampler(4, 4.0, "karras", SpectrumSettings(warmup=1), "er_sde")
    state = start_or_resume(sampler, prompt["seed"], (c.latent_channels, g.latent_h, g.latent_w))
    cond, uncond = np.load(job_dir / "cond.npy"), np.load(job_dir / "uncond.npy")
    final = denoise(runner, sampler, state, cond, uncond)
    np.testing.assert_array_equal(np.load(job_dir / "latent.npy"), sampler.result(final))
    r = pipe.report(job)
    assert r["resumed_from"] >= 1 and r["computed_steps"] == final.computed == [1, 2, 4]
    assert [s["nfe"] for s in r["steps"]][-2:] == [0, 1] and r["prompt"]["sampler"] == "er_sde"
    assert "Sampler: ER SDE, Schedule type: Karras" in Image.open(info.image).text["parameters"]
    _check_clean(pipe)
