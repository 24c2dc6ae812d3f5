"""A job folder's arrays and records, read back only when whole: what a step wrote before a power cut or a kill is
used again only if it is all there and as expected (the rule a resume skips steps by)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from models.base.durable import atomic_write

log = logging.getLogger("orchestrator.engine.plan")


def save_npy(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda f: np.save(f, array, allow_pickle=False))


def load_npy(path: Path, shape: tuple) -> np.ndarray | None:
    """A job-folder array if it is whole and as expected (f32, `shape`, finite), else None with the reason logged:
    after a power cut a file may be empty or cut short (np.load then raises EOFError, ValueError or OSError)."""
    try:
        a = np.load(path, allow_pickle=False)
        if a.dtype != np.float32 or tuple(a.shape) != tuple(shape) or not np.isfinite(a).all():
            raise ValueError(f"{a.dtype} {list(a.shape)}, expected float32 {list(shape)} and finite")
        return a
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - whatever a torn file raises, it is unusable
        log.warning("%s is unusable: %s: %s", path, type(e).__name__, e)
        return None


def load_text(path: Path) -> dict | None:
    """A job-folder JSON object (text.json: the prompts' token counts) if whole, else None with the reason logged."""
    try:
        text = json.loads(path.read_text())
        if not isinstance(text, dict):
            raise ValueError(f"a {type(text).__name__}, not an object")
        return text
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s is unusable: %s", path, e)
        return None
