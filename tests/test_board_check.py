"""`make board-check` as CI runs it: a fresh board venv (pip install '.[board]', no torch), the host's assets, the
tiny job through supervisord from the board venv with encoder and VAE on ONNX Runtime; the last line is the contract.
~2 minutes (most of it the venv), so it is marked slow (still run by make test)."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAST_LINE = re.compile(r"^board-check ok torch=absent job_s=\d+\.\d venv_mb=\d+$")
VAE_ON_ONNX = importlib.util.find_spec("models.commands.pack_vae") is not None


@pytest.mark.slow
def test_board_check(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(BOARD_VENV=str(tmp_path / "venv-board"), BOARD_ASSETS=str(tmp_path / "assets"),
               HOST_VENV=str(Path(sys.executable).parents[1]))
    r = subprocess.run(["bash", str(ROOT / "scripts" / "board_check.sh")], capture_output=True, text=True, env=env,
                       timeout=1500)
    out = r.stdout + r.stderr
    assert "board venv ready" in r.stdout and "assets ready" in r.stdout, out[-4000:]
    if VAE_ON_ONNX:
        assert r.returncode == 0, out[-6000:]
        assert LAST_LINE.match(r.stdout.strip().splitlines()[-1]), out[-3000:]
    else:   # a tree without the VAE's ONNX backend: everything up to the job, and a clear refusal
        assert r.returncode != 0 and "board-check: no VAE on ONNX Runtime" in out, out[-4000:]


def _python310() -> str:
    """A Python 3.10 that runs (pyenv's shim named python3.10 may not: it defers to the global version)."""
    for p in (os.environ.get("PY310"), "/root/.pyenv/versions/3.10.13/bin/python", shutil.which("python3.10")):
        if p and subprocess.run([p, "-c", "import sys; assert sys.version_info[:2] == (3, 10)"],
                                capture_output=True).returncode == 0:
            return p
    raise AssertionError("no Python 3.10 interpreter (set PY310): the board images' Python cannot be checked")


@pytest.mark.slow
def test_py310_check(tmp_path):
    """make py310-check: a '.[board]' venv on Python 3.10 (tomli, no torch) runs the config/prompt/protocol tests from
    the installed package."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PY310=_python310(), PY310_VENV=str(tmp_path / "venv-py310"))
    r = subprocess.run(["bash", str(ROOT / "scripts" / "py310_check.sh")], capture_output=True, text=True, env=env,
                       timeout=1500)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-5000:]
    assert re.search(r"python 3\.10\.\d+: tomli in place of tomllib, no torch; stages\.config from \S+site-packages",
                     r.stdout), out[-3000:]
    # 3 deselected: the two host-only tests and the stand-in's (scripts/py310_check.sh says which)
    assert re.search(r"^\d+ passed, 3 deselected", r.stdout.strip().splitlines()[-1]), out[-3000:]
