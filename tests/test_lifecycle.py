"""The one branch lifecycle and its policies, in process.

A recording fake backend checks the structure of each policy (what is loaded when, on which core mask, from which
thread, how many contexts at once, which models stay resident); the real ONNX Runtime backend on the tiny pack checks
that every policy and combination gives the on-demand forward bitwise, and that interleave really overlaps host ops
of one pass with the other pass's inference (from the calls' own timestamps)."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from models.runtime.backends.base import BackendError, BranchBackend
from models.runtime.backends.onnx import OnnxBackend
from models.runtime.dit_runner import DiTRunner
from models.runtime.lifecycle import Lifecycle, LifecycleError, context_factory, run_branch, single_context
from models.runtime.phase_times import PhaseSums, PhaseTimes, add_call
from models.packs.pack import build_pack, load_pack
from models.board.policy import (Policy, PolicyError, check_policy, parse_policy,
                           resolve_policy)

WAIT_S = 30.0          # how long a fake inference waits for the structure it checks (a condition, not a timing)


# ---- a recording fake backend -------------------------------------------------------------------------------------
class Fake(BranchBackend):
    """Deterministic outputs (a function of the model and the input), every phase recorded, live contexts counted.
    `hook(backend, inputs)` runs inside infer() (tests use it to wait for a condition)."""
    name = "fake"
    parallel_contexts = 2
    takes_core_mask = True
    lock = threading.Condition()
    events: list = []
    live = peak = 0
    ready: set = set()                 # paths loaded and initialised by some context right now
    costs: dict = {}                   # path -> context_mb
    hook = None
    fail = {}                          # (phase, path) -> message

    def __init__(self, threads=None, core_mask="auto"):
        self.mask, self.path, self.loaded = core_mask, None, False

    @classmethod
    def reset(cls):
        cls.events, cls.live, cls.peak, cls.ready, cls.costs, cls.hook, cls.fail = [], 0, 0, set(), {}, None, {}

    def _rec(self, phase):
        with Fake.lock:
            Fake.events.append((phase, Path(self.path).name, self.mask, threading.current_thread().name))
            Fake.lock.notify_all()

    def load(self, path):
        self.path = str(path)
        if ("load", Path(path).name) in Fake.fail:
            raise BackendError(Fake.fail["load", Path(path).name])
        with Fake.lock:
            Fake.live += 1
            Fake.peak = max(Fake.peak, Fake.live)
        self.loaded = True
        self._rec("load")

    def init(self):
        self._rec("init")
        with Fake.lock:
            Fake.ready.add(Path(self.path).name)
            Fake.lock.notify_all()

    def infer(self, inputs):
        if ("infer", Path(self.path).name) in Fake.fail:
            raise BackendError(Fake.fail["infer", Path(self.path).name])
        self._rec("infer")
        if Fake.hook is not None:
            Fake.hook(self, inputs)
        return {"y": inputs["xn"] * 2.0 + len(Path(self.path).name)}

    def release(self):                  # also called after a failed load (it must be harmless then)
        if not self.loaded:
            return
        self.loaded = False
        self._rec("release")
        with Fake.lock:
            Fake.live -= 1
            Fake.ready.discard(Path(self.path).name)

    def context_mb(self):
        return Fake.costs.get(Path(self.path).name, 10.0)


@pytest.fixture()
def fake():
    Fake.reset()
    yield Fake
    Fake.reset()


PATHS = [f"/pack/onnx/b{b:02d}_{k}.onnx" for b in range(4) for k in ("self", "cross", "ffn")]


def _feeds(i, n=2):
    return [{"xn": np.full((2, 3), float(10 * i + p), np.float32)} for p in range(n)]


def _cycle(lc, steps=2, depth=4, n=2):
    """Run PATHS in order `steps` times, hints for the next `depth` branches; -> [(outs, PhaseTimes)]."""
    out = []
    for _ in range(steps):
        for i, p in enumerate(PATHS):
            out.append(lc.run(p, _feeds(i, n), ahead=PATHS[i + 1:i + 1 + depth]))
    return out


# ---- policies: parsing, capabilities, auto ----------------------------------------------------------------------
def test_policy_strings_tables_and_names():
    assert parse_policy("on-demand") == Policy() and Policy().name == "on-demand"
    p = parse_policy("prefetch2+dual_core", {"dual_masks": ["1", "2"]})
    assert (p.prefetch, p.dual_core, p.interleave, p.dual_masks, p.name) == (2, True, False, ("1", "2"),
                                                                              "prefetch2+dual_core")
    p = parse_policy("interleave+Resident+prefetch", {"resident_mb": 512})
    assert p.name == "resident+prefetch+interleave" and p.resident_mb == 512.0
    assert parse_policy(p.name, {"resident_mb": 512}) == p                    # the canonical name parses back
    assert parse_policy({"prefetch": 2, "interleave": True}) == Policy(prefetch=2, interleave=True)
    assert parse_policy({"prefetch": True, "resident_mb": 64}).name == "resident+prefetch"
    assert parse_policy("on-demand+dual_core").name == "dual_core"
    assert Policy(prefetch=2, dual_core=True).contexts_in_flight() == 8 and Policy().contexts_in_flight() == 1


@pytest.mark.parametrize("value,settings,message", [
    ("prefetch+nope", {}, "unknown term 'nope'"),
    ("resident", {}, "needs resident_mb"),
    ("resident", {"resident_mb": -5}, "needs resident_mb"),
    ("interleave+dual_core", {}, "do not combine"),
    ("on-demand+prefetch", {}, "contradicts"),
    ("prefetch+prefetch2", {}, "given twice"),
    ("prefetch9", {}, "prefetch depth 9"),
    ("auto", {}, "resolve_policy"),
    ({"prefetch": 1, "bogus": True}, {}, "unknown key"),
    ({"dual_core": "yes"}, {}, "policy.dual_core"),
    (42, {}, "expected a string"),
    ("dual_core", {"dual_masks": ["0"]}, "exactly two"),
])
def test_policy_errors_say_what_is_wrong(value, settings, message):
    with pytest.raises(PolicyError, match=message):
        parse_policy(value, settings)


def test_policy_problem_is_the_config_check():
    from models.board.policy import policy_problem
    assert policy_problem("auto") == "" and policy_problem("prefetch2+interleave") == ""
    assert policy_problem("resident", {"resident_mb": 100}) == ""
    assert "needs resident_mb" in policy_problem("resident") and "unknown term" in policy_problem("fast")


def test_policies_are_checked_against_the_backend():
    from models.runtime.backends.rknn_sim import RknnSimBackend
    check_policy(parse_policy("prefetch2+dual_core"), OnnxBackend)
    check_policy(parse_policy("interleave"), RknnSimBackend)                 # one context at a time: fine
    with pytest.raises(PolicyError, match="holds 1"):
        check_policy(parse_policy("prefetch"), RknnSimBackend)
    with pytest.raises(PolicyError, match="two contexts at the same time"):
        check_policy(parse_policy("dual_core"), RknnSimBackend)


def test_auto_uses_the_given_chooser_the_backends_own_or_the_safe_default():
    from models.runtime.backends.rknn_sim import RknnSimBackend
    assert resolve_policy("auto", "onnx", OnnxBackend).name == "prefetch"      # documented safe default
    assert resolve_policy(None, "rknn-sim", RknnSimBackend).name == "on-demand"
    seen = []

    def chooser(ctx):
        seen.append(ctx)
        return "resident+prefetch2" if ctx.settings.get("board_ram") == 16 else Policy(dual_core=True)
    p = resolve_policy("auto", "onnx", OnnxBackend, {"board_ram": 16, "resident_mb": 900}, packs=["/p", "/q"],
                       chooser=chooser)
    assert p.name == "resident+prefetch2" and p.resident_mb == 900
    assert seen[0].backend == "onnx" and seen[0].backend_class is OnnxBackend
    assert [str(x) for x in seen[0].packs] == ["/p", "/q"]
    assert resolve_policy("auto", "onnx", OnnxBackend, chooser=chooser).name == "dual_core"
    assert resolve_policy("on-demand", "onnx", OnnxBackend, chooser=chooser).name == "on-demand"   # only auto asks
    assert len(seen) == 2

    class ChoosySim(RknnSimBackend):                    # a backend's own chooser: checked against it too
        @classmethod
        def auto_policy(cls, ctx):
            return "dual_core"
    with pytest.raises(PolicyError, match="two contexts at the same time"):
        resolve_policy("auto", "rknn-sim", ChoosySim)
    assert resolve_policy("auto", "rknn-sim", ChoosySim, chooser=lambda ctx: None).name == "on-demand"  # no opinion


# ---- the lifecycle's structure (fake backend) -------------------------------------------------------------------
def test_on_demand_loads_runs_and_releases_each_branch_in_order(fake):
    lc = Lifecycle(context_factory(Fake))
    res = _cycle(lc, steps=1)
    per = [e[:2] for e in fake.events]
    want = [(ph, Path(p).name) for p in PATHS for ph in ("load", "init", "infer", "infer", "release")]
    assert per == want and fake.peak == 1 and fake.live == 0
    for i, (outs, t) in enumerate(res):
        np.testing.assert_array_equal(outs[1]["y"], _feeds(i)[1]["xn"] * 2.0 + len(Path(PATHS[i]).name))
        assert t.source == "load" and t.visible_s == pytest.approx(t.load_s + t.init_s + t.release_s)
        assert t.prev_release_s == 0 and len(t.infer_s) == len(t.infer_at) == 2 and t.context_mb == 10.0
    lc.close()


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_prepares_the_next_branches_while_one_infers(fake, depth):
    """Each inference waits until the next `depth` branches are loaded and initialised by the helper thread: the
    run only finishes without a miss when the lifecycle really prepares them during the inference."""
    misses = []

    def hook(be, inputs):
        i = PATHS.index(be.path)
        want = {Path(p).name for p in PATHS[i + 1:i + 1 + depth]}
        with Fake.lock:
            if not Fake.lock.wait_for(lambda: want <= Fake.ready, WAIT_S):
                misses.append((i, sorted(want - Fake.ready)))
    fake.hook = hook
    lc = Lifecycle(context_factory(Fake), Policy(prefetch=depth))
    res = _cycle(lc, steps=1)
    lc.close()
    assert misses == []
    assert [t.source for _, t in res] == ["load"] + ["prefetch"] * (len(PATHS) - 1)
    assert all(t.release_s == 0 and t.load_s > 0 for _, t in res[:-1])    # releases run on the helper thread
    assert all(t.prev_release_s > 0 for _, t in res[1:])                    # ... reported by the next call
    assert res[-1][1].release_s > 0                   # the last call (nothing ahead) releases before it returns
    assert fake.peak <= Policy(prefetch=depth).contexts_in_flight() and fake.live == 0
    helper = {e[3] for e in fake.events if e[0] in ("load", "init") and e[1] != Path(PATHS[0]).name}
    assert helper and all(n.startswith("lifecycle-helper") for n in helper)
    loads = [e[1] for e in fake.events if e[0] == "load"]
    assert sorted(loads) == sorted(Path(p).name for p in PATHS)             # each model loaded exactly once


def test_prefetch_that_fails_loads_on_demand_and_stale_ones_are_dropped(fake, caplog):
    fake.fail = {("load", "b01_self.onnx"): "disk on fire"}
    lc = Lifecycle(context_factory(Fake), Policy(prefetch=1))
    with caplog.at_level(logging.WARNING):
        with pytest.raises(LifecycleError, match="disk on fire") as e:
            _cycle(lc, steps=1, depth=1)                  # the on-demand retry fails too: the call fails, naming it
    assert e.value.phase == "load" and "prefetch of /pack/onnx/b01_self.onnx failed" in caplog.text
    fake.fail = {}
    lc.run(PATHS[5], _feeds(5), ahead=[PATHS[6]])          # b01_ffn after a jump: b02_self prepared
    lc.run(PATHS[0], _feeds(0), ahead=[PATHS[1]])          # a jump back: the prepared b02_self is released unused
    lc.close()
    assert fake.live == 0
    assert [e[1] for e in fake.events if e[0] == "release"].count("b02_self.onnx") == 1


def test_dual_core_runs_the_two_passes_at_once_on_two_contexts(fake):
    both = threading.Barrier(2, timeout=WAIT_S)             # each pass waits for the other: they must overlap
    broken = []

    def hook(be, inputs):
        try:
            both.wait()
        except threading.BrokenBarrierError:
            broken.append(be.path)
    fake.hook = hook
    lc = Lifecycle(context_factory(Fake), parse_policy("dual_core", {"dual_masks": ["1", "2"]}))
    res = _cycle(lc, steps=1)
    lc.close()
    assert broken == [] and fake.peak == 2 and fake.live == 0
    for i, p in enumerate(PATHS):
        inf = [e for e in fake.events if e[0] == "infer" and e[1] == Path(p).name]
        assert sorted(e[2] for e in inf) == ["1", "2"] and len({e[3] for e in inf}) == 2
        outs, t = res[i]
        for q in (0, 1):                                    # pass q's output belongs to pass q's input
            np.testing.assert_array_equal(outs[q]["y"], _feeds(i)[q]["xn"] * 2.0 + len(Path(p).name))
        assert t.context_mb == 20.0                         # two contexts: twice the memory


def test_dual_core_pair_loads_inits_and_releases_at_once(fake):
    """A dual_core branch's two contexts load, init and release at the same time on two threads, not one after the
    other (done in turn, a pair's lifecycle outlasts its inference on the board: issue 9's auto job); a pair whose
    second half fails to load fails the call, naming the phase, with the first half released."""
    meet = {ph: threading.Barrier(2, timeout=WAIT_S) for ph in ("load", "init", "release")}
    broken = []

    class Pair(Fake):
        def _meet(self, ph):
            try:
                meet[ph].wait()
            except threading.BrokenBarrierError:
                broken.append(ph)

        def load(self, path):
            super().load(path)
            self._meet("load")

        def init(self):
            super().init()
            self._meet("init")

        def release(self):
            was = self.loaded
            super().release()
            if was:
                self._meet("release")
    lc = Lifecycle(context_factory(Pair), parse_policy("dual_core", {"dual_masks": ["1", "2"]}))
    res = _cycle(lc, steps=1)
    lc.close()
    assert broken == [] and fake.live == 0 and fake.peak == 2
    for i, (outs, t) in enumerate(res):
        np.testing.assert_array_equal(outs[1]["y"], _feeds(i)[1]["xn"] * 2.0 + len(Path(PATHS[i]).name))
        assert t.context_mb == 20.0 and t.source == "load"
    threads = {e[3] for e in fake.events if e[0] == "load"}
    assert any(n.startswith("lifecycle-pair") for n in threads) and len(threads) >= 2

    class HalfFails(Fake):
        def load(self, path):
            if self.mask == "2":
                raise BackendError("no room on core 2")
            super().load(path)
    fake.reset()
    lc = Lifecycle(context_factory(HalfFails), parse_policy("dual_core", {"dual_masks": ["1", "2"]}))
    with pytest.raises(LifecycleError, match="no room on core 2") as e:
        lc.run(PATHS[0], _feeds(0))
    lc.close()
    assert e.value.phase == "load" and fake.live == 0
    assert [x[0] for x in fake.events] == ["load", "init", "release"]      # the first half, opened meanwhile


def test_resident_pins_exactly_what_the_budget_allows(fake):
    """First fit in the fixed cycle order, decided once per model; the rest loads on demand every time."""
    costs = [30, 50, 20, 40, 10, 60, 25, 35, 15, 45, 5, 55]
    fake.costs = {Path(p).name: float(c) for p, c in zip(PATHS, costs)}
    budget = 120.0
    lc = Lifecycle(context_factory(Fake), Policy(resident_mb=budget))
    res = _cycle(lc, steps=3)
    # the independent expectation: first fit, in order
    used, want = 0.0, []
    for p, c in zip(PATHS, costs):
        if used + c <= budget:
            used, want = used + c, want + [p]
    assert lc.resident_paths == want and lc.resident_mb == used <= budget
    assert all(c > budget - used for p, c in zip(PATHS, costs) if p not in want)   # nothing else would fit
    assert fake.live == len(want) == 5
    n = len(PATHS)
    for step in (1, 2):
        src = [t.source for _, t in res[step * n:(step + 1) * n]]
        assert src == ["resident" if p in want else "load" for p in PATHS]
    loads = [e[1] for e in fake.events if e[0] == "load"]
    for p in PATHS:
        assert loads.count(Path(p).name) == (1 if p in want else 3)
    lc.close()
    assert fake.live == 0


def test_resident_with_prefetch_and_dual_core(fake):
    fake.costs = {Path(p).name: 10.0 for p in PATHS}
    lc = Lifecycle(context_factory(Fake), parse_policy("resident+prefetch+dual_core", {"resident_mb": 45}))
    res = _cycle(lc, steps=2)
    assert len(lc.resident_paths) == 2 and lc.resident_mb == 40.0        # a pair of contexts costs 20
    assert fake.peak <= 2 * 2 + Policy(prefetch=1, dual_core=True).contexts_in_flight()
    assert [t.source for _, t in res[len(PATHS):]][:3] == ["resident", "resident", "prefetch"]
    lc.close()
    assert fake.live == 0


def test_hold_keeps_the_model_for_the_other_pass(fake):
    lc = Lifecycle(context_factory(Fake), Policy(interleave=True))
    a, ta = lc.run(PATHS[0], _feeds(0)[:1], hold=True)
    b, tb = lc.run(PATHS[0], _feeds(0)[1:])
    assert (ta.source, tb.source, tb.load_s, tb.init_s) == ("load", "held", 0.0, 0.0) and ta.release_s == 0
    assert [e[0] for e in fake.events] == ["load", "init", "infer", "infer", "release"]
    lc.run(PATHS[1], _feeds(1)[:1], hold=True)
    lc.run(PATHS[2], _feeds(2)[:1])                   # the other pass never came: the held model is released first
    assert [e[:2] for e in fake.events[5:]] == [("load", "b00_cross.onnx"), ("init", "b00_cross.onnx"),
                                                ("infer", "b00_cross.onnx"), ("release", "b00_cross.onnx"),
                                                ("load", "b00_ffn.onnx"), ("init", "b00_ffn.onnx"),
                                                ("infer", "b00_ffn.onnx"), ("release", "b00_ffn.onnx")]
    lc.close()
    assert fake.live == 0


def test_failed_inference_names_the_pass_and_releases(fake):
    fake.fail = {("infer", "b00_cross.onnx"): "bad input"}
    lc = Lifecycle(context_factory(Fake), Policy(prefetch=1))
    lc.run(PATHS[0], _feeds(0), ahead=[PATHS[1]])
    with pytest.raises(LifecycleError, match="bad input") as e:
        lc.run(PATHS[1], _feeds(1), ahead=[PATHS[2]])
    assert (e.value.phase, e.value.pass_index) == ("infer", 0)
    fake.fail = {}
    outs, t = lc.run(PATHS[2], _feeds(2))
    lc.close()
    assert fake.live == 0 and len(outs) == 2


def test_background_release_is_credited_to_the_previous_kind():
    sums = {}
    add_call(sums, "self", PhaseTimes(load_s=1, init_s=2, infer_s=(3, 3), release_s=0.5, infer_at=(0, 3)))
    add_call(sums, "cross", PhaseTimes(load_s=1, init_s=1, infer_s=(1,), wait_s=0.25, prev_release_s=0.75,
                                       source="prefetch"))
    add_call(sums, "self", PhaseTimes(infer_s=(1,), prev_release_s=0.125, source="resident"))
    s, c, f = sums["self"], sums["cross"], sums["ffn"]
    assert (s.calls, s.release_s, s.visible_s, s.infer_s, s.cached) == (2, 1.25, 3.5, 7.0, 1)
    assert (c.calls, c.release_s, c.visible_s, c.hidden_s, c.cached) == (1, 0.0, 0.25, 1.75, 1)
    assert (f.calls, f.release_s, f.hidden_s) == (0, 0.125, 0.125)
    t = PhaseTimes(load_s=1, init_s=2, infer_s=(3, 3), infer_at=(10.0, 10.5))
    assert t.total_s == 3 + 3.5 and t.npu_s == 6                          # overlapping passes count once
    assert PhaseSums().merge(s).merge(c).calls == 3


def test_a_single_backend_instance_runs_on_demand_only():
    with pytest.raises(ValueError, match="needs several contexts"):
        Lifecycle(single_context(OnnxBackend(threads=1)), Policy(prefetch=1))


# ---- every policy on the real ONNX Runtime backend: bitwise the on-demand forward -------------------------------
@pytest.fixture(scope="module")
def pack128(tiny_dit, tmp_path_factory):
    return load_pack(build_pack(tiny_dit, tmp_path_factory.mktemp("lc") / "pack", (128, 128), "fp16"))


@pytest.fixture(scope="module")
def inputs(pack128):
    g, c = pack128.geometry, pack128.config
    rng = np.random.default_rng(11)
    x = rng.standard_normal((c.latent_channels, g.latent_h, g.latent_w)).astype(np.float32)
    cond = (rng.standard_normal((g.text_tokens, c.context_dim)) * 0.5).astype(np.float32)
    uncond = np.zeros_like(cond)
    uncond[:2] = cond[:2]
    return x, cond, uncond


def _two_forwards(runner, inputs):
    x, cond, uncond = inputs
    out = [runner.forward_cfg(x, 0.8, cond, uncond), runner.forward_cfg(x, 0.3, cond, uncond)]
    return np.stack([v for pair in out for v in pair])


@pytest.fixture(scope="module")
def on_demand(pack128, inputs):
    r = DiTRunner(pack128, threads=1)
    v = _two_forwards(r, inputs)
    return v, r.last_timing


POLICIES = ["prefetch", "dual_core", "interleave", "resident", "prefetch+interleave", "resident+prefetch2",
            "prefetch+dual_core", "resident+prefetch+interleave"]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_on_demand_forward_bitwise(pack128, inputs, on_demand, policy):
    p = parse_policy(policy, {"resident_mb": 8.0})
    r = DiTRunner(pack128, threads=1, policy=p)
    try:
        v = _two_forwards(r, inputs)
        t = r.last_timing
        lc = r.branches.lifecycle
        np.testing.assert_array_equal(v, on_demand[0])
        calls = 84 * (2 if p.interleave else 1)
        assert len(t.branches) == calls and sum(s.calls for s in t.per_kind.values()) == calls
        if p.prefetch:                              # second forward: all but its first branch came prepared/held
            assert sum(s.cached for s in t.per_kind.values()) >= calls - 1
        if p.resident:
            assert 0 < len(lc.resident_paths) < 84 and lc.resident_mb <= 8.0
            # second forward: each pinned model is taken from the resident set once (its interleaved second
            # pass finds it held), and stays loaded
            assert sum(x.source == "resident" for _, _, x in t.branches) == len(lc.resident_paths)
            assert lc.loaded()["resident"] == lc.resident_paths
        if p.dual_core:
            assert all(len(x.infer_at) == 2 for _, _, x in t.branches)
    finally:
        r.close()


def test_interleave_overlaps_host_ops_with_the_other_pass(pack128, inputs, on_demand):
    """From the calls' own timestamps: with interleave some host op of one pass ran while the other pass was
    inferring; in lockstep (on-demand) none ever does. Structural (intervals intersect or not), not a duration."""
    r = DiTRunner(pack128, threads=1, policy="interleave")
    try:
        v = _two_forwards(r, inputs)
        t = r.last_timing
    finally:
        r.close()
    np.testing.assert_array_equal(v, on_demand[0])
    ov = t.overlaps()
    assert ov and t.host_hidden_s > 0
    for (b, k, p, t0, t1), (b2, k2, q, a, e) in ov:
        assert p != q and t0 < e and a < t1
    # each pass's calls in strict block order, both passes of a branch on one load (the second finds it held)
    order = [(b, k, ps) for (b, k, _), ps in zip(t.branches, t.passes)]
    assert order[:4] == [(0, "self", (0,)), (0, "self", (1,)), (0, "cross", (0,)), (0, "cross", (1,))]
    assert [x.source for _, _, x in t.branches[1::2]] == ["held"] * 84
    assert on_demand[1].overlaps() == [] and on_demand[1].host_hidden_s == 0.0


def test_run_branch_is_the_on_demand_lifecycle(pack128):
    be = OnnxBackend(threads=1)
    g, c = pack128.geometry, pack128.config
    xn = np.ones((g.tokens, c.width), np.float16)
    (out,), t = run_branch(be, pack128.branch_path(0, "ffn"), [{"xn": xn}])
    lc = Lifecycle(context_factory("onnx", threads=1), Policy(prefetch=1))
    (out2,), t2 = lc.run(pack128.branch_path(0, "ffn"), [{"xn": xn}])
    lc.close()
    np.testing.assert_array_equal(out["y"], out2["y"])
    assert t.source == "load" and t.release_s > 0 and t.context_mb >= Path(pack128.branch_path(0, "ffn")).stat().st_size / 2**20
