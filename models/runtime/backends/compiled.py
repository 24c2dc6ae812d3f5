"""A pack's compiled branch files and their manifest entries: the one place the rknn backend and its stand-in find
which .rknn a branch runs and which ONNX graph it came from (DiT and VAE packs, shards included)."""
from __future__ import annotations

from pathlib import Path

from models.packs.kinds import load_branch_pack
from models.packs.pack import PackError, pack_member
from models.runtime.backends.base import BackendError


def _pack_branches(p: Path) -> tuple:
    """(pack folder, manifest branch entries, p relative to the pack) for a file PACK/<dir>/<name> of a DiT or a VAE
    pack. The manifest is read by that kind's loader (models.packs.pack.load_branch_pack), which keeps every file name it
    gives inside the pack folder."""
    pack = p.parent.parent
    try:
        loaded = load_branch_pack(pack, check=False)
    except PackError as e:
        raise BackendError(f"{p}: its pack manifest is not usable ({e})") from None
    return pack, loaded.manifest["branches"], p.relative_to(pack).as_posix()


def _models(branches: list) -> list:
    """Every model a pack's entries name: each branch, and a sharded pack's shard parts (their own file, inputs,
    outputs and compiled file, models/packs/sharded.py)."""
    return [m for b in branches for m in [b, *((b.get("shards") or {}).get("parts") or ())]]


def branch_entry(rknn_path) -> tuple:
    """(pack folder, manifest entry) for a compiled branch file PACK/rknn/bNN_kind.rknn (or a shard's)."""
    p = Path(rknn_path).absolute()
    pack, branches, rel = _pack_branches(p)
    for b in _models(branches):
        if isinstance(b.get("rknn"), dict) and b["rknn"].get("file") == rel:
            return pack, b
    raise BackendError(f"{p}: not a compiled branch of {pack} (no manifest entry with rknn.file {rel!r}; "
                       "run `anima-models compile`)")


def compiled_path(model_path) -> Path:
    """The .rknn file of a branch: itself, or, for PACK/onnx/bNN_kind.onnx (what the scheduler names), the compiled
    file the pack manifest records for that branch (inside the pack folder: its loader checked the name); a shard's
    PACK/onnx/bNN_kind.sI.onnx likewise."""
    p = Path(model_path).absolute()
    if p.suffix == ".rknn":
        return p
    pack, branches, rel = _pack_branches(p)
    for b in _models(branches):
        if b.get("onnx") == rel:
            if not isinstance(b.get("rknn"), dict) or not b["rknn"].get("file"):
                raise BackendError(f"{pack}: branch {rel} is not compiled for the NPU (run `anima-models compile "
                                   f"{pack} --target rk3588`)")
            return pack_member(pack, b["rknn"]["file"])
    raise BackendError(f"{p}: not a branch of pack {pack}")
