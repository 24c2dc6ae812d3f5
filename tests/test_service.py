"""`orchestrator service install|uninstall`: the systemd unit's text (parsed here, and checked by Debian's
`systemd-analyze verify`), where it is written (a temporary --root, never the real /etc), refusals, and that its
ExecStart really runs supervisord in the foreground and that SIGTERM to supervisord alone (KillMode=mixed) stops every
program. systemd itself does not run in this sandbox: no unit is started through it."""
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.terminal import cli
from orchestrator.engine.runfolder import init_run
from tests.signals import signal_group

ANALYZE = shutil.which("systemd-analyze")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as systemd reads it: [Section] headers, Key=Value lines (a key may repeat), # and ; comments."""
    out: dict = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = out.setdefault(line[1:-1], {})
            continue
        assert section is not None and "=" in line, f"not a unit line: {raw!r}"
        key, value = line.split("=", 1)
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def exec_argv(value: str) -> list[str]:
    """ExecStart's argv: systemd's double quotes and C escapes (shlex's POSIX rules agree on \\\\ and \\"), then the
    $$ and %% escapes undone."""
    return [a.replace("$$", "$").replace("%%", "%") for a in shlex.split(value)]


def verify(path: Path, *, user: bool = False, env=None) -> None:
    """systemd-analyze verify: exit 0 AND no message at all (unknown keys are only warnings with exit 0)."""
    assert ANALYZE, "systemd-analyze is needed (Debian's systemd package; `make test` installs it)"
    cmd = [ANALYZE] + (["--user"] if user else []) + ["verify", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (r.returncode, r.stdout, r.stderr)


@pytest.fixture
def run(tmp_path):
    return init_run(tmp_path / "run")


def _svc(run, *args):
    return cli.main(["--run", str(run.root), "service", *args])


def test_print_writes_nothing_and_names_everything_absolutely(run, capsys, tmp_path):
    assert _svc(run, "install", "--print", "--root", str(tmp_path / "root")) == 0
    text = capsys.readouterr().out
    assert not (tmp_path / "root").exists()
    u = parse_unit(text)
    svc = u["Service"]
    argv = exec_argv(svc["ExecStart"][0])
    assert argv == [os.path.abspath(sys.executable), "-m", "supervisor.supervisord", "--nodaemon", "--configuration",
                    str(run.supervisord_conf)]
    assert all(Path(a).is_absolute() for a in (argv[0], argv[-1], svc["WorkingDirectory"][0]))
    assert svc["Restart"] == ["on-failure"] and svc["KillMode"] == ["mixed"] and svc["Type"] == ["simple"]
    owner = pwd.getpwuid(run.root.stat().st_uid).pw_name
    assert svc["User"] == [owner]
    assert u["Install"]["WantedBy"] == ["multi-user.target"]
    assert "network-online.target" in u["Unit"]["After"]
    assert text.startswith(f"# orchestrator service install: run folder {run.root}\n")


def test_system_install_into_a_root_verifies_and_uninstalls(run, tmp_path, capsys):
    root = tmp_path / "root"
    assert _svc(run, "install", "--root", str(root)) == 0
    out = capsys.readouterr().out
    unit = root / "etc/systemd/system/anima.service"
    assert unit.is_file() and (unit.stat().st_mode & 0o777) == 0o644
    assert "enable --now anima.service" in out and "daemon-reload" in out
    verify(unit)
    # installing again for the same run folder replaces it; another run folder's unit is not taken over
    assert _svc(run, "install", "--root", str(root)) == 0
    other = init_run(tmp_path / "other")
    capsys.readouterr()
    assert cli.main(["--run", str(other.root), "service", "install", "--root", str(root)]) == 2
    assert f"is for the run folder {run.root}" in capsys.readouterr().err
    assert f"run folder {run.root}" in unit.read_text()
    # enabled (the link `systemctl enable` makes), then uninstalled: the link goes too
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir()
    (wants / "anima.service").symlink_to(unit)
    assert _svc(run, "uninstall", "--root", str(root)) == 0
    assert not unit.exists() and not (wants / "anima.service").is_symlink()
    assert "removed" in capsys.readouterr().out
    assert _svc(run, "uninstall", "--root", str(root)) == 1          # nothing left to remove
    # a unit this command did not write is not removed without --force
    unit.write_text("[Service]\nExecStart=/bin/true\n")
    assert _svc(run, "uninstall", "--root", str(root)) == 2
    assert unit.exists()
    assert _svc(run, "uninstall", "--root", str(root), "--force") == 0 and not unit.exists()


def test_user_install_goes_to_the_users_config_and_says_linger(run, tmp_path, monkeypatch, capsys):
    home, runtime = tmp_path / "home", tmp_path / "xdg-runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    assert _svc(run, "install", "--user") == 0
    out = capsys.readouterr().out
    unit = home / ".config/systemd/user/anima.service"
    assert unit.is_file() and "loginctl enable-linger" in out and "systemctl --user enable --now" in out
    u = parse_unit(unit.read_text())
    assert "User" not in u["Service"] and u["Install"]["WantedBy"] == ["default.target"]
    assert "Wants" not in u.get("Unit", {})                # no network-online.target in a user manager
    verify(unit, user=True, env={**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime)})


def test_system_unit_needs_root(run, monkeypatch, capsys):
    real = Path("/etc/systemd/system/anima-refused-test.service")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert _svc(run, "install", "--name", "anima-refused-test") == 1
    err = capsys.readouterr().err
    assert "needs root" in err and "sudo" in err and "--user" in err and "--print" in err
    assert not real.exists()
    assert _svc(run, "install", "--name", "anima-refused-test", "--print") == 0     # printing needs nothing


def test_bad_input_is_named(tmp_path, capsys):
    assert cli.main(["--run", str(tmp_path / "none"), "service", "install", "--print"]) == 2
    assert "orchestrator --run" in capsys.readouterr().err and not (tmp_path / "none").exists()
    run = init_run(tmp_path / "run")
    assert cli.main(["--run", str(run.root), "service", "install", "--print", "--name", "a/b"]) == 2
    assert "--name 'a/b'" in capsys.readouterr().err


def test_odd_paths_are_quoted_as_systemd_reads_them(tmp_path, capsys):
    run = init_run(tmp_path / 'a b%c "d" $e')
    root = tmp_path / "root"
    assert cli.main(["--run", str(run.root), "service", "install", "--root", str(root)]) == 0
    unit = root / "etc/systemd/system/anima.service"
    verify(unit)
    svc = parse_unit(unit.read_text())["Service"]
    assert exec_argv(svc["ExecStart"][0])[-1] == str(run.supervisord_conf)
    assert svc["WorkingDirectory"][0].replace("%%", "%") == str(run.root)


def test_exec_start_runs_supervisord_and_sigterm_stops_everything(run, tmp_path, capsys):
    """What systemd would do with the unit: run ExecStart in WorkingDirectory, later SIGTERM the main process only."""
    assert _svc(run, "install", "--print") == 0
    svc = parse_unit(capsys.readouterr().out)["Service"]
    proc = subprocess.Popen(exec_argv(svc["ExecStart"][0]), cwd=svc["WorkingDirectory"][0].replace("%%", "%"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        from orchestrator.engine.supervisor import Supervisor, SupervisorError
        deadline = time.monotonic() + 60
        children = []
        while time.monotonic() < deadline and not children:
            assert proc.poll() is None, "supervisord left the foreground (it must stay there for systemd)"
            if run.supervisor_sock.exists():
                try:
                    infos = Supervisor(run.supervisor_sock, timeout_s=2.0).all_info()
                    children = [i.pid for i in infos.values() if i.pid]
                except SupervisorError:
                    pass
            time.sleep(0.2)
        assert children, "no program started"
        proc.send_signal(signal.SIGTERM)                # KillMode=mixed: the main process alone
        assert proc.wait(timeout=90) == 0
        gone, alive = psutil.wait_procs([p for p in map(_proc, children) if p], timeout=10)
        assert not alive, f"left running after supervisord stopped: {alive}"
    finally:
        if proc.poll() is None:
            signal_group(proc.pid)
            proc.wait()


def _proc(pid):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def test_values_systemd_would_read_differently_are_refused(tmp_path, capsys):
    """A run folder ending in a backslash made WorkingDirectory= continue into the next line (systemd-analyze: "Service
    has no ExecStart="); trailing blanks are stripped from a value by systemd. Such a path is refused, named."""
    for name in ("run\\", "run ", " run\\\\"):
        run = init_run(tmp_path / name)
        root = tmp_path / "root"
        assert cli.main(["--run", str(run.root), "service", "install", "--print"]) == 2, name
        err = capsys.readouterr().err
        assert repr(str(run.root)) in err and "systemd" in err, err
        assert cli.main(["--run", str(run.root), "service", "install", "--root", str(root)]) == 2
        capsys.readouterr()
        assert not (root / "etc/systemd/system/anima.service").exists()
