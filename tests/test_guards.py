"""Guards of issue 6: a NaN branch output fails the job naming step, block, branch and pass (seen in `orchestrator
status`); a step state is not written on a short disk; a job does not start on a short disk."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from orchestrator.terminal import cli
from stages.base import RequestFailed
from stages.scheduler import check_state_room
from tests.pipeline_harness import Pipeline

Usage = namedtuple("Usage", "total used free")


def poisoned_pack(pack: Path, out: Path, branch: str = "onnx/b00_self.onnx") -> Path:
    """A copy of `pack` (files hard-linked: a symbolic link out of a pack is refused) whose `branch` has one weight
    set to NaN and a manifest vouching for it: the pack loads and checks clean, the branch's output holds NaN."""
    import onnx
    from onnx import numpy_helper
    out.mkdir(parents=True)
    (out / "onnx").mkdir()
    for p in pack.rglob("*"):
        rel = p.relative_to(pack)
        if p.is_file() and str(rel) not in ("manifest.json", branch):
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            os.link(p, out / rel)
    model = onnx.load(pack / branch)
    init = next(i for i in model.graph.initializer if len(i.dims) == 2)        # a weight matrix
    w = numpy_helper.to_array(init).copy()
    w.flat[0] = np.nan
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    onnx.save(model, out / branch)
    manifest = json.loads((pack / "manifest.json").read_text())
    data = (out / branch).read_bytes()
    for b in manifest["branches"]:
        if b["onnx"] == branch:
            b["sha256"], b["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_nan_branch_output_fails_the_job_naming_where(pipeline_assets, board_stages):
    models, pack = pipeline_assets
    bad = poisoned_pack(pack, Path(tempfile.mkdtemp(prefix="anima-nanpack-")) / "pack")
    try:
        with Pipeline.start(models, bad, extra_toml=board_stages) as p:     # the board's encoder and VAE
            job = p.submit({"prompt": "a girl", "seed": 3, "steps": 2})
            info = p.wait(job, timeout_s=600)
            assert info.state == "failed", f"{info.state}\n{p.logs()}"
            assert info.error_stage == "scheduler"
            assert "non-finite branch output at step 1, block 0, branch self, pass cond" in info.error, info.error
            # what `orchestrator status JOB` prints
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = cli.main(["--run", str(p.root), "status", job])
            assert rc == 0 and "non-finite branch output at step 1, block 0, branch self" in buf.getvalue(), \
                buf.getvalue()
            # the folder keeps what a resume needs: the contexts (denoise failed before any step state)
            assert (p.job_dir(job) / "cond.npy").exists() and (p.job_dir(job) / "uncond.npy").exists()
            assert p.leftover_segments() == [] and p.strays() == []
    finally:
        shutil.rmtree(bad.parent, ignore_errors=True)


def test_step_state_is_not_written_on_a_short_disk(tmp_path, monkeypatch):
    from models.sampling.sampler_state import SamplerState
    state = SamplerState(settings={}, step=3, latent=np.zeros((16, 64, 64), np.float32))   # 256 KiB
    check_state_room(str(tmp_path), state)                       # this disk has room
    monkeypatch.setattr("stages.scheduler.shutil.disk_usage", lambda p: Usage(10 * 2**30, 0, 8 * 2**20))
    with pytest.raises(RequestFailed) as e:
        check_state_room(str(tmp_path), state)
    assert e.value.field == "job_dir"
    assert f"only 8.0 MB free in {tmp_path}" in str(e.value) and "state of step 3 needs 16.5 MB" in str(e.value)
    assert "orchestrator resume" in str(e.value)


def test_a_job_does_not_start_on_a_short_disk(tmp_path, monkeypatch):
    """PlanRunner.run checks the job folder's disk before anything (a queued job may wait while the disk fills): the
    job fails naming the orchestrator and the folder, nothing is created (its failure record in job.json only: no
    report.json, no estimate priced for it), and it can be resumed."""
    from types import SimpleNamespace

    from orchestrator.engine.plan.run import PlanRunner
    from orchestrator.engine.jobs import JobStore
    from orchestrator.engine.prompt_spec import parse_prompt_obj
    store = JobStore(tmp_path, min_free_mb=64)
    job = store.submit(parse_prompt_obj({"prompt": "a girl", "seed": 1, "steps": 2}).to_dict())
    stopped = []
    daemon = SimpleNamespace(
        store=store, cfg=SimpleNamespace(is_remote=lambda name: False), settings=SimpleNamespace(stop_timeout_s=1.0),
        sup=SimpleNamespace(stop=lambda name, **kw: stopped.append(name)), packs={}, current=None, progress={},
        pump=lambda s: None, rf=SimpleNamespace(root=tmp_path))
    monkeypatch.setattr("orchestrator.engine.plan.checks.shutil.disk_usage", lambda p: Usage(10 * 2**30, 0, 20 * 2**20))
    priced = []
    monkeypatch.setattr("orchestrator.engine.estimate.estimate_spec", lambda *a, **kw: priced.append(a))
    PlanRunner(daemon, job).run()
    failed = store.get(job.id)
    assert failed.state == "failed" and failed.error["stage"] == "orchestrator"
    assert failed.error["message"].startswith(f"only 20 MB free in {store.job_dir(job.id)}; a job needs at least 64 MB")
    assert f"orchestrator resume {job.id}" in failed.error["message"]
    assert sorted(p.name for p in store.job_dir(job.id).iterdir()) == ["job.json"]
    assert priced == [] and failed.report is None
    assert stopped == ["encoder", "vae"]                        # nothing heavy left running
    monkeypatch.undo()
    assert store.resume(job.id).start_at == "encoding"


def test_a_job_whose_size_lost_its_pack_fails_clearly(tmp_path):
    """A queued job whose size has no pack any more (the config changed meanwhile) fails naming the sizes there are,
    instead of running on another pack."""
    from types import SimpleNamespace

    from orchestrator.engine.plan.run import PlanRunner
    from orchestrator.engine.jobs import JobStore
    from orchestrator.engine.prompt_spec import parse_prompt_obj
    store = JobStore(tmp_path, min_free_mb=0)
    spec = parse_prompt_obj({"prompt": "a girl", "seed": 1, "width": 64, "height": 32}, resolution=(64, 32))
    job = store.submit(spec.to_dict())
    daemon = SimpleNamespace(
        store=store, cfg=SimpleNamespace(is_remote=lambda name: False), settings=SimpleNamespace(stop_timeout_s=1.0),
        sup=SimpleNamespace(stop=lambda name, **kw: None), packs={(64, 64): object()}, current=None, progress={},
        pump=lambda s: None, rf=SimpleNamespace(root=tmp_path))
    PlanRunner(daemon, job).run()
    failed = store.get(job.id)
    assert failed.state == "failed" and failed.error["stage"] == "orchestrator"
    assert "no model pack for 64x32 any more" in failed.error["message"] and "64x64" in failed.error["message"]
