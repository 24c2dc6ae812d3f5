"""A stage whose start ended in a config exit is not spawned again while its model files are still missing
(stages/preflight.py, orchestrator/engine/stage_control.py): the job fails at once naming the file. Each job started the encoder only for it to exit for the file after its imports and
supervisord's startsecs (bench/fuzz_http.py's A1111 img2img cases: ~10 s each at load average 30)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator.engine.stage_control import StageControl, StageFailed
from stages.config import load_config
from stages.preflight import missing_files


def _config(tmp_path, text_encoder):
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text(f'threads = 1\n[stage.encoder]\ntext_encoder = "{text_encoder}"\ndit = "{tmp_path / "dit.st"}"\n'
                   f'qwen_tokenizer = "{tmp_path}"\nt5_tokenizer = "{tmp_path}"\n')
    return load_config(cfg)


def test_missing_files_names_the_file_and_sees_it_arrive(tmp_path):
    te = tmp_path / "te.safetensors"
    cfg = _config(tmp_path, te)
    (tmp_path / "dit.st").write_bytes(b"x")
    (tmp_path / "tokenizer.json").write_text("{}")     # both tokenizer folders: only looked for, not read
    why = missing_files(cfg, "encoder")
    assert str(te) in why and "no such file" in why and "encoder" in why
    te.write_bytes(b"x")                           # put in place: the next look sees it (nothing cached)
    assert missing_files(cfg, "encoder") == ""
    assert missing_files(cfg, "vae") == ""         # not looked for here: the stage says


class _Sup:
    def __init__(self):
        self.started = []

    def start(self, stage, wait=False):
        self.started.append(stage)

    def info(self, stage):
        return SimpleNamespace(live=False, pid=0, state="STOPPED")


def test_a_stage_missing_its_files_is_not_started(tmp_path):
    cfg = _config(tmp_path, "/nonexistent/fuzz/te.safetensors")
    (tmp_path / "dit.st").write_bytes(b"x")
    control = StageControl.__new__(StageControl)      # only what bring_up reads before a start
    control.cfg, control.sup, control.job = cfg, _Sup(), SimpleNamespace(id="j1")
    control.d = SimpleNamespace(config_exits={"encoder"})     # its last start ended in a config exit
    control.settings = SimpleNamespace(start_timeout_s=60.0)
    control.keep = SimpleNamespace(after_use=lambda stage: False, why="")
    control.report, control._sampling = SimpleNamespace(stage_starts={}), set()
    with pytest.raises(StageFailed) as e:
        control.bring_up("encoder")
    assert "/nonexistent/fuzz/te.safetensors" in str(e.value) and "not started" in str(e.value)
    assert control.sup.started == [] and control.report.stage_starts == {}
