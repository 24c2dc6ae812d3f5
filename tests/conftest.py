"""Shared pytest fixtures: synthetic checkpoints written once per session."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_dit(tmp_path_factory) -> Path:
    """The tiny synthetic DiT + adapter (seed 0, prefix `net.`), written once per test session."""
    from models.dit.synth import write_dit
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


@pytest.fixture(scope="session")
def rknn_venv() -> Path:
    """The rknn-toolkit2 environment (.venv-rknn), created by scripts/rknn_venv.sh when missing (~2 min, idempotent)."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    venv = root / ".venv-rknn"
    if not (venv / ".rknn-installed").is_file():
        subprocess.run(["bash", str(root / "scripts" / "rknn_venv.sh"), str(venv)], check=True)
    return venv


@pytest.fixture(scope="session")
def rknn_pack(tmp_path_factory, tiny_dit, rknn_venv):
    """The tiny pack at 128x128 (64 image tokens, FP16) with blocks 0 and 27 compiled by the real rknn-toolkit2
    (6 branches, 2 jobs); -> (pack folder, compile report). Treat as read-only (copy it to change it)."""
    from models.packs.pack import build_pack
    from models.rknn.compile import compile_pack
    pack = build_pack(tiny_dit, tmp_path_factory.mktemp("rknn") / "pack128", (128, 128), "fp16")
    report = compile_pack(pack, target="rk3588", jobs=2, venv=rknn_venv, blocks=[0, 27], per_worker=0)
    return pack, report


@pytest.fixture(scope="session")
def pipeline_assets(tmp_path_factory) -> tuple:
    """(models folder, 128x128 FP16 pack) of tests.pipeline_harness.tiny_assets, built once per session (~10 s under
    load) for the modules that run a pipeline on it; treat as read-only (more packs may be added beside it with
    tiny_assets(pack.parent, ...))."""
    from tests.pipeline_harness import tiny_assets
    return tiny_assets(tmp_path_factory.mktemp("pipeline_assets"))
