"""Fail before the work: a pack or runtime problem stops a stage at its start (exit 2, the cause in the job's error,
not retried), and a size with a DiT pack but no VAE pack is refused at submit, never after the denoise."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol import messages as m
from protocol.prompt import PromptFile
from stages.base import EXIT_CONFIG

ROOT = Path(__file__).resolve().parents[1]


def _stage(stage: str, config: Path, env=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in ("SUPERVISOR_ENABLED",)}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", f"stages.{stage}", "--config", str(config)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_encoder_without_its_pack_folder_exits_2_naming_it(tmp_path):
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text(f'run_dir = "{tmp_path}"\n[stage.encoder]\nbackend = "onnx"\npack = "packs/encoder"\n')
    r = _stage("encoder", cfg)
    assert r.returncode == EXIT_CONFIG, r.stderr              # 1 would have supervisord start it again, in vain
    assert f"stage.encoder.pack: {tmp_path / 'packs' / 'encoder'}: no such encoder pack folder" in r.stderr
    assert "Traceback" not in r.stderr


def test_rknn_backend_without_rknnlite_is_refused_at_start(tmp_path, pipeline_assets):
    """Refused at its start, so a job never spends its encode before the first branch finds the runtime absent."""
    _, pack = pipeline_assets
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text(f'run_dir = "{tmp_path}"\npack_dir = "{pack}"\nbackend = "rknn"\n')
    r = _stage("executor", cfg, env={"ANIMA_RKNN_STANDIN": "0"})
    assert r.returncode == EXIT_CONFIG, r.stderr
    assert "backend = 'rknn': rknn backend: cannot import rknnlite.api" in r.stderr
    assert "install rknn-toolkit-lite2 and librknnrt.so" in r.stderr


def test_a_size_without_a_vae_pack_is_refused_at_submit(tmp_path, tiny_bundle):
    from models.vae.pack import build_vae_pack
    from orchestrator.engine.daemon import Daemon
    from orchestrator.engine.runfolder import init_run
    from stages.config import load_config
    from tests.doubles_harness import fake_pack
    a, b = fake_pack(tmp_path / "a", 64, 64), fake_pack(tmp_path / "b", 64, 32)
    vae = build_vae_pack(next((tiny_bundle / "vae").glob("*.safetensors")), tmp_path / "vae64", (64, 64), threads=1)
    rf = init_run(tmp_path / "run", packs=[a, b])
    rf.pipeline_toml.write_text(rf.pipeline_toml.read_text() + f'\n[stage.vae]\nbackend = "onnx"\nvae_pack = '
                                                               f'["{vae}"]\n')
    d = Daemon(load_config(rf.pipeline_toml), rf, supervisor=object())
    try:
        def submit(w, h):
            return d.handle(m.Submit(prompt=PromptFile.from_data({"prompt": "a", "width": w, "height": h}),
                                     base_dir=str(tmp_path)))
        assert isinstance(submit(64, 64), m.Submitted)
        bad = submit(64, 32)
        assert isinstance(bad, m.Error) and bad.field == "width"
        assert "64x32 has a model pack but no VAE pack (stage.vae.vae_pack has: 64x64)" in bad.message
        assert len(d.store.list()) == 1                        # nothing queued for it
    finally:
        d.ctx.term()


def test_a_hires_job_is_checked_at_each_size_its_plan_decodes(tmp_path, tiny_bundle):
    """The latent hires path decodes only the second pass's size, the pixel path the first pass's too: a job is
    refused at submit for a size it decodes without a VAE pack, and not for one it never decodes."""
    from models.vae.pack import build_vae_pack
    from orchestrator.engine.daemon import Daemon
    from orchestrator.engine.runfolder import init_run
    from stages.config import load_config
    from tests.doubles_harness import fake_pack
    a, b = fake_pack(tmp_path / "a", 64, 64), fake_pack(tmp_path / "b", 96, 96)
    vae = build_vae_pack(next((tiny_bundle / "vae").glob("*.safetensors")), tmp_path / "vae96", (96, 96), threads=1)
    rf = init_run(tmp_path / "run", packs=[a, b])
    rf.pipeline_toml.write_text(rf.pipeline_toml.read_text() + f'\n[stage.vae]\nbackend = "onnx"\nvae_pack = '
                                                               f'["{vae}"]\n')
    d = Daemon(load_config(rf.pipeline_toml), rf, supervisor=object())
    try:
        def submit(size, **hires):
            prompt = {"prompt": "a", "width": size, "height": size, **({"hires": hires} if hires else {})}
            return d.handle(m.Submit(prompt=PromptFile.from_data(prompt), base_dir=str(tmp_path)))
        assert isinstance(submit(64, scale=1.5, space="latent"), m.Submitted)     # 96x96 decoded, 64x64 never
        pixel = submit(64, scale=1.5, space="pixel")                              # 64x64 decoded before the scale
        assert isinstance(pixel, m.Error) and pixel.field == "width", pixel
        assert "64x64 has a model pack but no VAE pack (stage.vae.vae_pack has: 96x96)" in pixel.message
        d.vae_sizes = [(64, 64)]
        second = submit(64, scale=1.5, space="latent")
        assert isinstance(second, m.Error) and second.field == "hires", second
        assert "the second pass at 96x96 has a model pack but no VAE pack (stage.vae.vae_pack has: 64x64)" in \
            second.message
        assert len(d.store.list()) == 1
    finally:
        d.ctx.term()


@pytest.mark.slow
def test_a_stage_config_exit_fails_the_job_at_once_with_its_cause(tmp_path, pipeline_assets):
    """Through supervisord: the encoder's pack folder is missing; the job fails at its start with the encoder's own
    words and without restarts that would fail the same way (the cause is in the job's error, not only in
    encoder.log). The next job does not spawn it again while the folder is still missing (stages/preflight.py): it
    fails at once with the same words, writing nothing but its failure record (no report of a run that never was)."""
    from tests.pipeline_harness import Pipeline
    models, pack = pipeline_assets
    missing = tmp_path / "nowhere" / "encoder"
    with Pipeline.start(models, pack, extra_toml=f'[stage.encoder]\nbackend = "onnx"\npack = "{missing}"\n') as p:
        job = p.submit({"prompt": "a", "steps": 1})
        info = p.wait(job, timeout_s=240)
        assert info.state == "failed"
        assert info.error.startswith("cannot start: ") and "stage.encoder.pack: " in info.error
        assert "no such encoder pack folder" in info.error
        assert str(missing) in info.error and "not retried" in info.error
        enc = p.sup.info("encoder")
        assert enc.exitstatus == EXIT_CONFIG
        assert (p.job_dir(job) / "report.json").exists()      # a stage was started: how its start went
        second = p.submit({"prompt": "b", "steps": 1})
        again = p.wait(second, timeout_s=240)
        assert again.state == "failed" and "no such encoder pack folder" in again.error
        assert str(missing) in again.error and "not started" in again.error
        assert p.sup.info("encoder").start == enc.start, "spawned again"
        # nothing ran: its failure record (job.json) and nothing more, no report priced and written
        assert sorted(f.name for f in p.job_dir(second).iterdir()) == ["job.json"] and again.report is None


def test_the_executor_backend_under_its_table_says_it_belongs_at_the_top(tmp_path):
    """The message says where `backend` goes (an `unknown setting` list would not)."""
    from stages.config import ConfigError, load_config
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text('run_dir = "."\n[stage.executor]\nbackend = "rknn"\n')
    with pytest.raises(ConfigError, match=r'stage\.executor\.backend: the executor\'s backend is a top-level key: '
                                          r'put backend = "rknn" above every \[stage\.…\] table'):
        load_config(cfg)


def test_a_config_exit_under_supervisord_lives_past_startsecs(tmp_path):
    """Timed from before the spawn: a config exit must not come sooner than supervisord's startsecs, or supervisord
    takes it for a failed start (FATAL after retries, no exit status). psutil's create_time rounds the boot time down
    to the second, so a process looked up to a second older than it was and exited after ~0.9 s on this machine."""
    import time
    from stages.base import SUPERVISOR_STARTSECS
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SUPERVISOR_ENABLED": "1"}

    def timed(code: str) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        return r, time.monotonic() - t0
    for _ in range(3):
        r, took = timed("import sys; from stages.base import config_exit; sys.exit(config_exit())")
        assert r.returncode == EXIT_CONFIG, r.stderr
        assert took >= SUPERVISOR_STARTSECS + 0.2, took
    r, took = timed("from stages.base import _lived_s; print(_lived_s())")
    assert 0.0 <= float(r.stdout) <= took + 0.02, (r.stdout, r.stderr, took)   # never older than it is
