"""Where this copy of the project lives: a source checkout (pyproject.toml beside the packages: `pip install -e`, or
PYTHONPATH) keeps its run folder, its rknn-toolkit2 environment and its templates in the checkout; an installed
copy (`pip install .`, the packages in site-packages) has no folder of its own to write in, so those defaults come
from the current folder and the environment instead, and the templates from the wheel's data files."""
from __future__ import annotations

import sys
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[2]
SOURCE_TREE = (REPO_DIR / "pyproject.toml").is_file()
# the wheel's data files (pyproject.toml: tool.setuptools.data-files): supervisord.conf, examples/, docs/
SHARE_DIR = Path(sys.prefix) / "share" / "anima-npu"


def project_file(rel: str) -> Path:
    """A file of the project (supervisord.conf, examples/prompt.json, docs/board.md): the checkout's, else the
    installed copy's; the checkout's path when neither exists (for the message that says so)."""
    for p in (REPO_DIR / rel, SHARE_DIR / rel):
        if p.is_file():
            return p
    return REPO_DIR / rel


def default_run_dir() -> Path:
    """A source checkout's run/, else run/ in the current folder."""
    return REPO_DIR / "run" if SOURCE_TREE else Path.cwd() / "run"


def default_toolkit_venv() -> Path:
    """The rknn-toolkit2 environment: the checkout's .venv-rknn, else .venv-rknn beside the environment this
    interpreter runs in (python -m venv .venv && ... puts it next to .venv)."""
    return REPO_DIR / ".venv-rknn" if SOURCE_TREE else Path(sys.prefix).parent / ".venv-rknn"
