"""`make demo` (orchestrator/terminal/demo.py): the whole path on the embedded tiny model through supervisord, and a
supervisord that is still shutting down (right after `supervisorctl shutdown`) waited for, not raced."""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from orchestrator.terminal import demo
from orchestrator.engine.supervisor import Supervisor, SupervisorError
from tests.doubles_harness import Doubles

SLOW_STOP_S = 4.0
# a program that takes SLOW_STOP_S to stop: supervisord's shutdown lasts that long, answering "shutting down"
SLOW_STOP_CODE = ("import signal, sys, time; "
                  f"signal.signal(signal.SIGTERM, lambda *a: (time.sleep({SLOW_STOP_S}), sys.exit(0))); time.sleep(10**6)")
SLOW_STOP = f"""
[program:slowstop]
command={sys.executable} -c "{SLOW_STOP_CODE}"
autostart=true
stopwaitsecs=30
priority=1
"""


def test_demo_waits_for_a_supervisord_that_is_shutting_down(capsys):
    """`make demo` right after `supervisorctl shutdown` failed: "Another program is already listening on a port that
    one of our HTTP servers is configured to use" (shutdown returns before supervisord has gone, and a shutting-down
    supervisord refuses every call). The demo waits for it to exit, then starts it again."""
    root = Path(tempfile.mkdtemp(prefix="anima-demo-"))
    d = Doubles.start(root, extra_conf=SLOW_STOP)
    sup = Supervisor(d.rf.supervisor_sock)
    try:
        d.sup.wait_state("slowstop", ("RUNNING",), 60)
        old = sup._call("supervisor.getPID")
        sup.shutdown()
        assert demo.ensure_supervisord(d.rf) is True                 # started anew, its daemon answering
        assert "is shutting down: waiting for it to exit" in capsys.readouterr().err
        assert d.proc.poll() is not None                              # the old supervisord has exited
        assert sup._call("supervisor.getPID") != old and sup.info("orchestrator").state == "RUNNING"
    finally:
        try:
            sup.shutdown()
            sup.wait_gone()
        except SupervisorError:
            pass
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_make_demo_with_stop_reuses_the_running_supervisord_then_stops_it(pipeline_assets, board_stages, capsys):
    """`make demo` run again with --stop (python -m orchestrator.terminal.demo, a subprocess) on a demo folder whose
    supervisord is up (made and started as the demo's first run leaves it: prepare_models, prepare_run,
    ensure_supervisord): the running supervisord reused, the job run, then shut down and gone, nothing of the run left
    (processes, shared memory). The folder's pipeline.toml is edited by hand as the suite's pipelines are (one CPU
    thread a stage, the board's ONNX encoder and VAE: board_stages), an edit the demo keeps: the subject is
    supervisord's reuse and stop, not the torch stages' start (~6-11 CPU-s each on 2 cores). The demo's first run as
    `make demo` runs it, on the config it writes (supervisord started, the torch stages' job followed, its output,
    supervisord left up) is tests/test_cookbook.py's, on the folder the cookbook's commands then use."""
    import json
    import os
    import subprocess

    import psutil
    from PIL import Image

    from protocol.arena import list_segments, run_prefix
    models, _ = pipeline_assets
    root = Path(tempfile.mkdtemp(prefix="anima-demo-"))
    try:
        bundle = root / "bundle"                                     # the session's tiny models as hard links (the
        shutil.copytree(models, bundle / "models", copy_function=os.link)     # demo adds its LoRA to its copy)
        run = root / "run"
        demo_models, packs = demo.prepare_models(bundle, (128, 128))
        rf, changed = demo.prepare_run(run, demo_models, packs, 0)
        text = rf.pipeline_toml.read_text()
        first_table = text.index("\n[") + 1                          # a top-level key goes before the first table
        rf.pipeline_toml.write_text(f"{text[:first_table]}threads = 1\n{text[first_table:]}\n{board_stages}")
        assert demo.ensure_supervisord(rf, changed) is True          # started: up as after the demo's first run
        assert Supervisor(rf.supervisor_sock).ping() == "RUNNING"
        prompt = root / "prompt.json"
        prompt.write_text(json.dumps({"prompt": "1girl, demo", "seed": 3, "steps": 2, "spectrum": False}))
        cmd = [sys.executable, "-m", "orchestrator.terminal.demo", "--run", str(run), "--bundle", str(bundle),
               "--resolution", "128x128", "--prompt", str(prompt), "--port", "0", "--stop"]
        again = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ})
        assert again.returncode == 0, again.stderr[-3000:]
        assert "4) supervisord is already running" in again.stderr and "supervisord stopped" in again.stderr
        assert "the pipeline config changed" not in again.stderr     # the hand edit kept: nothing restarted
        out = dict(line.split(":  ", 1) if ":  " in line else line.split(": ", 1) for line in again.stdout.splitlines())
        assert Image.open(Path(out["image"].strip())).size == (128, 128)
        with pytest.raises(SupervisorError):
            Supervisor(rf.supervisor_sock).ping()                    # gone, not shutting down
        left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or ())]
        assert left == [] and list_segments(run_prefix(run)) == []
    finally:
        try:
            Supervisor(root / "run" / "supervisor.sock").shutdown()
        except SupervisorError:
            pass
        shutil.rmtree(root, ignore_errors=True)


def test_the_demo_takes_a_free_port_when_comfyuis_is_taken(tmp_path, capsys):
    """Reported: with ComfyUI on 8188, `make demo` exited 0 while its front had EXITED, and nothing named
    `[stage.http] port`. The demo's config now gives the front any free port when 8188 is taken (the demo prints the
    URL the front took); a port the file sets, and a free 8188, are left alone."""
    import socket
    from stages.config import load_config
    from tests.doubles_harness import fake_pack
    pack, models = fake_pack(tmp_path / "pack", 64, 64), tmp_path / "models"
    models.mkdir()
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            holder.bind(("127.0.0.1", 8188))
            holder.listen(1)
        except OSError:
            pass                                  # something here holds it already: taken either way
        rf, changed = demo.prepare_run(tmp_path / "run", models, [pack])
        assert changed and "port 8188 is taken" in capsys.readouterr().err
        assert load_config(rf.pipeline_toml).stage_settings("http")["port"] == 0
        rf, changed = demo.prepare_run(tmp_path / "run", models, [pack])      # the same demo again: nothing changes
        assert not changed and load_config(rf.pipeline_toml).stage_settings("http")["port"] == 0
    finally:
        holder.close()
    text = demo._http_port_for_demo("[stage.http]\nport = 9000\n")
    assert text == "[stage.http]\nport = 9000\n"


def test_a_demo_folder_that_gained_packs_is_still_the_demos(tmp_path, capsys):
    """Issue 44: after packs were added to the demo's run folder, `make demo` refused it (`... is not the demo's`) or
    rewrote pipeline.toml without them. A folder whose default pack and models are the demo's is the demo's: the
    packs added with `init --add-pack` (or `init --force` with more packs) stay."""
    from orchestrator.terminal import cli
    from stages.config import load_config
    from tests.doubles_harness import fake_pack
    pack, more, models = fake_pack(tmp_path / "pack", 64, 64), fake_pack(tmp_path / "more", 32, 32), tmp_path / "m"
    models.mkdir()
    run = tmp_path / "run"
    rf, _ = demo.prepare_run(run, models, [pack])
    assert cli.main(["--run", str(run), "init", "--add-pack", str(more)]) == 0
    text = rf.pipeline_toml.read_text()
    rf, changed = demo.prepare_run(run, models, [pack])
    assert not changed and rf.pipeline_toml.read_text() == text
    assert load_config(rf.pipeline_toml).packs == (pack.resolve(), more.resolve())
    assert cli.main(["--run", str(run), "init", "--force", "--pack", str(pack), "--pack", str(more),
                     "--models", str(models)]) == 0            # the demo's mark gone: still the demo's folder
    rf, changed = demo.prepare_run(run, models, [pack])
    assert not changed and load_config(rf.pipeline_toml).packs == (pack.resolve(), more.resolve())


def test_the_demo_makes_every_readme_size_and_a_lora(tmp_path, capsys):
    """Issue 44: the demo had one plain 256x256 pack and no LoRA, so the README's own `generate ... -W 512 -H 512`,
    its `--hires 1.5` and any LoRA were refused on the demo's folder. Its packs are now 256, 384 and 512 (the
    default first), all LoRA-ready, and its models folder has a LoRA in loras/ written by `anima-models synth lora`
    (the file equal to the one that command writes)."""
    from models.commands.cli import main as models_main
    from models.packs.pack import load_pack
    assert demo.demo_sizes(demo.DEFAULT_RESOLUTION) == [(256, 256), (384, 384), (512, 512)]
    assert demo.demo_sizes((200, 120)) == [(200, 120), (296, 176), (400, 240)]     # each side a multiple of 8
    models = tmp_path / "bundle" / "models"
    models.mkdir(parents=True)
    lora = demo.write_demo_lora(models)
    assert lora == models / "loras" / "demo-style.safetensors"
    assert models_main(["synth", "lora", *demo.DEMO_LORA_ARGS, "--out", str(tmp_path / "cli.safetensors")]) == 0
    assert lora.read_bytes() == (tmp_path / "cli.safetensors").read_bytes()
    assert "anima-models synth lora --preset tiny" in capsys.readouterr().err
    demo.write_demo_lora(models)                                         # kept: nothing said, nothing written
    assert capsys.readouterr().err == ""
    _, packs = demo.prepare_models(tmp_path / "bundle", (64, 64))       # tiny sizes: a few seconds
    assert [p.name for p in packs] == ["pack-64x64-lora8", "pack-96x96-lora8", "pack-128x128-lora8"]
    assert [load_pack(p).geometry.lora_rank for p in packs] == [demo.LORA_RANK] * 3


def test_make_demo_port_sets_the_fronts_port_and_keeps_the_rest(tmp_path, capsys):
    """`make demo PORT=8190` (the demo's --port): [stage.http] port in the demo's pipeline.toml, the line replaced
    when there, every other line kept; the same port again changes nothing (no restart); a bad port is exit 2."""
    import subprocess
    from stages.config import load_config
    from tests.doubles_harness import fake_pack
    dry = subprocess.run(["make", "-n", "demo", "PORT=8190", "STAMP="], cwd=demo.REPO_DIR, capture_output=True,
                         text=True, timeout=60)
    assert "-m orchestrator.terminal.demo --run" in dry.stdout and "--port 8190" in dry.stdout, dry.stdout + dry.stderr
    pack, models = fake_pack(tmp_path / "pack", 64, 64), tmp_path / "models"
    models.mkdir()
    rf, changed = demo.prepare_run(tmp_path / "run", models, [pack], 8190)
    assert changed and load_config(rf.pipeline_toml).stage_settings("http")["port"] == 8190
    text = rf.pipeline_toml.read_text().replace("port = 8190", "port = 8190   # mine") + "# a note of mine\n"
    rf.pipeline_toml.write_text(text)
    rf, changed = demo.prepare_run(tmp_path / "run", models, [pack])            # no --port: the file's is kept
    assert not changed and rf.pipeline_toml.read_text() == text
    rf, changed = demo.prepare_run(tmp_path / "run", models, [pack], 8191)
    assert changed and rf.pipeline_toml.read_text() == text.replace("port = 8190   # mine", "port = 8191")
    with pytest.raises(SystemExit) as e:
        demo.main(["--run", str(tmp_path / "run"), "--port", "70000"])
    assert e.value.code == 2 and "--port" in capsys.readouterr().err


def test_an_older_demo_folder_gets_the_sizes_it_lacks_as_an_edit(tmp_path):
    """A demo folder whose default pack is the demo's but that lacks some of its sizes (made before they were
    added) gets them added as `init --add-pack` does: its hand edits stay, and the config counts as changed (a
    running pipeline is restarted to see them)."""
    from stages.config import load_config
    from tests.doubles_harness import fake_pack
    pack, more, models = fake_pack(tmp_path / "pack", 64, 64), fake_pack(tmp_path / "more", 96, 96), tmp_path / "m"
    models.mkdir()
    rf, _ = demo.prepare_run(tmp_path / "run", models, [pack])
    edited = rf.pipeline_toml.read_text() + "[stage.scheduler]\nbranch_timeout_s = 77\n"
    rf.pipeline_toml.write_text(edited)
    rf, changed = demo.prepare_run(tmp_path / "run", models, [pack, more])
    cfg = load_config(rf.pipeline_toml)
    assert changed and cfg.packs == (pack.resolve(), more.resolve())
    assert cfg.stage_settings("scheduler")["branch_timeout_s"] == 77
    mine = fake_pack(tmp_path / "mine", 128, 128)              # a size the user added a pack of by hand: kept,
    text = rf.pipeline_toml.read_text().replace("packs = [", f'packs = ["{mine}", ')     # the demo's not added
    rf.pipeline_toml.write_text(text)
    rf, changed = demo.prepare_run(tmp_path / "run", models, [pack, more, fake_pack(tmp_path / "d128", 128, 128)])
    assert not changed and rf.pipeline_toml.read_text() == text
    assert demo._with_http_port("a = 1\n[stage.http]  # the front\nhost = \"x\"\n[stage.vae]\nport = 3\n", 9) == \
        "a = 1\n[stage.http]  # the front\nport = 9\nhost = \"x\"\n[stage.vae]\nport = 3\n"
