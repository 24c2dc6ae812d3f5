"""Shared pytest fixtures: synthetic checkpoints written once per session."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_dit(tmp_path_factory) -> Path:
    """The tiny synthetic DiT + adapter (seed 0, prefix `net.`), written once per test session."""
    from models.synth_dit import write_dit
    path = tmp_path_factory.mktemp("tiny_dit") / "tiny-dit.safetensors"
    write_dit("tiny", 0, path, prefix="net.")
    return path


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> Path:
    """A complete synthetic tiny models folder (ComfyUI layout, seed 0), written once per session; treat as read-only."""
    from models.models_dir import write_bundle
    out = tmp_path_factory.mktemp("tiny_bundle")
    write_bundle("tiny", 0, out)
    return out
