"""The `board-sim` executor backend: real outputs (bitwise ONNX Runtime), every phase paced to the modelled board x
time_scale on its own clock, exclusive NPU cores, the modelled memory refusal; and a pipeline job on it."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from models.runtime.backends import backend_class
from models.runtime.backends.base import BackendError
from models.runtime.backends.board_sim import Board, BoardSimBackend
from models.runtime.backends.onnx import OnnxBackend
from models.board.cost import BoardModel, Shape
from models.board.pace import Chain, HostPacer, check_time_scale, clock, pace
from models.runtime.lifecycle import run_branch
from models.packs.pack import load_pack

SCALE = 0.05                  # phases of the full-size model at 128x128 (64 tokens), shrunk 20x


@pytest.fixture(scope="module")
def assets(pipeline_assets):
    return pipeline_assets


@pytest.fixture(scope="module")
def pack(assets):
    return load_pack(assets[1], check=False)


def _feeds(pack, block, kind, seed=0):
    rng = np.random.default_rng(seed)
    b = pack.branch(block, kind)
    return pack.dir / b["onnx"], [{i["name"]: rng.standard_normal(i["shape"]).astype(np.float16)
                                   for i in b["inputs"]} for _ in range(2)]


def test_registered_beside_the_others():
    assert backend_class("board-sim") is BoardSimBackend
    assert BoardSimBackend.takes_core_mask and BoardSimBackend.parallel_contexts == 3


def test_the_board_backends_answer_auto_themselves(pack, monkeypatch, tmp_path):
    """`auto` on board-sim is the modelled board_ram_gb board's choice, on rknn the choice for the MemAvailable it
    reads: asked of the backend class, so it needs no other import (a fresh interpreter shows it)."""
    import subprocess
    import sys
    from models.runtime import probes
    from models.board import auto as board_auto
    from models.board.policy import resolve_policy
    from models.runtime.backends.rknn import RknnLiteBackend
    model = BoardModel(Shape.of_pack(pack.dir))
    for ram in (8, 32):
        want = board_auto.choose(model, model.context_budget_mib(ram))[0].policy
        got = resolve_policy("auto", "board-sim", BoardSimBackend, {"board_ram_gb": ram}, (pack.dir,))
        assert got == want and got.name != "prefetch"                       # not the safe default
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 8000000 kB\nMemAvailable: {3000 * 1024} kB\n")
    monkeypatch.setattr(probes, "MEMINFO", str(meminfo))
    want = board_auto.choose(model, model.context_budget_mib(mem_available_mib=3000.0))[0].policy
    assert resolve_policy("auto", "rknn", RknnLiteBackend, {"board_ram_gb": 32}, (pack.dir,)) == want
    code = ("from models.board.policy import resolve_policy; from models.runtime.backends.board_sim import BoardSimBackend; "
            "print(resolve_policy('auto', 'board-sim', BoardSimBackend, {'board_ram_gb': 8}).name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == board_auto.choose(BoardModel(), BoardModel().context_budget_mib(8))[0].policy.name


def test_outputs_are_onnx_runtime_bitwise(pack):
    be = BoardSimBackend(threads=1, board=Board(8, 0.01))
    for kind in ("self", "cross", "ffn"):
        path, feeds = _feeds(pack, 0, kind)
        got, _ = run_branch(be, path, feeds)
        want, _ = run_branch(OnnxBackend(1), path, feeds)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g["y"], w["y"])


def test_every_phase_takes_its_modelled_time_times_scale(pack):
    """Measured around each call with our own clock: never shorter than modelled x scale less the credit the report
    says it used (what the phase before it took beyond its target); a call's phases together never shorter than
    their targets; the report's modelled seconds are the cost model's figures for the FULL-SIZE model at this
    pack's resolution."""
    board = Board(8, SCALE)
    be = BoardSimBackend(threads=1, board=board)
    model = BoardModel(Shape.of_pack(pack.dir, "full"))
    assert model.shape.width == 2048 and model.shape.tokens == pack.geometry.tokens
    for kind in ("self", "cross", "ffn"):
        fig = model.kinds[kind]
        path, feeds = _feeds(pack, 3, kind)
        spans = {}
        for phase, call in (("load", lambda: be.load(path)), ("init", be.init),
                            ("infer0", lambda: be.infer(feeds[0])), ("infer1", lambda: be.infer(feeds[1])),
                            ("release", be.release)):
            t0 = clock()
            call()
            spans[phase] = clock() - t0
        rep = be.report["phases"]
        credit = {"load": rep[0]["credit_s"], "init": rep[1]["credit_s"], "infer0": rep[2]["credit_s"] +
                  rep[3]["credit_s"], "infer1": rep[4]["credit_s"] + rep[5]["credit_s"], "release": rep[6]["credit_s"]}
        assert spans["load"] + credit["load"] >= fig.load_s * SCALE
        assert spans["init"] + credit["init"] >= fig.init_s * SCALE
        assert spans["release"] + credit["release"] >= fig.release_s * SCALE
        for i in (0, 1):
            assert spans[f"infer{i}"] + credit[f"infer{i}"] >= (fig.npu_s + fig.io_s) * SCALE
        assert sum(spans.values()) >= (fig.lifecycle_s + 2 * (fig.npu_s + fig.io_s)) * SCALE
        assert [p["phase"] for p in rep] == ["load", "init", "io", "npu", "io", "npu", "release"]
        want = {"load": fig.load_s, "init": fig.init_s, "io": fig.io_s, "npu": fig.npu_s, "release": fig.release_s}
        for p in rep:
            assert p["modelled_s"] == pytest.approx(want[p["phase"]])
            assert p["target_s"] == pytest.approx(want[p["phase"]] * SCALE)
            assert p["wall_s"] + p["credit_s"] >= p["target_s"]
        assert be.report["label"] == "modelled" and be.report["time_scale"] == SCALE
    led = board.ledger()
    assert led["phases"]["npu"]["phases"] == 6 and led["phases"]["load"]["phases"] == 3
    assert led["phases"]["npu"]["modelled_s"] == pytest.approx(2 * sum(model.kinds[k].npu_s for k in model.kinds))


def test_pace_reports_overrun_and_never_ends_early():
    p = pace(clock(), 0.02, 1.0)
    assert p.wall_s >= 0.02 and p.overrun_s == 0
    t0 = clock()
    time.sleep(0.03)                                   # the real work took longer than the scaled board time
    p = pace(t0, 0.01, 1.0)
    assert p.overrun_s >= 0.02 and p.wall_s >= 0.03


def test_chain_credit_keeps_a_call_at_its_modelled_total():
    """An overrun is made up by the next phase of the same context when it follows at once; a gap drops it."""
    chain = Chain()
    t0 = clock()
    time.sleep(0.04)                                   # phase 1: 40 ms of real work against a 10 ms target
    a = chain.pace(t0, 0.01, 1.0)
    t1 = clock()
    b = chain.pace(t1, 0.1, 1.0)                       # phase 2 (100 ms) starts at once: shortened by the credit
    assert a.overrun_s >= 0.03 and b.credit_s >= 0.03 and b.wall_s + b.credit_s >= 0.1
    assert clock() - t0 >= 0.11                        # together never shorter than their targets
    time.sleep(Chain.CHAIN_GAP_S * 4)                  # a gap (waiting for the next request): no credit carried
    c = chain.pace(clock(), 0.02, 1.0)
    assert c.credit_s == 0 and c.wall_s >= 0.02
    for bad in (0, -1, 1.5, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="time_scale"):
            check_time_scale(bad)


def test_host_pacer(pack, monkeypatch):
    """One host op (half a branch pass's host work) is held to its modelled share of the 0.1658 s per block x
    time_scale, on the monotonic clock the runner's host spans use; an op that took longer is not stretched, and the
    next one, credited with all of its target, does not sleep. "Not stretched" and "does not sleep" are read from the
    pacer's sleeps, not from wall times a preemption on a loaded machine would break."""
    naps, real_sleep = [], time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: naps.append(s) or real_sleep(s))
    pacer = HostPacer.for_pack(pack.dir, 0.5)
    assert pacer.pass_s * 6 == pytest.approx(0.1658 * 64 / 1024)          # R3, scaled by L x D
    t0 = time.monotonic()
    p = pacer.op(t0)
    assert time.monotonic() - t0 >= pacer.pass_s / 2 * 0.5 and p.modelled_s == pytest.approx(pacer.pass_s / 2)
    t0 = time.monotonic()
    real_sleep(pacer.pass_s)                          # the real op overran its scaled board time
    naps.clear()
    p = pacer.op(t0)
    assert p.overrun_s > 0 and naps == []             # not stretched: no sleep added
    t0 = time.monotonic()
    p = pacer.op(t0)                                  # the next op makes up for it: the chain keeps the board's time
    assert p.credit_s == pytest.approx(pacer.pass_s / 2 * 0.5)          # all of its target, from the overrun
    assert naps == [] and p.wall_s + p.credit_s >= p.target_s
    assert pacer.totals.phases == 3 and pacer.totals.overrun_s > 0
    assert "modelled" in pacer.describe() and "time_scale=0.5" in pacer.describe()


def test_a_backend_answers_for_its_host_pace_report_and_trace(pack):
    """The scheduler, the report and the executor's trace ask the backend class: board-sim paces the host ops to the
    modelled board, keeps the board's settings for the report's `board` block and adds its ledgers to the trace;
    every other backend answers None / nothing, so its figures stay measured."""
    ex = {"policy": "auto", "time_scale": 0.5, "board_ram_gb": 16, "threads": 2}
    pacer = BoardSimBackend.host_pacer(pack.dir, ex)
    assert pacer.time_scale == 0.5 and pacer.pass_s == HostPacer.for_pack(pack.dir, 0.5).pass_s
    assert BoardSimBackend.report_section(pack.dir, ex) == {"pack_dir": str(pack.dir), "time_scale": 0.5,
                                                            "board_ram_gb": 16}
    assert isinstance(BoardSimBackend.trace_fields()["board"], list) and BoardSimBackend.device == "npu"
    with pytest.raises(ValueError, match="time_scale"):
        BoardSimBackend.host_pacer(pack.dir, {"time_scale": 2})
    for name, device in (("onnx", "cpu"), ("rknn", "npu"), ("rknn-sim", "npu")):
        cls = backend_class(name)
        assert cls.host_pacer(pack.dir, ex) is None and cls.report_section(pack.dir, ex) is None
        assert cls.trace_fields() == {} and cls.device == device


def _ready(pack, board, mask, kind="ffn", block=0):
    be = BoardSimBackend(threads=1, core_mask=mask, board=board)
    path, feeds = _feeds(pack, block, kind)
    be.load(path)
    be.init()
    return be, feeds


def test_npu_cores_are_exclusive(pack):
    """A context waits while its core is busy; another core runs meanwhile; `auto` takes an idle core."""
    board = Board(8, 0.01)
    a, feeds = _ready(pack, board, "0")
    b, _ = _ready(pack, board, "1")
    c, _ = _ready(pack, board, "auto")
    done = {}

    def run(name, be):
        be.infer(feeds[0])
        done[name] = clock()
    with board.npu("0", (0,)):                          # core 0 busy (held by the test)
        tb = threading.Thread(target=run, args=("b", b))
        tb.start()
        tb.join(30)
        assert "b" in done                              # core 1 ran while core 0 was held
        ta = threading.Thread(target=run, args=("a", a))
        ta.start()
        ta.join(1.0)
        assert "a" not in done and ta.is_alive()        # core 0's context waits for its core
        with board.npu("1", (1,)):
            c.infer(feeds[0])
            assert c.report["phases"][-1]["cores"] == [2]   # auto: the one idle core
        released = clock()
    ta.join(30)
    assert done["a"] >= released
    assert a.report["phases"][-1]["cores"] == [0] and b.report["phases"][-1]["cores"] == [1]
    for be in (a, b, c):
        be.release()


def test_memory_refusal_like_a_board(pack):
    """8 GB board: 18 contexts fit (the reference table and its 1.5 GiB stop rule); the 19th init fails with a
    clear error; after a release one fits again. A 16 GB board takes it."""
    board = Board(8, 0.001)
    held = [_ready(pack, board, "auto", "cross", b % 28)[0] for b in range(18)]
    assert board.contexts == 18
    extra = BoardSimBackend(threads=1, board=board)
    path, _ = _feeds(pack, 5, "self")
    extra.load(path)
    with pytest.raises(BackendError, match=r"MemAvailable at 1\.\d\d GiB, under the 1\.5 GiB stop rule") as e:
        extra.init()
    assert "modelled" in str(e.value) and "8 GB" in str(e.value) and board.refusals == 1
    extra.release()
    assert board.contexts == 18
    held.pop().release()
    again = BoardSimBackend(threads=1, board=board)
    again.load(path)
    again.init()
    assert again.context_mb() == pytest.approx(BoardModel().context_mib(18))
    again.release()
    for be in held:
        be.release()
    assert board.contexts == 0
    big = Board(16, 0.001)
    many = [_ready(pack, big, "auto", "cross", b % 28)[0] for b in range(19)]
    assert big.contexts == 19 and big.refusals == 0
    for be in many:
        be.release()


def test_bad_settings_are_clear():
    with pytest.raises(ValueError, match="board_ram_gb"):
        BoardSimBackend(board_ram_gb=12)
    with pytest.raises(ValueError, match="time_scale"):
        BoardSimBackend(time_scale=0)
    with pytest.raises(ValueError, match="core_mask"):
        BoardSimBackend(core_mask="7")


def test_pipeline_job_on_board_sim_equals_onnx(assets, board_stages):
    """A whole job through supervisord with the executor on board-sim: the latent is bitwise the in-process ONNX
    Runtime result; the report keeps the modelled board apart from what was measured here. The encoder and the VAE
    are the board's (ONNX Runtime, board_stages): the executor's backend is the subject, and the latent is checked
    against the conditioning the job itself wrote."""
    import json
    from models.sampling.denoise import denoise, make_sampler, start_or_resume
    from models.sampling.spectrum import SpectrumSettings
    from models.runtime.dit_runner import DiTRunner
    from tests.pipeline_harness import Pipeline
    models, pack_dir = assets
    prompt = {"prompt": "1girl, silver hair", "negative_prompt": "worst quality", "seed": 7, "steps": 2, "cfg": 4.0,
              "spectrum": True}
    p = Pipeline.start(models, pack_dir, threads=1, branch_timeout_s=60, backend="board-sim", extra_toml=board_stages,
                       executor_toml='time_scale = 0.01\nboard_ram_gb = 8\npolicy = "on-demand"\n')
    try:
        job = p.submit(prompt)
        info = p.wait(job, ("done", "failed"), timeout_s=600)
        assert info.state == "done", p.logs()
        job_dir = p.job_dir(job)
        report = p.report(job)
        trace = p.trace(job)
        latent = np.load(job_dir / "latent.npy")
        cond, uncond = np.load(job_dir / "cond.npy"), np.load(job_dir / "uncond.npy")
    finally:
        killed = p.stop()
    assert killed == [] and p.leftover_segments() == []
    pack = load_pack(pack_dir)
    g, c = pack.geometry, pack.config
    sampler = make_sampler(2, 4.0, "sgm_uniform", SpectrumSettings())
    state = start_or_resume(sampler, 7, (c.latent_channels, g.latent_h, g.latent_w))
    want = denoise(DiTRunner(pack, threads=1), sampler, state, cond, uncond).latent
    np.testing.assert_array_equal(latent, want)
    # the report: per-step figures, the board block labelled modelled with its time scale, measured parts apart
    board = report["board"]
    assert board["label"] == "modelled" and board["time_scale"] == 0.01 and board["board_ram_gb"] == 8
    model = BoardModel(Shape.of_pack(pack_dir, "full"))
    assert [s["step"] for s in report["steps"]] == [1, 2] and all(s["calls"] == 84 for s in report["steps"])
    assert board["modelled"]["npu_s"] == pytest.approx(2 * model.step_parts()["npu_s"])
    for row in board["steps"]:          # the paced parts took at least modelled x scale, shown in board seconds
        assert row["lifecycle_s"] >= 0.999 * model.step_parts()["lifecycle_s"]
        assert row["host_s"] >= 0.999 * model.step_parts()["host_s"]
    assert set(board["measured_here"]) == {"transport_s", "other_s", "host_work_s"}
    assert board["measured_here"]["host_work_s"] == pytest.approx(report["host_work_s"])
    ledger = trace[-1]["board"][0]
    assert ledger["label"] == "modelled" and ledger["phases"]["npu"]["phases"] == 2 * 84 * 2
    from orchestrator.engine.report import format_table
    table = format_table(report)
    assert "modelled" in table and "time_scale=0.01" in table and "measured" in table
    json.dumps(report)


def test_contexts_inferring_at_once_share_the_npu_as_the_peers_measured():
    """NPU work of n contexts at once progresses at concurrent_speedup[n-1] / n each (1.78x / 2, 2.39x / 3: peer
    figures P1, P2); one alone at full speed; one that starts after another finished is not slowed."""
    board = Board(8, 1.0)

    def run(n: int, work: float = 0.2) -> list:
        gate, got = threading.Barrier(n), []

        def one():
            gate.wait()
            got.append(board.npu_work(clock(), work, 1.0, 0.0, lambda: None)[1])
        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        return got
    (alone,) = run(1)
    assert alone.modelled_s == pytest.approx(0.2, rel=0.02) and alone.wall_s >= 0.2 * 0.99
    for n, speedup in ((2, 1.78), (3, 2.39)):
        for p in run(n):
            assert p.modelled_s == pytest.approx(0.2 * n / speedup, rel=0.05)
            assert p.wall_s + 0.005 >= p.target_s
    first = board.npu_work(clock(), 0.05, 1.0, 0.0, lambda: None)[1]
    second = board.npu_work(clock(), 0.05, 1.0, 0.0, lambda: None)[1]
    assert first.modelled_s == pytest.approx(0.05, rel=0.05) and second.modelled_s == pytest.approx(0.05, rel=0.05)
