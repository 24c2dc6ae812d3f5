"""Lifecycle policies through the real pipeline (supervisord, all stages, tiny 128x128 pack): each job runs under a
policy, the executor is restarted mid-job (`supervisorctl restart executor`), and the latent must still equal the
in-process on-demand sampling bitwise. Two jobs cover every policy term and the executor paths they take: two
contexts at once (dual_core) with prefetch two deep, and resident + prefetch + interleave (one request per CFG pass,
the first holding the model for the second). test_e2e_pipeline runs the default (auto) and test_stage_processes
on-demand and prefetch; tests/test_lifecycle.py checks every policy and combination in process."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.sampling.denoise import denoise, make_sampler, start_or_resume
from models.sampling.spectrum import SpectrumSettings
from models.runtime.dit_runner import DiTRunner
from models.packs.pack import load_pack
from models.dit.partition import KINDS
from tests.pipeline_harness import Pipeline

pytestmark = pytest.mark.slow

THREADS = 1
PROMPT = {"prompt": "1girl, (red scarf:1.1)", "negative_prompt": "lowres", "seed": 77, "steps": 2, "cfg": 4.0,
          "sampler": "euler", "scheduler": "sgm_uniform", "spectrum": False}
JOB_TIMEOUT_S = 900.0
RESIDENT_MB = 6.0
POLICIES = [("prefetch2+dual_core", ""), ("resident+prefetch+interleave", f"resident_mb = {RESIDENT_MB}\n")]


@pytest.fixture(scope="module")
def pipe(pipeline_assets, board_stages):
    models, pack = pipeline_assets
    p = Pipeline.start(models, pack, threads=THREADS, executor_toml='policy = "on-demand"\n',
                       extra_toml=board_stages)                          # the board's encoder and VAE
    try:
        yield p
    finally:
        p.stop_clean()


@pytest.fixture(scope="module")
def reference(pipeline_assets):
    """In-process on-demand sampling from a job folder's contexts (every job here has the same prompt)."""
    cache = {}

    def get(job_dir: Path) -> np.ndarray:
        if "latent" not in cache:
            spec = json.loads((job_dir / "job.json").read_text())["spec"]
            pack = load_pack(pipeline_assets[1])
            g, c = pack.geometry, pack.config
            sampler = make_sampler(spec["steps"], spec["cfg"], spec["scheduler"],
                                   SpectrumSettings(**spec["spectrum"]))
            state = start_or_resume(sampler, spec["seed"], (c.latent_channels, g.latent_h, g.latent_w))
            cond, uncond = np.load(job_dir / "cond.npy"), np.load(job_dir / "uncond.npy")
            runner = DiTRunner(pack, threads=THREADS, policy="on-demand")
            cache["latent"] = denoise(runner, sampler, state, cond, uncond).latent
        return cache["latent"]
    return get


def _per_pass_order(trace: list, name: str) -> list:
    """(step, block, branch) of every call that carried pass `name`, in serving order, a resent call once."""
    out = []
    for t in trace:
        if name in t["passes"]:
            key = (t["step"], t["block"], t["branch"])
            if not out or out[-1] != key:
                out.append(key)
    return out


def _model(t: dict) -> tuple:
    return t["block"], t["branch"]


def _first_fit_pins(calls: list, budget_mb: float) -> dict:
    """{(block, branch): index of the call that pinned it} as the lifecycle decides: once per model, at its first
    call that does not hold it, pinned while the summed context_mb stays within the budget (first fit)."""
    decided, pinned, used = set(), {}, 0.0
    for i, t in enumerate(calls):
        if t["hold"] or _model(t) in decided:
            continue
        decided.add(_model(t))
        if used + t["context_mb"] <= budget_mb:
            pinned[_model(t)], used = i, used + t["context_mb"]
    return pinned


def _sources_under_first_fit(calls: list, pinned: dict) -> list:
    """The source each call of one executor must report, given its pins (_first_fit_pins): an uncond pass right
    after its cond pass is held; else a model pinned by an earlier call is resident; any other call is load or
    prefetch (the prefetch helper's timing decides which, so either is accepted: None, which matches no source,
    stands for anything else)."""
    want = []
    for i, t in enumerate(calls):
        if i > 0 and calls[i - 1]["hold"] and _model(calls[i - 1]) == _model(t):
            want.append("held")
        elif pinned.get(_model(t), i) < i:
            want.append("resident")
        else:
            want.append(t["source"] if t["source"] in ("load", "prefetch") else None)
    return want


@pytest.mark.parametrize("policy,settings", POLICIES, ids=[p for p, _ in POLICIES])
def test_policy_with_an_executor_restart_mid_job_gives_the_on_demand_latent(pipe, reference, policy, settings):
    info = pipe.set_executor(f'policy = "{policy}"\n{settings}')
    assert info["policy"] == policy
    job = pipe.submit(PROMPT)
    pipe.restart_mid_job(job, "executor", lambda p: (p.step, p.block) >= (1, 8), JOB_TIMEOUT_S)
    np.testing.assert_array_equal(np.load(pipe.job_dir(job) / "latent.npy"), reference(pipe.job_dir(job)))

    trace, blocks = pipe.trace(job), 28
    assert len({t["pid"] for t in trace}) == 2                              # served by both executors
    want = [(s, b, k) for s in (1, 2) for b in range(blocks) for k in KINDS]
    for name in ("cond", "uncond"):                                         # strict block order per pass
        assert _per_pass_order(trace, name) == want
    r = pipe.report(job)
    sums = r["branches"]
    assert sum(b["cached"] for b in sums.values()) > 0                      # prefetched / resident / held models
    assert all(b["infer_s"] > 0 and b["init_s"] > 0 for b in sums.values())
    if "dual_core" in policy:
        assert all(t["passes"] == ["cond", "uncond"] and len(t["infer_at"]) == 2 for t in trace)
        assert all(t["context_mb"] > 0 for t in trace)
        assert r["host_hidden_s"] == 0.0                                    # lockstep: host never beside inference
    if "interleave" in policy:
        # one request per pass; the cond one holds the model, the uncond one finds it held (a restart between the
        # two loads it again: that pair is the only exception)
        assert all(len(t["passes"]) == 1 and t["hold"] == (t["passes"] == ["cond"]) for t in trace)
        unc = [t for t in trace if t["passes"] == ["uncond"]]
        assert sum(t["source"] != "held" for t in unc) <= 1 and len(unc) >= len(want)
        assert r["branch_calls"] == 2 * len(want)                          # requests answered (each once)
    else:
        assert r["branch_calls"] == len(want)
    if "resident" in policy:
        pins = []
        for pid in dict.fromkeys(t["pid"] for t in trace):                 # each executor: pinned within budget
            calls = [t for t in trace if t["pid"] == pid]
            pins.append(_first_fit_pins(calls, RESIDENT_MB))
            assert _sources_under_first_fit(calls, pins[-1]) == [t["source"] for t in calls]
        # the first executor decides its first models before the restart (at step 1, block 8 or later)
        assert pins[0]
    assert pipe.leftover_segments() == [] and pipe.strays() == []
