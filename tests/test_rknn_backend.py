"""The executor's `rknn` backend against the LABELLED STAND-IN for rknnlite (ONNX Runtime; we have no RK3588 here).

The .rknn files are real (compiled by rknn-toolkit2 in the session fixture `rknn_pack`); the stand-in maps each one
to the ONNX graph it was compiled from and runs that, so outputs are checked against ONNX Runtime directly.
"""
from __future__ import annotations

import numpy as np
import pytest

from models.runtime.backends import backend_class, make_backend
from models.runtime.backends import make_backend as make_model_backend      # one registry: the same function
from models.runtime.backends.base import BackendError
from models.runtime.backends.rknn import RknnLiteBackend
from models.runtime.backends.standin.rknnlite import RKNNLite
from models.runtime.lifecycle import Lifecycle, context_factory, run_branch
from models.board.policy import parse_policy


@pytest.fixture()
def calls():
    RKNNLite.calls.clear()
    yield RKNNLite.calls
    RKNNLite.calls.clear()


@pytest.fixture(scope="module")
def feeds(rknn_pack):
    """Two passes (cond, uncond) per kind, f16, shapes from the manifest."""
    from models.packs.pack import load_pack
    pack = load_pack(rknn_pack[0], check=False)
    rng = np.random.default_rng(3)
    out = {}
    for b in pack.branches[:3]:
        out[b["kind"]] = [{i["name"]: rng.standard_normal(i["shape"]).astype(np.float16) for i in b["inputs"]}
                          for _ in range(2)]
    return pack, out


def test_registry_resolves_rknn_in_stages():
    assert backend_class("rknn") is RknnLiteBackend
    assert backend_class("onnx").__name__ == "OnnxBackend"
    with pytest.raises(ValueError, match="backend 'nope'"):
        backend_class("nope")


def test_lifecycle_order_timings_and_memory(feeds, calls):
    pack, passes = feeds
    be = make_backend("rknn", lite="standin", core_mask="0_1_2")
    assert be.is_standin and be.mask == RKNNLite.NPU_CORE_0_1_2
    ort = make_model_backend("onnx", threads=1)
    for kind in ("self", "cross", "ffn"):
        b = pack.branch(0, kind)
        calls.clear()
        outs, t = run_branch(be, pack.dir / b["rknn"]["file"], passes[kind])
        name = f"b00_{kind}.rknn"
        assert [(c[0], c[1]) for c in calls] == [("load_rknn", name), ("init_runtime", name), ("inference", name),
                                                ("inference", name), ("release", name)]
        assert all(c[2] == RKNNLite.NPU_CORE_0_1_2 for c in calls[1:])
        assert min(t.load_s, t.init_s, *t.infer_s, t.release_s) > 0 and len(t.infer_s) == 2
        rep = be.report
        assert rep["standin"] is True and rep["branch"] == name and len(rep["passes"]) == 2
        assert set(rep["phases"]) == {"load", "init", "infer0", "infer1", "release"}
        for ph in rep["phases"].values():
            assert ph["s"] > 0 and ph["pss_before_kb"] > 0 and ph["pss_after_kb"] > 0
            assert "dma_buf_before" in ph and "dma_buf_after" in ph       # None where the board files are absent
        assert "npu_load" in rep
        mb = be.context_mb()          # measured PSS growth over load + init (here: the stand-in's ORT session)
        assert mb == max(0, rep["phases"]["init"]["pss_after_kb"] - rep["phases"]["load"]["pss_before_kb"]) / 1024
        assert t.context_mb == mb and t.source == "load"
        # same numbers as ONNX Runtime on the ONNX graph, in the pack's dtype
        want, _ = run_branch(ort, pack.dir / b["onnx"], passes[kind])
        for got, ref in zip(outs, want):
            assert got["y"].dtype == np.float16 and got["y"].shape == ref["y"].shape
            np.testing.assert_array_equal(got["y"], ref["y"])


def test_two_cores_run_cond_and_uncond_on_two_contexts(feeds, calls):
    """dual_core is a lifecycle policy: two RknnLiteBackend contexts on the policy's dual_masks, one pass each."""
    pack, passes = feeds
    lc = Lifecycle(context_factory(RknnLiteBackend, lite="standin"), parse_policy("dual_core",
                                                                                  {"dual_masks": ["0", "2"]}))
    b = pack.branch(0, "ffn")
    outs, t = lc.run(pack.dir / b["rknn"]["file"], passes["ffn"])
    loads = [c for c in calls if c[0] == "load_rknn"]
    inits = sorted(c[2] for c in calls if c[0] == "init_runtime")
    infers = [c for c in calls if c[0] == "inference"]
    assert len(loads) == 2 and inits == [RKNNLite.NPU_CORE_0, RKNNLite.NPU_CORE_2]
    by_thread = {c[3]: c[2] for c in infers}                                # each context infers on its own thread
    assert len(infers) == 2 and sorted(by_thread.values()) == [RKNNLite.NPU_CORE_0, RKNNLite.NPU_CORE_2]
    assert [c[0] for c in calls][-2:] == ["release", "release"]
    assert len(t.infer_s) == len(t.infer_at) == 2 and t.source == "load"
    lc.close()
    # each pass's output belongs to its own input (cond first), equal to one-core results
    single = make_backend("rknn", lite="standin", core_mask="1")
    ref, _ = run_branch(single, pack.dir / b["rknn"]["file"], passes["ffn"])
    for got, want in zip(outs, ref):
        np.testing.assert_array_equal(got["y"], want["y"])
    assert not np.array_equal(outs[0]["y"], outs[1]["y"])


def test_every_backend_is_reached_from_models_alone():
    """The registry's classes (the board's rknn and board-sim included) and `anima-models decode` import no stage,
    protocol or orchestrator module: the model CLI runs every backend without a process package."""
    import subprocess
    import sys
    code = ("import sys; from models.runtime.backends import BACKENDS, backend_class; import models.commands.decode; "
            "[backend_class(n) for n in BACKENDS]; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'stages', 'protocol', 'orchestrator'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# the RKNNLite constants of rknn-toolkit-lite2 2.x (rknnlite/api/rknn_lite.py), written out here as the reference
LITE_MASKS = {"auto": 0, "0": 1, "1": 2, "2": 4, "0_1": 3, "0_1_2": 7, "all": 0xFFFF}
BOARD_CORES = {"auto": {0, 1, 2}, "0": {0}, "1": {1}, "2": {2}, "0_1": {0, 1}, "0_1_2": {0, 1, 2}, "all": {0, 1, 2}}


def test_one_core_mask_table_for_the_config_rknn_and_board_sim():
    """Every word (in any case, with or without NPU_CORE_) means the same mask to the config check, the rknn backend
    (its RKNNLite constant) and board-sim (the cores a context may take); an unknown word is refused by all three."""
    from models.runtime.backends.board_sim import Board, BoardSimBackend
    from stages.settings import _core_mask
    assert set(LITE_MASKS) == set(BOARD_CORES)
    for word, value in LITE_MASKS.items():
        for spelled in (word, f" NPU_CORE_{word.upper()} "):
            assert _core_mask(spelled) == ""
            assert RknnLiteBackend(lite="standin", core_mask=spelled).mask == value
            sim = BoardSimBackend(core_mask=spelled, board=Board(8, 0.01))
            assert sim.mask_key == word and set(sim.cores) == BOARD_CORES[word]
    for bad in ("3", "0_2", "npu"):
        assert "choose one of auto, 0, 1, 2, 0_1, 0_1_2, all" in _core_mask(bad)
        for make in (lambda m: RknnLiteBackend(lite="standin", core_mask=m), lambda m: BoardSimBackend(core_mask=m)):
            with pytest.raises(ValueError, match="core_mask"):
                make(bad)


def test_bad_requests_are_clear(feeds, tmp_path):
    pack, passes = feeds
    with pytest.raises(ValueError, match="core_mask '5'"):
        RknnLiteBackend(lite="standin", core_mask="5")
    be = RknnLiteBackend(lite="standin")
    with pytest.raises(BackendError, match="no such compiled branch"):
        be.load(tmp_path / "rknn" / "b00_ffn.rknn")
    with pytest.raises(BackendError, match="not a branch of pack"):
        be.load(pack.dir / "onnx" / "b99_ffn.onnx")      # an ONNX path resolves through the manifest, or fails
    be.load(pack.dir / pack.branch(0, "ffn")["rknn"]["file"])
    be.init()
    try:
        with pytest.raises(BackendError, match="input 'xn' has shape"):
            be.infer({"xn": np.zeros((2, 2), np.float16)})
        with pytest.raises(BackendError, match="missing input 'xn'"):
            be.infer({})
    finally:
        be.release()
    with pytest.raises(BackendError, match="infer\\(\\) before init"):
        be.infer(passes["ffn"][0])
    # on this x86 machine the real runtime is absent: a clear message, never a silent fall-back to the stand-in
    with pytest.raises(BackendError, match="rknn-toolkit-lite2"):
        RknnLiteBackend(lite="real")


def test_board_bench_refuses_off_board():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench" / "board.py"), "--pack", "nowhere"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "not an RK3588 board" in r.stderr and "Traceback" not in r.stderr


def test_onnx_branch_path_resolves_to_its_compiled_file(feeds, calls):
    """The scheduler names PACK/onnx/bNN_kind.onnx; the rknn backend runs the .rknn the manifest records for it."""
    pack, passes = feeds
    be = make_backend("rknn", lite="standin")
    outs, _ = run_branch(be, pack.branch_path(0, "ffn"), passes["ffn"])
    assert calls[0][:2] == ("load_rknn", "b00_ffn.rknn") and len(outs) == 2
    with pytest.raises(BackendError, match="not compiled for the NPU"):
        be.load(pack.branch_path(1, "ffn"))            # the fixture compiles blocks 0 and 27 only


def test_policies_on_the_board_backend_give_on_demand_results(rknn_pack, calls):
    """The real RKNNLite call sequence (stand-in) under resident + prefetch + dual_core: contexts loaded on the helper
    thread, each keeping the core mask it was initialised with, pinned ones never released; outputs bitwise equal
    to on-demand; every context released at close."""
    from models.packs.pack import load_pack
    pack = load_pack(rknn_pack[0], check=False)
    compiled = [pack.branch_path(b["block"], b["kind"]) for b in pack.branches if isinstance(b.get("rknn"), dict)]
    rng = np.random.default_rng(5)
    feeds = [[{i["name"]: rng.standard_normal(i["shape"]).astype(np.float16) for i in pack.branch(b, k)["inputs"]}
              for _ in range(2)] for b, k in ((int(p.name[1:3]), p.stem.split("_")[1]) for p in compiled)]
    ref = [run_branch(make_backend("rknn", lite="standin"), p, f)[0] for p, f in zip(compiled, feeds)]
    calls.clear()
    pol = parse_policy("resident+prefetch+dual_core", {"resident_mb": 1e6, "dual_masks": ["1", "2"]})
    lc = Lifecycle(context_factory(RknnLiteBackend, lite="standin"), pol)
    for step in range(2):
        for i, (p, f) in enumerate(zip(compiled, feeds)):
            outs, t = lc.run(p, f, ahead=compiled[i + 1:i + 2])
            for got, want in zip(outs, ref[i]):
                np.testing.assert_array_equal(got["y"], want["y"])
            assert t.source == ("resident" if step else ("load" if i == 0 else "prefetch"))
    assert lc.resident_paths == [str(p) for p in compiled]          # a budget this large pins them all
    masks = {c[2] for c in calls if c[0] == "init_runtime"}
    assert masks == {RKNNLite.NPU_CORE_1, RKNNLite.NPU_CORE_2}
    assert any(c[3].startswith("lifecycle-helper") for c in calls if c[0] == "load_rknn")
    assert not [c for c in calls if c[0] == "release"]
    lc.close()
    assert sum(c[0] == "release" for c in calls) == sum(c[0] == "load_rknn" for c in calls) == 2 * len(compiled)


def test_inputs_go_as_rknnlite_wants_them(feeds):
    """The backend hands RKNNLite FP16 arrays with data_type float16 and every (non-4-D) input passed through
    unconverted; outputs come back float32 from the runtime and leave the backend FP16, exactly ONNX Runtime's FP16
    result; the three steps of inference() are timed apart for the calibration, and the bytes counted."""
    pack, passes = feeds
    for kind in ("self", "cross", "ffn"):
        b = pack.branch(0, kind)
        be = RknnLiteBackend(lite="standin")
        be.load(pack.dir / b["rknn"]["file"])
        be.init()
        try:
            got, split = be.infer_timed(passes[kind][0])
            rt = be._ctx.rknn_runtime
            assert rt.passed_through == [1] * len(b["inputs"])
            assert set(split) == {"in_s", "npu_s", "out_s"} and min(split.values()) > 0
            rep = be.report["passes"][-1]
            assert rep["bytes_in"] == sum(2 * int(np.prod(i["shape"])) for i in b["inputs"])
            assert rep["bytes_out"] == 4 * int(np.prod(b["outputs"][0]["shape"]))       # float32 from RKNNLite
            assert rep["s"] >= sum(split.values())
            plain = be.infer(passes[kind][0])
            assert got["y"].dtype == np.float16
            np.testing.assert_array_equal(got["y"], plain["y"])
        finally:
            be.release()
        off = RknnLiteBackend(lite="standin", pass_through=False)        # the documented way out on a board
        off.load(pack.dir / b["rknn"]["file"])
        off.init()
        try:
            np.testing.assert_array_equal(off.infer(passes[kind][0])["y"], got["y"])
            assert off._ctx.rknn_runtime.passed_through == [0] * len(b["inputs"])
        finally:
            off.release()


def test_the_standin_keeps_rknnlites_input_rules(feeds):
    """What the real wrapper refuses (rknn-toolkit-lite2 2.5.0, P9 in docs/board-figures.md), the stand-in refuses:
    it logs and returns None, never computes from a buffer the board would read wrongly."""
    pack, passes = feeds
    b = pack.branch(0, "ffn")
    lite = RKNNLite()
    assert lite.load_rknn(str(pack.dir / b["rknn"]["file"])) == 0 and lite.init_runtime() == 0
    xn = passes["ffn"][0]["xn"]
    try:
        ok = lite.inference(inputs=[xn], data_type=["float16"], inputs_pass_through=[1])
        assert ok is not None and ok[0].dtype == np.float32
        assert lite.inference(inputs=[xn.astype(np.float32)]) is not None            # converted by the runtime
        assert lite.inference(inputs=[xn.astype(np.float32)], inputs_pass_through=[1]) is None   # not its type
        assert lite.inference(inputs=[xn], data_type=["float32"]) is None             # data_type != dtype
        assert lite.inference(inputs=[xn], data_type="bfloat16") is None
        assert lite.inference(inputs=[xn], inputs_pass_through=[1, 0]) is None        # one flag per input
        assert lite.inference(inputs=[xn.tolist()]) is None                          # not an ndarray
        assert lite.inference(inputs=[xn, xn]) is None
        again = lite.inference(inputs=[xn], reuse_outputs=True)
        other = lite.inference(inputs=[passes["ffn"][1]["xn"]], reuse_outputs=True)
        assert again[0] is other[0]                              # reused: overwritten by the next call, as documented
    finally:
        lite.release()
