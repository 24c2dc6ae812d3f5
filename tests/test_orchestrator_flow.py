"""The job daemon end to end under a real supervisord with the real supervisord.conf, stage logics replaced by the
test doubles of tests/orch_doubles.py: encoder/VAE started and stopped per job (teardown read from supervisord),
progress, report, PNG metadata, cancel/resume, a SIGKILLed scheduler, a crashing encoder, no leaked /dev/shm."""
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from orchestrator.terminal import cli
from protocol.arena import list_segments, run_prefix
from tests.doubles_harness import Doubles
from tests.signals import kill_program, signal_process

DOUBLES = Path(__file__).resolve().parent / "orch_doubles.py"


@pytest.fixture(scope="module")
def _pipeline():
    """One supervisord + daemon for the module (start-up and shutdown cost seconds on 2 cores). Its folder is our own
    (not pytest's basetemp, which a concurrent pytest session may prune while supervisord still uses it). No timing.png
    (tests/test_daily_use.py checks the one the real pipeline draws)."""
    d = Doubles.start(Path(tempfile.mkdtemp(prefix="anima-orch-")), sample_interval_s=0.05)   # samples in 0.2 s phases
    try:
        yield d.rf, d.sup
    finally:
        d.stop()


@pytest.fixture
def pipeline(_pipeline):
    """Per test: default double behaviour, an idle queue, and no segment left behind."""
    rf, sup = _pipeline
    for flag in ("double_step_s", "double_encoder_crash", "double_encode_s", "double_encoding", "double_start_crashes"):
        (rf.root / flag).unlink(missing_ok=True)
    yield rf, sup
    assert list_segments(run_prefix(rf.root)) == [], "a shared-memory segment outlived the job"


def _prompt(tmp_path, **kw) -> Path:
    f = tmp_path / "prompt.json"
    f.write_text(json.dumps({"prompt": "a girl", "negative_prompt": "bad", "seed": 3, "steps": 4, **kw}))
    return f


def _status(rf, job, capsys):
    """The job's status, or None while the daemon does not answer (it may be restarting)."""
    capsys.readouterr()
    rc = cli.main(["--run", str(rf.root), "status", job, "--json"])
    out = capsys.readouterr().out
    return json.loads(out)[0] if rc == 0 else None


def _wait_state(rf, job, capsys, states, timeout_s=60, pred=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = _status(rf, job, capsys)
        if info is not None and info["state"] in states and (pred is None or pred(info)):
            return info
        time.sleep(0.1)
    raise AssertionError(f"job {job} never reached {states}: {info}")


def test_job_runs_with_encoder_and_vae_down_while_denoising(pipeline, tmp_path, capsys):
    from PIL import Image
    rf, sup = pipeline
    out_dir = tmp_path / "images"
    out_dir.mkdir()
    rc = cli.main(["--run", str(rf.root), "submit", str(_prompt(tmp_path, output=str(out_dir))), "--wait", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)                  # exactly one JSON object on stdout
    assert set(result) == {"job", "image", "report", "images"}
    assert result["image"] == str(out_dir / f"{result['job']}.png") and result["images"] == [result["image"]]
    report = json.loads(Path(result["report"]).read_text())
    td = report["teardown"]
    assert td["encoder_running_during_denoise"] is False and td["vae_running_during_denoise"] is False
    assert td["samples"] >= 3
    assert report["computed_steps"] == [1, 2, 3, 4] and report["branch_calls"] == 12
    assert set(report["branches"]) == {"self", "cross", "ffn"}
    assert report["branches"]["self"]["calls"] == 4
    for stage in ("encoder", "scheduler", "vae"):
        assert report["stages"][stage]["wall_s"] > 0
        assert report["stages"][stage]["peak_rss_mb"] > 10
    # the memory trace and phases the timing plot draws
    assert [p[0] for p in report["phases"]] == ["encoding", "denoising", "decoding"]
    for (_, a0, a1), (_, b0, b1) in zip(report["phases"], report["phases"][1:]):
        assert a0 <= a1 <= b0 <= b1
    series = report["memory"]["series"]
    assert {"encoder", "scheduler", "executor", "vae"} <= set(series)
    enc_phase, vae_phase = report["phases"][0], report["phases"][2]
    # a look may catch the encoder early in its start, before its imports (~9 MB): the trace's peak shows it loaded
    assert all(enc_phase[1] - 0.5 <= t <= enc_phase[2] + 0.5 and mb > 0 for t, mb in series["encoder"])
    assert max(mb for _, mb in series["encoder"]) > 10
    assert all(vae_phase[1] - 0.5 <= t <= vae_phase[2] + 0.5 for t, _ in series["vae"])
    infos = sup.all_info()
    assert infos["encoder"].state == "STOPPED" and infos["vae"].state == "STOPPED"
    img = Image.open(result["image"])
    assert img.size == (64, 64)
    assert "Seed: 3" in img.text["parameters"] and json.loads(img.text["anima"])["negative_prompt"] == "bad"
    assert img.getpixel((0, 0))[0] == (6 + 3 % 7)          # len("a girl") + seed % 7: the flow carried the data


def _with_startsecs(conf: str, programs, secs: int) -> str:
    """supervisord.conf with `startsecs=` of each of `programs` set to `secs`."""
    for name in programs:
        at = conf.index("startsecs=", conf.index(f"[program:{name}]"))
        conf = conf[:at] + f"startsecs={secs}" + conf[conf.index("\n", at):]
    return conf


def test_a_stage_is_used_once_ready_not_after_supervisords_startsecs(pipeline, tmp_path, capsys):
    """READY is the sign a stage serves: the job does not wait for supervisord to call the encoder and the VAE
    RUNNING (startsecs, 30 s here, 1 s as shipped: a second per start whenever a stage loads sooner), and a stage
    stopped while supervisord still says STARTING ends STOPPED, not BACKOFF or FATAL."""
    rf, sup = pipeline
    conf = rf.supervisord_conf.read_text()
    rf.supervisord_conf.write_text(_with_startsecs(conf, ("encoder", "vae"), 30))
    assert set(sup.update()) == {"encoder", "vae"}
    try:
        t0 = time.monotonic()
        rc = cli.main(["--run", str(rf.root), "submit", str(_prompt(tmp_path)), "--wait"])
        took = time.monotonic() - t0
        assert rc == 0, capsys.readouterr().err
        assert took < 20, f"the job waited for startsecs: {took:.1f} s"
        infos = sup.all_info()
        assert infos["encoder"].state == "STOPPED" and infos["vae"].state == "STOPPED"
    finally:
        rf.supervisord_conf.write_text(conf)
        sup.update()


def test_teardown_record_sees_a_live_encoder(pipeline, tmp_path, capsys):
    """The record is read from supervisord, not assumed: start the encoder by hand during denoising."""
    rf, sup = pipeline
    (rf.root / "double_step_s").write_text("0.3")
    assert cli.main(["--run", str(rf.root), "submit", str(_prompt(tmp_path, steps=8))]) == 0
    job = capsys.readouterr().out.strip()
    _wait_state(rf, job, capsys, ("denoising",), pred=lambda i: i["progress"] is not None)
    sup.start("encoder")
    time.sleep(0.5)
    sup.stop("encoder")
    info = _wait_state(rf, job, capsys, ("done",))
    report = json.loads(Path(info["report"]).read_text())
    assert report["teardown"]["encoder_running_during_denoise"] is True
    assert report["teardown"]["vae_running_during_denoise"] is False


def test_scheduler_sigkill_mid_job_resumes(pipeline, tmp_path, capsys):
    rf, sup = pipeline
    (rf.root / "double_step_s").write_text("0.3")
    assert cli.main(["--run", str(rf.root), "submit", str(_prompt(tmp_path, steps=10))]) == 0
    job = capsys.readouterr().out.strip()
    _wait_state(rf, job, capsys, ("denoising",), pred=lambda i: (i["progress"] or {}).get("step", 0) >= 3)
    kill_program(sup, "scheduler")
    info = _wait_state(rf, job, capsys, ("done", "failed"), timeout_s=90)
    assert info["state"] == "done", info
    report = json.loads(Path(info["report"]).read_text())
    assert report["resumed_from"] >= 2 and report["computed_steps"] == list(range(1, 11))


def test_cancel_then_resume(pipeline, tmp_path, capsys):
    rf, sup = pipeline
    (rf.root / "double_step_s").write_text("0.3")
    assert cli.main(["--run", str(rf.root), "submit", str(_prompt(tmp_path, steps=10))]) == 0
    job = capsys.readouterr().out.strip()
    _wait_state(rf, job, capsys, ("denoising",), pred=lambda i: (i["progress"] or {}).get("step", 0) >= 2)
    assert cli.main(["--run", str(rf.root), "cancel", job]) == 0
    _wait_state(rf, job, capsys, ("cancelled",))
    (rf.root / "double_step_s").write_text("0.02")
    assert cli.main(["--run", str(rf.root), "resume", job]) == 0
    info = _wait_state(rf, job, capsys, ("done", "failed"), timeout_s=60)
    assert info["state"] == "done", info


def test_encoder_sigkill_mid_encode_is_retried(pipeline, tmp_path, capsys):
    rf, sup = pipeline
    (rf.root / "double_encode_s").write_text("30")
    assert cli.main(["--run", str(rf.root), "submit", str(_prompt(tmp_path))]) == 0
    job = capsys.readouterr().out.strip()
    deadline = time.monotonic() + 60
    while not (rf.root / "double_encoding").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int((rf.root / "double_encoding").read_text())
    signal_process(pid)                                   # supervisord restarts it; the flow asks again
    info = _wait_state(rf, job, capsys, ("done", "failed"), timeout_s=90)
    assert info["state"] == "done", info
    attempts = json.loads((rf.jobs / job / "job.json").read_text())["attempts"]
    assert attempts["encoding"] == 1                       # retried inside the stage, not re-queued
    assert sup.info("encoder").state == "STOPPED"


def test_crashing_encoder_fails_the_job_with_a_clear_reason(pipeline, tmp_path, capsys):
    rf, sup = pipeline
    (rf.root / "double_encoder_crash").write_text("1")
    rc = cli.main(["--run", str(rf.root), "submit", str(_prompt(tmp_path)), "--wait"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "failed: encoder:" in err and "double encoder told to crash" in err
    assert sup.info("encoder").state in ("STOPPED", "EXITED", "FATAL")
    job = err.split()[1]
    assert cli.main(["--run", str(rf.root), "status", job]) == 0
    assert "encoder" in capsys.readouterr().out
    assert cli.main(["--run", str(rf.root), "logs", "encoder"]) == 0          # through supervisord's tail
    assert "double encoder told to crash" in capsys.readouterr().out
    assert cli.main(["--run", str(rf.root), "stages"]) == 0
    listing = capsys.readouterr().out
    assert all(p in listing for p in ("encoder", "scheduler", "executor", "vae", "orchestrator"))
    assert "RUNNING" in listing


def test_an_encoder_that_dies_while_starting_until_fatal_is_started_again(pipeline, tmp_path, capsys):
    """Four quick deaths: the first start and supervisord's three retries (startretries) end FATAL; the job starts it
    once more (START_ATTEMPTS) and goes on."""
    rf, sup = pipeline
    (rf.root / "double_start_crashes").write_text("4")
    rc = cli.main(["--run", str(rf.root), "submit", str(_prompt(tmp_path)), "--wait"])
    assert rc == 0, capsys.readouterr().err
    assert (rf.root / "double_start_crashes").read_text() == "0"
    log = (rf.logs / "orchestrator.log").read_text()
    assert "encoder ended while starting (Exited too quickly" in log and "again (2/3)" in log, log[-2000:]


def test_orchestrator_sigkill_mid_denoise_resumes_the_job(pipeline, tmp_path, capsys):
    rf, sup = pipeline
    (rf.root / "double_step_s").write_text("0.3")
    assert cli.main(["--run", str(rf.root), "submit", str(_prompt(tmp_path, steps=10))]) == 0
    job = capsys.readouterr().out.strip()
    _wait_state(rf, job, capsys, ("denoising",), pred=lambda i: (i["progress"] or {}).get("step", 0) >= 2)
    old = kill_program(sup, "orchestrator")               # supervisord restarts it; the queue is on disk
    info = _wait_state(rf, job, capsys, ("done", "failed"), timeout_s=90)
    assert info["state"] == "done", info
    assert sup.info("orchestrator").pid != old
    history = json.loads((rf.jobs / job / "job.json").read_text())["history"]
    assert [h[0] for h in history].count("denoising") == 1   # resumed in place, not restarted from the queue
    assert json.loads(Path(info["report"]).read_text())["computed_steps"] == list(range(1, 11))


def test_remote_vae_over_curve_is_used_not_started(pipeline, tmp_path, capsys):
    """A tcp VAE (here a second process on loopback, as on another machine): never started through supervisord,
    latent sent inline, PNG returned inline, CURVE keys from `orchestrator keys generate`. Runs last: it swaps the
    daemon's config and restores it."""
    rf, sup = pipeline
    keys = rf.root / "keys"
    for name in ("client", "vae"):
        assert cli.main(["--run", str(rf.root), "keys", "generate", "--dir", str(keys), "--name", name]) == 0
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    remote = Path(tempfile.mkdtemp(prefix="anima-rvae-"))
    remote.chmod(0o700)
    (remote / "remote.toml").write_text(
        f'run_dir = "{remote}"\n[endpoints]\nvae = "tcp://127.0.0.1:{port}"\n'
        f'[security]\nserver_key = "{keys}/vae.key_secret"\nallowed_clients = ["{keys}/client.key"]\n')
    vae = subprocess.Popen([sys.executable, str(DOUBLES), "vae", "--config", str(remote / "remote.toml")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    original = rf.pipeline_toml.read_text()
    vae_start = sup.info("vae").start
    try:
        rf.pipeline_toml.write_text(original + f'[endpoints]\nvae = "tcp://127.0.0.1:{port}"\n'
                                    f'[security]\nclient_key = "{keys}/client.key_secret"\n'
                                    f'[security.servers]\nvae = "{keys}/vae.key"\n')
        sup.restart("orchestrator")
        deadline = time.monotonic() + 30
        while not rf.daemon_sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        capsys.readouterr()
        rc = cli.main(["--run", str(rf.root), "submit", str(_prompt(tmp_path)), "--wait", "--json"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        result = json.loads(out.out)
        report = json.loads(Path(result["report"]).read_text())
        assert report["teardown"]["vae_remote"] is True and report["stages"]["vae"]["remote"] is True
        assert report["teardown"]["vae_running_during_denoise"] is False
        assert sup.info("vae").start == vae_start               # supervisord's VAE was never started
        from PIL import Image
        assert json.loads(Image.open(result["image"]).text["anima"])["seed"] == 3
        assert cli.main(["--run", str(rf.root), "restart", "vae"]) == 2
        assert "is remote" in capsys.readouterr().err
    finally:
        vae.terminate()
        vae.wait(timeout=20)
        rf.pipeline_toml.write_text(original)
        sup.restart("orchestrator")
        shutil.rmtree(remote, ignore_errors=True)
