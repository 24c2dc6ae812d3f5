"""Start at boot: a systemd unit that runs supervisord (in the foreground) for one run folder.

    orchestrator service install [--user] [--print] [--name anima] [--root DIR] [--force]
    orchestrator service uninstall [--user] [--name anima] [--root DIR] [--force]

The unit runs `PYTHON -m supervisor.supervisord --nodaemon --configuration RUN/supervisord.conf` with absolute paths
and this virtual environment's interpreter (its supervisor package, its stages). systemd is the one supervisor of
supervisord: `Restart=on-failure` brings it back; `KillMode=mixed` sends SIGTERM to supervisord alone, which stops
its programs in order (each within its `stopwaitsecs`), and only what is left after `TimeoutStopSec` is SIGKILLed.

A system unit (/etc/systemd/system, root only) runs as the owner of the run folder: the folder is 0700, so nobody
else could use its sockets. A user unit (--user, ~/.config/systemd/user) runs in that user's manager, which starts at
boot only with lingering on (`loginctl enable-linger USER`). `--root DIR` writes below DIR instead of / (as
`systemctl --root` does), for packaging and tests. Nothing here runs systemctl: the commands to enable the unit are
printed (docs/service.md).
"""
from __future__ import annotations

import os
import pwd
import grp
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from models.base.durable import atomic_write
from orchestrator.engine.runfolder import RunFolder

SYSTEM_DIR = Path("etc/systemd/system")          # below / (or --root)
MARK = "# orchestrator service install: run folder "
NAME_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.@-]{0,200}\Z")
STOP_TIMEOUT_S = 120     # supervisord stops the programs one priority group after another (stopwaitsecs 15-30 each)
RESTART_S = 5


class ServiceError(Exception):
    """A message that is the whole answer; `code` is the exit status (2: bad input, 1: refused)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Target:
    """Where a unit goes and for whom."""

    user_unit: bool
    root: Path                  # "/" normally; --root DIR
    name: str                   # unit name without ".service"

    @property
    def unit_dir(self) -> Path:
        if not self.user_unit:
            return self.root / SYSTEM_DIR
        base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        return self.root / Path(os.path.abspath(base)).relative_to("/") / "systemd" / "user"

    @property
    def unit_file(self) -> Path:
        return self.unit_dir / f"{self.name}.service"

    @property
    def systemctl(self) -> str:
        if self.user_unit:
            return "systemctl --user"
        return "systemctl" if os.geteuid() == 0 else "sudo systemctl"


def target(name: str, *, user_unit: bool, root: str | None) -> Target:
    name = name[:-len(".service")] if name.endswith(".service") else name
    if not NAME_RE.match(name):
        raise ServiceError(f"--name {name!r}: a unit name is letters, digits and _ . @ - (like anima)")
    return Target(user_unit, Path(os.path.abspath(root)) if root else Path("/"), name)


# ---------------------------------------------------------------- the unit text


def _check_text(what: str, value: str) -> str:
    """A value for unquoted settings (WorkingDirectory=, Description=, the first comment): systemd joins a line that
    ends in a backslash with the next one and strips blanks around a value, and these settings have no quoting."""
    if any(c in value for c in "\n\r\x00"):
        raise ServiceError(f"{what} {value!r} holds a line break or NUL, which a unit file cannot carry")
    if value.endswith("\\") or value != value.strip():
        raise ServiceError(f"{what} {value!r} ends in a backslash or a blank, which systemd would read as another path "
                           "(a backslash continues the line, blanks are stripped); rename it")
    return value


def _spec(value: str) -> str:
    """systemd expands %-specifiers in most settings: a literal % is %%."""
    return value.replace("%", "%%")


def _arg(value: str) -> str:
    """One ExecStart argument: %-specifiers and $-variables escaped (%%, $$), then double-quoted with C escapes when
    it has blanks, quotes, backslashes or a semicolon (systemd.service, "Command lines")."""
    value = _spec(value).replace("$", "$$")
    if value and not re.search(r'[\s"\'\\;$]', value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def interpreter() -> str:
    """This environment's interpreter as invoked (a venv's bin/python: NOT resolved, the link is the venv)."""
    return os.path.abspath(sys.executable)


def run_owner(rf: RunFolder) -> tuple[str, str]:
    """(user, group) owning the run folder: the one account that can use its 0700 sockets."""
    st = rf.root.stat()
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        raise ServiceError(f"run folder {rf.root} belongs to uid {st.st_uid}, which has no account name") from None
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return user, group


def unit_text(rf: RunFolder, t: Target, *, python: str | None = None) -> str:
    """The unit for run folder `rf` (which must exist, with its supervisord.conf)."""
    conf = rf.supervisord_conf
    if not rf.root.is_dir() or not conf.exists():
        raise ServiceError(f"no run folder with a supervisord.conf at {rf.root}: create it first "
                           f"(orchestrator --run {rf.root} init --pack ... --models ...)")
    python = _check_text("interpreter", python or interpreter())
    root, conf = _check_text("run folder", str(rf.root)), _check_text("supervisord config", str(conf))
    lines = [
        f"{MARK}{root}",
        "# Enable: docs/service.md. Remove: orchestrator service uninstall" + (" --user" if t.user_unit else ""),
        "[Unit]",
        f"Description=Anima pipeline: supervisord for {_spec(root)}",
    ]
    if not t.user_unit:      # remote stages (tcp) need the network; the user manager has no network-online.target
        lines += ["Wants=network-online.target", "After=network-online.target"]
    lines += ["", "[Service]", "Type=simple"]
    if not t.user_unit:
        user, group = run_owner(rf)
        lines += [f"User={user}", f"Group={group}"]
    lines += [
        f"WorkingDirectory={_spec(root)}",
        "ExecStart=" + " ".join(_arg(a) for a in (python, "-m", "supervisor.supervisord", "--nodaemon",
                                                  "--configuration", conf)),
        "KillMode=mixed",
        f"TimeoutStopSec={STOP_TIMEOUT_S}",
        "Restart=on-failure",
        f"RestartSec={RESTART_S}",
        "UMask=0077",
        "",
        "[Install]",
        f"WantedBy={'default.target' if t.user_unit else 'multi-user.target'}",
    ]
    return "\n".join(lines) + "\n"


def written_for(path: Path) -> str | None:
    """The run folder a unit file was written for by this command, or None (not ours / unreadable)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline().rstrip("\n")
    except OSError:
        return None
    return first[len(MARK):] if first.startswith(MARK) else None


# ---------------------------------------------------------------- install / uninstall


def _may_write(t: Target) -> None:
    if t.user_unit or str(t.root) != "/" or os.geteuid() == 0:
        return
    raise ServiceError(f"writing {t.unit_file} needs root. Run it with sudo "
                       f"(sudo {interpreter()} -m orchestrator.terminal.cli --run RUN service install), install a user unit "
                       "instead (--user), or only show the unit (--print)", code=1)


def install(rf: RunFolder, t: Target, *, force: bool = False) -> tuple[Path, list[str]]:
    """Write the unit; -> (its path, the commands that enable it). A unit of another run folder (or one this command
    did not write) is replaced only with `force`."""
    text = unit_text(rf, t)
    _may_write(t)
    if t.unit_file.exists() or t.unit_file.is_symlink():
        theirs = written_for(t.unit_file)
        if theirs != str(rf.root) and not force:
            what = f"the run folder {theirs}" if theirs else "something else (not written by this command)"
            raise ServiceError(f"{t.unit_file} exists and is for {what}; choose another --name, or --force to "
                               "replace it")
    t.unit_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(t.unit_file, text, mode=0o644)
    steps = [f"{t.systemctl} daemon-reload", f"{t.systemctl} enable --now {t.name}.service"]
    if t.user_unit:
        steps.append(f"loginctl enable-linger {pwd.getpwuid(os.geteuid()).pw_name}   # start it at boot, "
                     "without a login")
    steps.append(f"{t.systemctl} status {t.name}.service   # journalctl{' --user' if t.user_unit else ''} "
                 f"-u {t.name}.service for its output")
    return t.unit_file, steps


def uninstall(t: Target, *, force: bool = False) -> tuple[list[Path], list[str]]:
    """Remove the unit and its enablement links (what `systemctl disable` removes). -> (removed paths, commands)."""
    _may_write(t)
    if not (t.unit_file.exists() or t.unit_file.is_symlink()):
        raise ServiceError(f"no unit {t.unit_file} to remove", code=1)
    if written_for(t.unit_file) is None and not force:
        raise ServiceError(f"{t.unit_file} was not written by `orchestrator service install`; remove it yourself, or "
                           "use --force")
    removed = []
    for wants in sorted(t.unit_dir.glob("*.wants")):
        link = wants / t.unit_file.name
        if link.is_symlink():
            link.unlink()
            removed.append(link)
    t.unit_file.unlink()
    removed.append(t.unit_file)
    steps = [f"{t.systemctl} stop {t.name}.service   # if it still runs", f"{t.systemctl} daemon-reload"]
    return removed, steps
