"""Hostile LoRA files and names (issue 30, items 4-8): a NaN in a branch layer fails when the job's LoRAs are set,
not a step later inside the scheduler's loop; one rank bound for every layer kind, from the header; trailing bytes,
huge headers and key counts refused; a file cut short after it was opened is an error, not SIGBUS; the host merge
stops on cancel; the daemon checks and hashes LoRAs off its own thread; names too long, link loops and links out
are 400s naming the field, in loras/ terms, and are not listed."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from models.dit.config import PRESETS
from models.dit.partition import Geometry
from models.lora import LoraError, LoraFile, LoraUse, plan_loras
from models.lora.apply import DitLora
from models.lora.choice import LoraChoice
from models.lora.file import MAX_HEADER_BYTES, MAX_KEYS, MAX_RANK
from models.lora.synth import lora_entries, lora_name, write_lora
from models.setup.models_dir import ModelsDirError, list_loras, lora_path, lora_relative
from models.base.safetensors_io import TensorEntry, write_safetensors
from tests.test_lora import tiny_table

TINY = PRESETS["tiny"]["dit"]


def _pair_file(path, module: str, model: str, shape: tuple, rank: int, fill=0.0):
    """One kohya pair for `module` ([out, in] = shape) at `rank`, every value `fill`."""
    name = lora_name(module, model, "kohya")
    out_f, in_f = shape
    write_safetensors(path, [TensorEntry(name + ".lora_up.weight", "F16", (out_f, rank),
                                         np.full((out_f, rank), fill, np.float32)),
                             TensorEntry(name + ".lora_down.weight", "F16", (rank, in_f),
                                         np.full((rank, in_f), fill, np.float32))])


def _first(place: str):
    """(module, model, shape) of the first non-embedding target of one place in the tiny model."""
    for key, t in tiny_table().targets.items():
        if t.place == place and "embed" not in key:
            return key[:-len(".weight")], t.model, t.shape
    raise AssertionError(place)


def _with_nan(path, groups, where: str):
    """A synthetic LoRA of `groups` whose up weight of the module named `where` holds a NaN."""
    entries = lora_entries("tiny", 5, "kohya", rank=4, alpha=2.0, groups=groups, dtype="F32")
    for i, e in enumerate(entries):
        if where in e.name and e.name.endswith(".lora_up.weight"):
            bad = np.array(e.data(), np.float32)
            bad[0, 0] = np.nan
            entries[i] = TensorEntry(e.name, e.dtype, e.shape, bad)
            break
    else:
        raise AssertionError(where)
    write_safetensors(path, entries)


# -- item 4: NaN/Inf in a branch layer --------------------------------------------------------------------------------
def test_nan_in_a_branch_layer_fails_when_the_loras_are_set(tmp_path):
    path = tmp_path / "nan.safetensors"
    _with_nan(path, ("blocks",), "blocks_3_cross_attn_v_proj")
    plan = plan_loras([LoraUse(str(path), 0.7)], tiny_table())        # headers only: the plan is made
    geom = Geometry.from_resolution(128, 128, lora_rank=8)
    with pytest.raises(LoraError, match=r"blocks_3_cross_attn_v_proj.lora_up.weight' holds NaN or Inf"):
        DitLora(plan, TINY, geom, "fp32")                              # the scheduler's _set_lora makes this
    good = tmp_path / "good.safetensors"
    write_lora("tiny", 5, good, "kohya", rank=4, alpha=2.0, groups=("blocks",), dtype="F32")
    dl = DitLora(plan_loras([LoraUse(str(good), 0.7)], tiny_table()), TINY, geom, "fp32")
    assert dl.branch_inputs(3, "cross")                                # a clean file still gives its inputs


def test_nan_in_a_host_layer_is_the_same_check(tmp_path):
    path = tmp_path / "nan_host.safetensors"
    _with_nan(path, ("host",), "final_layer")
    dl = DitLora(plan_loras([LoraUse(str(path))], tiny_table()), TINY, Geometry.from_resolution(128, 128), "fp32")
    base = {k: np.zeros(t.shape, np.float32) for k, t in tiny_table().targets.items() if t.place == "host"}
    with pytest.raises(LoraError, match="holds NaN or Inf"):
        dl.host_weights(base)


# -- item 5: one rank bound for every layer kind ----------------------------------------------------------------------
@pytest.mark.parametrize("place", ["host", "adapter", "te", "branch"])
def test_a_rank_over_the_bound_is_refused_from_the_header(tmp_path, place):
    module, model, shape = _first(place)
    over = tmp_path / "over.safetensors"
    _pair_file(over, module, model, shape, MAX_RANK + 1)
    with pytest.raises(LoraError, match=rf"rank {MAX_RANK + 1} .*at most {MAX_RANK}"):
        LoraFile(over)
    ok = tmp_path / "ok.safetensors"
    _pair_file(ok, module, model, shape, 16)
    assert [p.rank for p in LoraFile(ok).pairs.values()] == [16]


# -- item 6: trailing bytes, header size, key count -------------------------------------------------------------------
def test_trailing_bytes_after_the_last_tensor_are_refused(tmp_path):
    path = tmp_path / "t.safetensors"
    write_lora("tiny", 1, path, "comfy", rank=2, groups=("blocks",))
    LoraFile(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(LoraError, match="4096 bytes after the last tensor"):
        LoraFile(path)


def test_a_huge_header_and_too_many_keys_are_refused(tmp_path):
    module, model, shape = _first("branch")
    name = lora_name(module, model, "kohya")
    pair = [TensorEntry(name + ".lora_up.weight", "F32", (shape[0], 2), np.zeros((shape[0], 2), np.float32)),
            TensorEntry(name + ".lora_down.weight", "F32", (2, shape[1]), np.zeros((2, shape[1]), np.float32))]
    big = tmp_path / "big.safetensors"
    write_safetensors(big, pair, metadata={"ss_tag_frequency": "x" * (MAX_HEADER_BYTES + 1)})
    with pytest.raises(LoraError, match=f"at most {MAX_HEADER_BYTES} are read"):
        LoraFile(big)
    many = tmp_path / "many.safetensors"
    junk = [TensorEntry(f"junk{i}", "F32", (1,), np.zeros(1, np.float32)) for i in range(MAX_KEYS)]
    write_safetensors(many, pair + junk)
    with pytest.raises(LoraError, match=f"{MAX_KEYS + 2} tensors; at most {MAX_KEYS}"):
        LoraFile(many)
    write_safetensors(many, pair + junk[:100])                        # within the bound: opened, keys named as stray
    assert len(LoraFile(many).stray) == 100


# -- item 7: a file cut short mid-job; the merge stops on cancel ------------------------------------------------------
CUT_SCRIPT = """
import os, sys
from models.lora import LoraError, LoraFile
f = LoraFile(sys.argv[1])
pair = next(iter(f.pairs.values()))
with open(sys.argv[1], "rb") as h:
    n = int.from_bytes(h.read(8), "little")
os.truncate(sys.argv[1], 8 + n)                     # cut in place after it was opened (another writer, a bad copy)
try:
    f.up(pair)
except LoraError as e:
    print("refused:", e)
"""


def test_a_file_cut_short_after_opening_is_an_error_not_sigbus(tmp_path):
    path = tmp_path / "cut.safetensors"
    write_lora("tiny", 2, path, "kohya", rank=8, groups=("blocks",))
    # in a child: a mapped read of a page past the new end is SIGBUS, which would take pytest down with it
    r = subprocess.run([sys.executable, "-c", CUT_SCRIPT, str(path)], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "refused:" in r.stdout and "truncated" in r.stdout, r.stdout


class _Cancelled(Exception):
    pass


def test_the_host_merge_checks_the_cancel_between_layers(tmp_path):
    path = tmp_path / "host.safetensors"
    write_lora("tiny", 4, path, "kohya", rank=4, groups=("host",), dtype="F32")
    plan = plan_loras([LoraUse(str(path))], tiny_table())
    keys = plan.keys("host")
    assert len(keys) > 3
    merged = []
    real = plan.merged
    plan.merged = lambda key, w: merged.append(key) or real(key, w)
    calls = []

    def between():
        calls.append(1)
        if len(calls) > 2:
            raise _Cancelled()
    dl = DitLora(plan, TINY, Geometry.from_resolution(128, 128), "fp32", between=between)
    base = {k: np.zeros(plan.targets[k].shape, np.float32) for k in keys}
    with pytest.raises(_Cancelled):
        dl.host_weights(base)
    assert merged == keys[:2]                                          # stopped at the third layer, not after all


def test_a_stage_context_answers_cancel_checks_without_serving():
    from stages.base import Interrupted, StageContext
    proc = SimpleNamespace(config=None, stage="scheduler", stopping=False, cancelled={"job-1"})
    ctx = StageContext(proc)                        # no serve_pending: a helper thread must not answer requests
    ctx.interrupted("job-2")
    with pytest.raises(Interrupted, match="job-1 was cancelled"):
        ctx.interrupted("job-1")


# -- item 6: the daemon reads and hashes LoRAs off its own thread -----------------------------------------------------
def test_the_jobs_lora_hashes_are_made_while_the_daemon_serves(tmp_path, monkeypatch):
    import orchestrator.engine.plan.checks as flow_mod
    from orchestrator.engine.plan.run import PlanRunner
    path = tmp_path / "s.safetensors"
    write_lora("tiny", 6, path, "kohya", rank=2, groups=("blocks",))
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    want = hashlib.sha256(raw[8 + n:]).hexdigest()[:12]              # A1111's: the data after the header
    served = threading.Event()
    real = flow_mod.lora_short_hash

    def slow_hash(p):
        assert served.wait(5.0), "the daemon did not serve while the LoRA was hashed"
        return real(p)
    monkeypatch.setattr(flow_mod, "lora_short_hash", slow_hash)
    use = LoraUse(str(path), 1.0, None, "s.safetensors")
    pool = ThreadPoolExecutor(1)
    flow = object.__new__(PlanRunner)
    flow.spec = SimpleNamespace(loras=[LoraChoice(name="s.safetensors")])
    flow.pack = SimpleNamespace(size=(128, 128), lora_rank=8)
    flow.lora_hashes, flow.report = {}, SimpleNamespace(loras=[])
    flow.control = SimpleNamespace(check_cancel=lambda: None)
    flow.d = SimpleNamespace(loras=SimpleNamespace(check=lambda *a: ([use], [{"layers": {"branch": 1}}]), told=str),
                             lora_pool=pool, pump=lambda timeout_s: served.set())
    try:
        flow._check_loras()
    finally:
        pool.shutdown()
    assert flow.lora_hashes == {"s.safetensors": want}
    assert flow.report.loras[0]["short_hash"] == want


def _submit(prompt: dict, base) -> object:
    from protocol import messages as m
    if "prompt_json" in getattr(m.Submit, "__struct_fields__", ()):
        return m.Submit(prompt_json=json.dumps(prompt), base_dir=str(base))
    from protocol.prompt import PromptFile
    return m.Submit(prompt=PromptFile.from_data(prompt), base_dir=str(base))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, pipeline_assets):
    from tests.inproc import daemon_with_loras
    with daemon_with_loras(tmp_path_factory.mktemp("lora_hardening"), pipeline_assets, lambda loras: write_lora(
            "tiny", 42, loras / "te.safetensors", "comfy", rank=4, groups=("te",))) as got:
        yield got


def test_a_submits_lora_check_runs_off_the_daemons_thread(daemon, monkeypatch):
    from orchestrator.engine.daemon import DEFERRED
    from protocol import messages as m
    d, root = daemon
    gate = threading.Event()
    real = d.loras.check
    monkeypatch.setattr(d.loras, "check", lambda *a, **k: (gate.wait(10.0), real(*a, **k))[1])
    msg = _submit({"prompt": "1girl", "seed": 1, "steps": 2, "loras": [{"name": "te.safetensors"}]}, root)
    assert d.handle(msg, defer=True) is DEFERRED
    assert isinstance(d.handle(m.Status()), m.Jobs)                    # served while the LoRA is read
    assert d.handle(msg, defer=True) is DEFERRED                       # a resend: answered with the first
    replies = []
    monkeypatch.setattr(d, "server", SimpleNamespace(reply=lambda req, reply: replies.append((req, reply))))
    d._pending[msg.id].req = "envelope"
    d._answer_checked()
    assert replies == []
    gate.set()
    deadline = time.monotonic() + 10.0
    while not replies and time.monotonic() < deadline:
        d._answer_checked()
        time.sleep(0.02)
    (req, reply), = replies
    assert req == "envelope" and isinstance(reply, m.Submitted), reply
    assert d.handle(msg, defer=True).job == reply.job                  # and a later resend: the same job
    bad = _submit({"prompt": "1girl", "seed": 1, "steps": 2, "loras": [{"name": "nope.safetensors"}]}, root)
    refused = d.handle(bad)                                            # called directly: waited for
    assert isinstance(refused, m.Error) and refused.field == "loras[0].name", refused


# -- item 8: names ----------------------------------------------------------------------------------------------------
def test_names_too_long_link_loops_and_links_out_are_refused_in_loras_terms(tmp_path):
    loras = tmp_path / "loras"
    (loras / "sub").mkdir(parents=True)
    write_lora("tiny", 1, loras / "ok.safetensors", "kohya", rank=2, groups=("blocks",))
    (tmp_path / "secret.safetensors").write_bytes(b"x")
    (loras / "out.safetensors").symlink_to(tmp_path / "secret.safetensors")
    (loras / "loop.safetensors").symlink_to(loras / "loop.safetensors")
    (loras / "sub" / "a.safetensors").symlink_to(loras / "sub" / "b.safetensors")
    (loras / "sub" / "b.safetensors").symlink_to(loras / "sub" / "a.safetensors")
    (loras / "in.safetensors").symlink_to(loras / "ok.safetensors")   # a link inside loras/ is a LoRA like any
    assert list_loras(tmp_path) == ["in.safetensors", "ok.safetensors"]
    for name, words in (("a" * 250, "too long a file name"), ("loop.safetensors", "a symbolic link loop"),
                        ("sub/a.safetensors", "a symbolic link loop"),
                        ("out.safetensors", "a link that leads outside loras/"),
                        ("nope", "no such file in loras/; there are: in.safetensors, ok.safetensors")):
        with pytest.raises(ModelsDirError) as e:
            lora_path(tmp_path, name)
        assert words in str(e.value), (name, str(e.value))
        assert str(tmp_path) not in str(e.value), str(e.value)          # neither the server's folders nor targets
    assert lora_path(tmp_path, "in") == (loras / "ok.safetensors").resolve()


def test_file_errors_name_the_lora_under_loras_not_the_servers_path(tmp_path):
    from orchestrator.engine.loras import LoraRefused, RunLoras
    (tmp_path / "loras" / "sub").mkdir(parents=True)
    cut = tmp_path / "loras" / "sub" / "cut.safetensors"
    write_lora("tiny", 1, cut, "kohya", rank=2, groups=("blocks",))
    cut.write_bytes(cut.read_bytes()[:300])
    rl = RunLoras(SimpleNamespace(models_dir=tmp_path), {})
    with pytest.raises(LoraRefused) as e:
        rl.check([LoraChoice(name="sub/cut.safetensors")], (128, 128), 8)
    assert e.value.field == "loras[0]"
    assert "loras/sub/cut.safetensors" in e.value.detail and str(tmp_path) not in e.value.detail, e.value.detail
    assert lora_relative(tmp_path, f"{tmp_path}/loras/x.safetensors: bad") == "loras/x.safetensors: bad"


def test_a_cancel_while_the_starting_jobs_loras_are_read_is_left_to_its_flow(daemon):
    """The flow serves clients while it reads the job's LoRAs, before the job is marked running: a CANCEL then must
    not cancel the job under the flow (whose next transition, to encoding, then failed and ended the daemon)."""
    from protocol import messages as m
    d, root = daemon
    sub = d.handle(_submit({"prompt": "1girl", "seed": 2, "steps": 2}, root))
    assert isinstance(sub, m.Submitted), sub
    d.current = SimpleNamespace(job=SimpleNamespace(id=sub.job))        # what PlanRunner.run sets first
    try:
        ok = d.handle(m.Cancel(job=sub.job))
    finally:
        d.current = None
    assert isinstance(ok, m.Ok) and "being cancelled" in ok.note, ok
    assert d.store.get(sub.job).state == "queued" and sub.job in d.cancel_requests
    d.store.transition(sub.job, "cancelled", "cancelled by the user")  # what the flow's Cancelled does
    d.cancel_requests.discard(sub.job)
