"""Issue 30, the set-up as a new user meets it: a bundle built again for another size, LoRAs through the bundle path,
a pipeline.toml edited under running stages, and the command line's own words (help, start command, info, hints)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from models.setup.bundle import BUNDLE_JSON, read_bundle
from models.commands.cli import main as models_main
from orchestrator.terminal import cli

SIZE, MORE = "64x64", "64x80"
RANK = 4


def _bundle(models: Path, out: Path, *extra: str) -> int:
    return models_main(["bundle", "--models", str(models), "--target", "none", "--out", str(out), *extra])


@pytest.fixture(scope="module")
def lora_bundle(tmp_path_factory, tiny_bundle) -> Path:
    """A LoRA-ready CPU bundle (`bundle --lora-rank 4`) at 64x64; read-only (copy it with hard links)."""
    out = tmp_path_factory.mktemp("setup_bundle") / "bundle"
    assert _bundle(tiny_bundle, out, "--resolution", SIZE, "--lora-rank", str(RANK)) == 0
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def _part_folders(b: Path) -> set:
    return {p.name for p in b.iterdir() if p.is_dir() and p.name.split("-")[0] in ("dit", "vae")}


def _listed_folders(b: Path) -> set:
    data = json.loads((b / BUNDLE_JSON).read_text())
    return {part["path"] for size in data["sizes"].values() for part in size.values()}


# ---- item 15: a bundle built again for another size -----------------------------------------------------------------

def test_another_size_is_added_to_the_bundle_not_swapped_for_it(lora_bundle, tiny_bundle, tmp_path, capsys,
                                                                 monkeypatch):
    """Reported: `bundle --resolution 512x512 --out B` on a 256x256 bundle dropped 256x256 from bundle.json while its
    folders stayed (and were rsynced). Now the earlier size stays listed; --overwrite removes its folders. Issue 44:
    the added size silently became the default (listed first), and the closing hint named a checkout's `run`: the
    earlier default stays first, and the hint names a run folder beside the bundle ($ANIMA_RUN when set)."""
    monkeypatch.delenv("ANIMA_RUN", raising=False)
    b = _copy(lora_bundle, tmp_path / "b")
    assert _bundle(tiny_bundle, b, "--resolution", MORE, "--lora-rank", str(RANK)) == 0
    said = capsys.readouterr()
    assert f"keeping {SIZE}" in said.err
    # item 20: a CPU bundle is used where it was built, not copied to a board
    assert "rsync" not in said.out and f"init --bundle {b}" in said.out and f"LoRA rank {RANK}" in said.out
    assert _listed_folders(b) == _part_folders(b) == {f"dit-{SIZE}", f"vae-{SIZE}", f"dit-{MORE}", f"vae-{MORE}"}
    assert list(read_bundle(b).sizes) == [(64, 64), (64, 80)]       # each listed part checks out, the default first
    run = tmp_path / "run"
    assert f"orchestrator --run {run} init --bundle {b} && orchestrator --run {run} doctor" in said.out
    # --overwrite: only the size asked for is left, folders and listing alike
    assert _bundle(tiny_bundle, b, "--resolution", MORE, "--lora-rank", str(RANK), "--overwrite") == 0
    assert f"removed {SIZE}" in capsys.readouterr().err
    assert _listed_folders(b) == _part_folders(b) == {f"dit-{MORE}", f"vae-{MORE}"}
    assert list(read_bundle(b).sizes) == [(64, 80)]


# ---- item 17: LoRAs through the bundle path ------------------------------------------------------------------------

def test_a_lora_ready_bundle_takes_a_lora_without_hand_edits(lora_bundle, tmp_path, capsys):
    """Reported: no LoRA from a bundle without hand edits (no --lora-rank, no models folder in the run folder,
    `init --bundle --models` refused). Now `bundle --lora-rank R` makes LoRA-ready DiT packs, `init --bundle` sets
    models_dir to the run folder's models/ and makes its loras/, and a LoRA put there is queued as it is."""
    from models.lora.synth import write_lora
    from models.packs.pack import load_pack
    from orchestrator.engine.daemon import Daemon
    from orchestrator.engine.runfolder import RunFolder
    from protocol import messages as m
    from protocol.prompt import PromptFile
    from stages.config import load_config
    assert load_pack(lora_bundle / f"dit-{SIZE}").geometry.lora_rank == RANK
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--bundle", str(lora_bundle), "--quick"]) == 0
    assert f"made {run.resolve() / 'models' / 'loras'}" in capsys.readouterr().out
    cfg = load_config(run / "pipeline.toml")
    assert cfg.models_dir == run.resolve() / "models" and (cfg.models_dir / "loras").is_dir()
    write_lora("tiny", 3, cfg.models_dir / "loras" / "style.safetensors", "kohya", rank=RANK, groups=("blocks",))
    d = Daemon(cfg, RunFolder.resolve(run))
    try:
        prompt = {"prompt": "1girl", "seed": 1, "steps": 2, "width": 64, "height": 64,
                  "loras": [{"name": "style", "strength": 0.5}]}
        reply = d.handle(m.Submit(prompt=PromptFile.from_data(prompt), base_dir=str(tmp_path)))
        assert isinstance(reply, m.Submitted), reply
        assert [x["name"] for x in d.store.get(reply.job).spec["loras"]] == ["style"]
    finally:
        d.close()
        d.ctx.term()
    # the user's own models folder for LoRAs: --models with --bundle is taken, its loras/ made
    mine = tmp_path / "mine"
    mine.mkdir()
    assert cli.main(["--run", str(tmp_path / "run2"), "init", "--bundle", str(lora_bundle), "--quick",
                     "--models", str(mine)]) == 0
    assert load_config(tmp_path / "run2" / "pipeline.toml").models_dir == mine.resolve()
    assert (mine / "loras").is_dir()


def test_no_models_folder_names_the_setting():
    from models.setup.models_dir import ModelsDirError, lora_path
    with pytest.raises(ModelsDirError, match="set models_dir in pipeline.toml"):
        lora_path(None, "style")


# ---- item 20: the command line's own words --------------------------------------------------------------------------

def test_positional_arguments_have_names_and_help(capsys):
    """Reported: status/cancel/resume/logs/restart showed bare `job` and `stage` without a word of help."""
    from orchestrator.engine.runfolder import PROGRAMS
    for command, metavar in (("status", "JOB"), ("cancel", "JOB"), ("resume", "JOB"), ("logs", "PROGRAM"),
                             ("restart", "PROGRAM")):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        section = text.split("positional arguments:")[1].split("options:")[0]
        name, _, words = section.strip().partition(" ")
        assert name == metavar and words.strip(), (command, section)
        if metavar == "PROGRAM":
            assert all(p in " ".join(section.split()) for p in PROGRAMS)


def test_generate_with_the_daemon_gone_fails_fast_naming_the_start_command(tmp_path, capsys):
    """Reported: with supervisord down `generate` waited 11 s (a request's retries against a socket file the stopped
    daemon left) and did not say how to start it."""
    import socket
    import time
    from orchestrator.engine.runfolder import init_run
    rf = init_run(tmp_path / "run")
    rf.daemon_sock.parent.mkdir(parents=True, exist_ok=True)
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(rf.daemon_sock))                  # bound, then closed without unlinking: what a killed daemon leaves
    left.close()
    t0 = time.monotonic()
    rc = cli.main(["--run", str(rf.root), "generate", "1girl", "--steps", "2"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 1 and took < 3.0, (rc, took, err)
    assert f"supervisord -c {rf.supervisord_conf}" in err and "not running" in err and "Traceback" not in err


def test_info_on_a_lora_tells_layout_rank_and_targets(tmp_path, capsys):
    """Reported: `anima-models info` on a LoRA said 'unknown'."""
    from models.lora.synth import write_lora
    for layout, rank, groups in (("kohya", 6, ("blocks", "te")), ("comfy", 3, ("blocks",))):
        path = tmp_path / f"{layout}.safetensors"
        modules = write_lora("tiny", 5, path, layout, rank=rank, groups=groups)
        assert models_main(["info", str(path)]) == 0
        out = capsys.readouterr().out
        assert f"kind: LoRA ({layout} layout), {modules} modules" in out and f"rank: {rank}," in out
        assert "unknown" not in out and ("text encoder x" in out) == ("te" in groups)
        assert "DiT x" in out and "self_attn, cross_attn, mlp" in out


# ---- item 18: pipeline.toml edited under running stages -------------------------------------------------------------

def _submit(d, base: Path):
    from protocol import messages as m
    from protocol.prompt import PromptFile
    prompt = {"prompt": "1girl", "seed": 1, "steps": 2, "width": 64, "height": 64}
    return d.handle(m.Submit(prompt=PromptFile.from_data(prompt), base_dir=str(base)))


def test_a_job_is_refused_while_a_stage_runs_an_older_config(lora_bundle, tmp_path, capsys):
    """Reported: after an edit of pipeline.toml, `orchestrator restart orchestrator` accepted the next job, which then
    failed halfway on the scheduler's and executor's stale settings. Now a stage records what it started with, and
    the daemon refuses a job while a running stage's settings differ from the file's, naming the stage, the setting
    and the restart; a change the stage does not use, or a restarted stage, lets jobs through."""
    from orchestrator.engine.daemon import Daemon
    from orchestrator.engine.runfolder import RunFolder
    from protocol import messages as m
    from stages.config import load_config
    from stages.config_digest import record_path, record_start
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--bundle", str(lora_bundle), "--quick"]) == 0
    toml = run / "pipeline.toml"
    for stage in ("scheduler", "executor"):
        record_start(load_config(toml), stage)                 # as stage_main does, for this (live) process
    original = toml.read_text()
    cases = ((original.replace("[stage.http]\n", "[stage.http]\nport = 9999\n"), None),        # not the stages'
             (original + "\n[stage.scheduler]\nbranch_timeout_s = 300.0\n", "stage.scheduler.branch_timeout_s"),
             (original.replace('run_dir = "."\n', 'run_dir = "."\nthreads = 1\n'), "threads"))
    for text, changed in cases:
        toml.write_text(text)
        cfg = load_config(toml)
        d = Daemon(cfg, RunFolder.resolve(run))
        try:
            queued = len(d.store.pending())
            reply = _submit(d, tmp_path)
            if changed is None:
                assert isinstance(reply, m.Submitted), reply
                continue
            assert isinstance(reply, m.Error) and changed in reply.message, reply
            assert "restart them first: orchestrator reload (it restarts scheduler" in reply.message
            assert len(d.store.pending()) == queued
            if changed == "threads":                           # a top-level key: every stage runs with it
                assert "restarts scheduler and executor)" in reply.message
            record_start(cfg, "scheduler")                     # the scheduler restarted on the file
            record_start(cfg, "executor")
            assert isinstance(_submit(d, tmp_path), m.Submitted)
        finally:
            d.close()
            d.ctx.term()
    assert json.loads(record_path(cfg, "scheduler").read_text())["pid"] == os.getpid()


def test_a_started_stage_records_the_config_it_took(lora_bundle, tmp_path):
    """The record the check above reads is written by the stage process itself (stage_main), with its pid."""
    import subprocess
    import sys
    import time
    from stages.config import load_config
    from stages.config_digest import digest, effective_settings, record_path, stale_settings
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--bundle", str(lora_bundle), "--quick"]) == 0
    cfg = load_config(run / "pipeline.toml")
    path = record_path(cfg, "executor")
    proc = subprocess.Popen([sys.executable, "-m", "stages.executor", "--config", str(run / "pipeline.toml")],
                            cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not path.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        rec = json.loads(path.read_text())
        assert rec["pid"] == proc.pid and rec["digest"] == digest(effective_settings(cfg, "executor"))
        assert stale_settings(cfg, "executor") == []
        (run / "pipeline.toml").write_text((run / "pipeline.toml").read_text() + "\n[stage.scheduler]\n"
                                           "branch_timeout_s = 300.0\n")       # not the executor's table
        assert stale_settings(load_config(run / "pipeline.toml"), "executor") == []
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert stale_settings(cfg, "executor") == []       # its process gone: a new one reads the file as it is


def test_another_programs_endpoint_or_key_leaves_a_stage_current(tmp_path):
    """A remote VAE added to pipeline.toml (its endpoint, its server key, the client key to call it) asked for a
    scheduler and executor restart although neither talks to the VAE; the scheduler's own peer's endpoint does."""
    from stages.config import parse_config
    from stages.config_digest import effective_settings
    toml = tmp_path / "pipeline.toml"
    base = parse_config({"run_dir": str(tmp_path)}, toml)
    vae = parse_config({"run_dir": str(tmp_path), "endpoints": {"vae": "tcp://10.0.0.9:5600"}}, toml)
    executor = parse_config({"run_dir": str(tmp_path), "endpoints": {"executor": "tcp://10.0.0.9:5601"}}, toml)
    for stage in ("scheduler", "executor"):
        assert effective_settings(vae, stage) == effective_settings(base, stage)
    assert effective_settings(executor, "scheduler") != effective_settings(base, "scheduler")
    assert effective_settings(executor, "executor") != effective_settings(base, "executor")


def test_a_record_of_another_rule_is_not_taken_for_a_stale_stage(tmp_path):
    """A stage started by code that recorded other keys (an upgrade while it ran) made every job refused, naming
    settings nobody had changed: a record of another rule tells nothing, so it asks for no restart."""
    import json
    import os

    from stages.config import parse_config
    from stages.config_digest import RULE, record_path, record_start, stale_settings
    cfg = parse_config({"run_dir": str(tmp_path)}, tmp_path / "pipeline.toml")
    record_start(cfg, "scheduler")
    assert stale_settings(cfg, "scheduler") == []
    path = record_path(cfg, "scheduler")
    rec = json.loads(path.read_text())
    assert rec["rule"] == RULE and rec["pid"] == os.getpid()
    rec["settings"]["endpoints.encoder"] = "ipc:///elsewhere"           # what an older rule kept
    rec["digest"] = "0" * 64
    path.write_text(json.dumps(rec))
    assert stale_settings(cfg, "scheduler") == ["endpoints.encoder"]   # the same rule: a real difference
    path.write_text(json.dumps({**rec, "rule": RULE - 1}))
    assert stale_settings(cfg, "scheduler") == []


class _Restarts:
    """supervisord for `orchestrator reload`, in this process: a restarted stage records the file as it is now (as
    stage_main does), a restarted orchestrator is a new Daemon on the file (as `orchestrator serve` is)."""

    def __init__(self, run: Path):
        self.run, self.restarted, self.daemon = run, [], None

    def restart(self, name: str):
        from types import SimpleNamespace

        from orchestrator.engine.daemon import Daemon
        from orchestrator.engine.runfolder import RunFolder
        from stages.config import load_config
        from stages.config_digest import record_start
        cfg = load_config(self.run / "pipeline.toml")
        if name == "orchestrator":
            self.close()
            self.daemon = Daemon(cfg, RunFolder.resolve(self.run))
        record_start(cfg, name)
        self.restarted.append(name)
        return SimpleNamespace(state="RUNNING", pid=os.getpid())

    def close(self):
        if self.daemon is not None:
            self.daemon.close()
            self.daemon.ctx.term()


def test_reload_after_adding_packs_lets_the_next_hires_and_lora_jobs_through(lora_bundle, tiny_bundle, tmp_path,
                                                                             capsys, monkeypatch):
    """Issue 44: after a pack was added, the refusal named `orchestrator restart scheduler` and `... executor`;
    after both the daemon still refused the hires pass (`has no model pack`) and a LoRA on the new LoRA-ready pack
    until `orchestrator restart orchestrator`, which nothing named. Now every stale-settings refusal names
    `orchestrator reload`, which restarts every program whose settings differ from the file, the daemon included."""
    from models.lora.synth import write_lora
    from orchestrator.engine.daemon import Daemon
    from orchestrator.engine.runfolder import RunFolder
    from protocol import messages as m
    from protocol.prompt import PromptFile
    from stages.config import load_config
    from stages.config_digest import record_start
    from tests.doubles_harness import fake_pack
    models = _copy(tiny_bundle, tmp_path / "models")
    (models / "loras").mkdir()
    write_lora("tiny", 7, models / "loras" / "style.safetensors", "kohya", rank=RANK, groups=("blocks",))
    small, ready = fake_pack(tmp_path / "small", 32, 32), lora_bundle / f"dit-{SIZE}"     # LoRA-ready, 64x64
    run = tmp_path / "run"
    assert cli.main(["--run", str(run), "init", "--pack", str(small), "--models", str(models)]) == 0
    toml = run / "pipeline.toml"
    sup = _Restarts(run)
    monkeypatch.setattr(cli, "_supervisor", lambda rf: sup)
    monkeypatch.setattr("orchestrator.engine.daemon_probe.daemon_answers", lambda rf: True)
    for name in ("scheduler", "executor", "orchestrator"):         # the pipeline running on the file as init wrote it
        sup.restart(name)
    sup.restarted.clear()

    def submit(prompt):
        return sup.daemon.handle(m.Submit(prompt=PromptFile.from_data({"prompt": "1girl", "seed": 1, "steps": 2,
                                                                       **prompt}), base_dir=str(tmp_path)))
    hires = {"width": 32, "height": 32, "hires": {"width": 64, "height": 64}}
    lora = {"width": 64, "height": 64, "loras": [{"name": "style"}]}
    try:
        assert cli.main(["--run", str(run), "init", "--add-pack", str(ready)]) == 0
        assert load_config(toml).packs == (small.resolve(), ready.resolve())
        for prompt in (hires, lora):
            reply = submit(prompt)
            assert isinstance(reply, m.Error) and "restart them first: orchestrator reload" in reply.message, reply
            assert "scheduler and executor and orchestrator" in reply.message
        capsys.readouterr()
        assert cli.main(["--run", str(run), "reload"]) == 0
        assert sup.restarted == ["scheduler", "executor", "orchestrator", "http"]
        out = capsys.readouterr().out
        assert "orchestrator RUNNING pid" in out and "(was running with other packs" in out
        for prompt in (hires, lora):
            assert isinstance(submit(prompt), m.Submitted)
        assert cli.main(["--run", str(run), "reload"]) == 0 and sup.restarted == ["scheduler", "executor",
                                                                                   "orchestrator", "http"]
        assert "nothing to reload: every program runs with" in capsys.readouterr().out
        # the VAE's packs: the daemon refuses the sizes they cannot decode, so it takes them again (the VAE stage
        # starts per job on the file as it is)
        toml.write_text(toml.read_text() + f'\n[stage.vae]\nbackend = "onnx"\nvae_pack = ["{lora_bundle}/vae-{SIZE}"]\n')
        sup.restarted.clear()
        assert cli.main(["--run", str(run), "reload"]) == 0 and sup.restarted == ["orchestrator", "http"]
        assert isinstance(submit(lora), m.Submitted)
        reply = submit({"width": 32, "height": 32})
        assert isinstance(reply, m.Error) and "32x32 has a model pack but no VAE pack" in reply.message
    finally:
        sup.close()
