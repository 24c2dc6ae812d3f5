"""The executor on a bigger host: the board's real pipeline with `endpoints.executor = tcp://…` pointing at the
examples/remote-executor host (a network namespace, else 127.0.0.2) over CURVE. Every branch call goes there with its
tensors inline; the latent is bitwise the in-process one; an executor serving another pack is refused by id."""
from __future__ import annotations

import json

import numpy as np
import pytest
import zmq

from models.sampling.denoise import denoise, make_sampler, start_or_resume
from models.sampling.spectrum import SpectrumSettings
from models.runtime.dit_runner import DiTRunner
from models.packs.pack import load_pack
from remote_net import RemoteNet, announce
from remote_vae_machine import RemoteExecutor
from tests.pipeline_harness import Pipeline, tiny_assets


THREADS = 1
PROMPT = {"prompt": "1girl, far away", "negative_prompt": "lowres", "seed": 5, "steps": 2, "cfg": 4.0,
          "spectrum": {"warmup": 1}}
JOB_TIMEOUT_S = 600.0
POLICY = "resident+prefetch"   # as examples/remote-executor/executor.toml (a small resident_mb: some pinned)


@pytest.fixture(scope="module")
def assets(pipeline_assets):
    models, pack = pipeline_assets
    other = tiny_assets(pack.parent, dtype="fp32")[1]          # the same model, another pack (another id)
    return models, pack, other


@pytest.fixture(scope="module")
def net():
    n = RemoteNet.up("rx")
    try:
        yield n
    finally:
        n.down()


def _host(net, pack, request) -> RemoteExecutor:
    ex = RemoteExecutor(net, pack, policy=POLICY)
    ctx = zmq.Context()
    try:
        announce(request.config, f"\ntest_remote_executor: executor host via {net.kind} at {ex.endpoint}")
        ex.start()
        ex.ready = ex.wait_ready(ctx)
    except BaseException:
        ex.close()
        raise
    finally:
        ctx.destroy(linger=0)
    return ex


def _board_toml(ex: RemoteExecutor) -> str:
    """The [endpoints]/[security] tables of examples/remote-executor/pipeline-remote-executor.toml (the one change
    on the board), keys by absolute path."""
    keys = ex.folder / "keys"
    return (f'[endpoints]\nexecutor = "{ex.endpoint}"\n'
            f'[security]\nclient_key = "{keys / "board.key_secret"}"\n'
            f'[security.servers]\nexecutor = "{keys / "executor.key"}"\n')


def _board(models, pack, ex, net) -> Pipeline:
    p = Pipeline.start(models, pack, threads=THREADS, branch_timeout_s=120, extra_toml=_board_toml(ex),
                       always_on=("scheduler", "orchestrator"))
    try:
        if net.kind == "loopback":     # 127.0.0.2 is this machine's too: keep the board's own executor off it
            p.supervisorctl("stop", "executor")
        else:                          # the board's executor sees another machine's address and exits 0, for good
            info = p.wait_program("executor", ("EXITED",), 60)
            assert info.exitstatus == 0, info
            assert "another machine's address" in (p.rf.logs / "executor.log").read_text()
    except BaseException:
        p.stop()                       # nothing of a failed start stays running
        raise
    return p


@pytest.mark.slow
def test_a_job_runs_on_the_remote_executor(assets, net, request):
    models, pack_dir, _ = assets
    ex = _host(net, pack_dir, request)
    try:
        assert ex.ready.info["pack_ids"] == load_pack(pack_dir).identity and ex.ready.info["policy"] == POLICY
        with _board(models, pack_dir, ex, net) as p:
            job = p.submit(PROMPT)
            info = p.wait(job, ("done", "failed", "cancelled"), timeout_s=JOB_TIMEOUT_S)
            assert info.state == "done", f"{info}\n{p.logs()}\n{ex._logs()}"
            report = p.report(job)
            latent = np.load(p.job_dir(job) / "latent.npy")
            cond, uncond = np.load(p.job_dir(job) / "cond.npy"), np.load(p.job_dir(job) / "uncond.npy")
            assert report["stages"]["executor"]["remote"] is True
            assert report["branch_calls"] == 2 * 84 and p.leftover_segments() == []
            assert p.trace(job) == []                                # the board's own executor served nothing
        served = [json.loads(line) for line in ex.trace.read_text().splitlines()]
        order = [(t["step"], t["block"], t["branch"]) for t in served if t["job"] == job]
        assert order == [(s, b, k) for s in (1, 2) for b in range(28) for k in ("self", "cross", "ffn")]
        assert {t["pid"] for t in served} == {ex.ready.pid}
        assert ex.wait_ready(zmq.Context.instance()).pid == ex.ready.pid    # still serving, the same process
    finally:
        ex.close()
    pack = load_pack(pack_dir)
    g, c = pack.geometry, pack.config
    sampler = make_sampler(2, 4.0, "sgm_uniform", SpectrumSettings(warmup=1))
    state = start_or_resume(sampler, 5, (c.latent_channels, g.latent_h, g.latent_w))
    want = denoise(DiTRunner(pack, threads=THREADS), sampler, state, cond, uncond).latent
    np.testing.assert_array_equal(latent, want)


def test_an_executor_with_another_pack_is_refused(assets):
    """The scheduler reads a remote executor's packs' ids from its READY before the first branch and refuses another
    pack (here: the FP32 pack of the same model), naming both ids; the job then fails with that message."""
    from stages.base import RequestFailed
    from stages.scheduler import check_remote_pack
    _, pack_dir, other = assets
    mine, theirs = load_pack(pack_dir), load_pack(other)
    assert mine.identity != theirs.identity
    where = "tcp://192.0.2.7:5561"
    check_remote_pack({"pack_ids": f"{theirs.identity},{mine.identity}", "packs": "/x/a,/x/b"}, mine, where)
    with pytest.raises(RequestFailed, match=f"serves pack.*{theirs.identity}.*is {mine.identity}"):
        check_remote_pack({"pack_ids": theirs.identity, "packs": "/x/pack"}, mine, where)
    with pytest.raises(RequestFailed, match=r"serves pack\(s\) \(none\)"):
        check_remote_pack({}, mine, where)
