"""A NON-editable install (`pip install .` of the wheel into a fresh venv), used from a folder outside the checkout:
the defaults that a checkout takes from itself (run folder, toolkit venv, supervisord's working directory, the
templates) come from the current folder and the wheel's data files, never from site-packages."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple:
    """(venv, its site-packages): the wheel built from this tree, installed without its dependencies (they come from
    the test venv's site-packages through a .pth line: no network); -> the venv's bin folder too."""
    import shutil
    tmp = tmp_path_factory.mktemp("wheel")
    src, wheels = tmp / "src", tmp / "wheels"            # built from a copy: the build leaves build/ and egg-info
    # not what other tests write while this copies (a file gone mid-copy fails copytree): caches, run folders
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv*", ".git", "build", "run", "*.egg-info",
                                                             "__pycache__", ".pytest_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(src)], check=True, capture_output=True, cwd=tmp)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    wheel = next(wheels.glob("anima_npu-*.whl"))
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True,
                   capture_output=True)
    # after the install: through it, pip would see the test venv's (editable) anima-npu as installed already
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv, site


def _run(venv: Path, cwd: Path, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ANIMA_RUN", "ANIMA_RKNN_VENV")}
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_wheel_runs_outside_the_checkout(installed, tmp_path):
    venv, site = installed
    work = tmp_path / "work"
    work.mkdir()
    r = _run(venv, work, "python", "-c", "import models, orchestrator; print(models.__file__)")
    assert r.stdout.startswith(str(site)), r.stdout + r.stderr           # the wheel's copy, not this checkout
    # the labelled RKNNLite stand-in is the checkout's (tests, bench), never the wheel's: asked for, a clear refusal
    assert not (site / "models" / "runtime" / "backends" / "standin").exists()
    assert (site / "models" / "runtime" / "backends" / "rknn.py").is_file()
    r = _run(venv, work, "python", "-c", "from models.runtime.backends.rknn import lite_module; lite_module('standin')")
    assert r.returncode != 0 and "cannot import models.runtime.backends.standin.rknnlite" in r.stderr, r.stderr
    share = venv / "share" / "anima-npu"
    assert (share / "supervisord.conf").is_file() and (share / "examples" / "prompt.json").is_file()
    assert (share / "docs" / "board.md").is_file()
    assert "run/ in the current folder" in _run(venv, work, "orchestrator", "--help").stdout.replace("\n", " ")
    # the daemon is down and there is no run folder: the hint says to make one, not the unrendered template
    r = _run(venv, work, "orchestrator", "status")
    assert r.returncode != 0 and f"{work / 'run'} is not a run folder yet: orchestrator --run" in r.stderr
    assert str(share / "supervisord.conf") not in r.stderr
    # init with no --run: ./run, supervisord's directory= the run folder, an example prompt.json
    r = _run(venv, work, "orchestrator", "init")
    assert r.returncode == 0, r.stderr
    conf = (work / "run" / "supervisord.conf").read_text()
    dirs = {line.split("=", 1)[1] for line in conf.splitlines() if line.startswith("directory=")}
    assert dirs == {str(work / "run")}
    assert "site-packages" not in conf and str(venv / "bin" / "python") in conf
    assert (work / "run" / "prompt.json").read_text() == (share / "examples" / "prompt.json").read_text()
    r = _run(venv, work, "orchestrator", "status")
    assert f"supervisord -c {work / 'run' / 'supervisord.conf'}" in r.stderr
    # compile's toolkit environment: beside the venv, not inside site-packages
    r = _run(venv, work, "python", "-c", "from models.rknn.client import DEFAULT_VENV; print(DEFAULT_VENV)")
    assert r.stdout.strip() == str(venv.parent / ".venv-rknn")
