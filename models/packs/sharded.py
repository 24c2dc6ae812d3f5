"""A sharded pack (`anima-models pack ... --shards N`): every branch also as N shard graphs (models/dit/shards.py), the
cut of each branch kind chosen by the board model at the pack's size, recorded in the manifest.

Manifest: the top-level `shards` = {"n", "cuts": {kind: cut}, "chosen": why}; each branch entry keeps its one-graph
ONNX (the reference its shards are checked against, and what an unsharded run would use) and gains `shards` =
{"cut", "parts": [{"index", "range", "of", "onnx", "sha256", "bytes", "inputs", "outputs"[, "rknn"]}]}. The executor
runs the parts (their .rknn on the board: `anima-models compile` compiles the parts of a sharded entry), combining
their outputs in FP32 (models.runtime.lifecycle); `shards_of` is what tells it a branch file is sharded.
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Optional

from models.records.manifest import MANIFEST, sharded_branches
from models.board import auto as board_auto
from models.board.cost import LABEL, BoardModel, Shape
from models.dit.config import DiTConfig
from models.base.durable import atomic_write
from models.dit.partition import KINDS, Geometry
from models.dit.shards import CUTS, ShardSpec, check_shards, plan, shard_io, shard_weights

BOARD_RAM_GB = 8                 # the board the cuts are chosen for (the reference's ROCK 5C)


class ShardPackError(ValueError):
    """A bad --shards / --cuts request, or a manifest's shard entry that does not hold together."""


def parse_cuts(text: Optional[str]) -> dict:
    """"self=heads,cross=rows,ffn=rows" -> {kind: cut}; every kind named once."""
    if not text:
        return {}
    out = {}
    for item in str(text).split(","):
        kind, _, cut = item.strip().partition("=")
        if kind not in KINDS or cut not in CUTS or kind in out:
            raise ShardPackError(f"--cuts {text!r}: expected KIND=CUT for each of {', '.join(KINDS)} once, "
                                 f"CUT one of {', '.join(CUTS)}")
        out[kind] = cut
    return out


def choose_cuts(cfg: DiTConfig, geom: Geometry, shards: int, given: Optional[dict] = None, int8: tuple = ()) -> tuple:
    """The cut per branch kind -> ({kind: cut}, how it was chosen). Kinds `given` keep their cut; the board model
    (models/board/auto.choose_cuts: lifecycle, memory and tensor I/O priced, every policy weighed) picks the rest at
    this pack's size (its widths and tokens; a W8A8 pack's `int8` layers) on the modelled 8 GB board."""
    given = dict(given or {})
    if set(given) >= set(KINDS):
        return given, "given (--cuts)"
    shape = Shape(cfg.width, cfg.heads, cfg.head_dim, cfg.ffn_width, cfg.context_dim, cfg.blocks, geom.tokens,
                  geom.text_tokens, int8=tuple(int8))
    model = BoardModel(shape)
    budget = model.context_budget_mib(BOARD_RAM_GB)
    cuts, best = board_auto.choose_cuts(model, shards, budget, fixed=given)
    return cuts, (f"{LABEL} board ({model.source}), {BOARD_RAM_GB} GB: fastest with {best.policy.name} "
                  f"({best.warm.wall_s:.2f} s per computed step)" + (f"; given: {given}" if given else ""))


def shard_entries(tmp: Path, rel: str, kind: str, weights: dict, cfg: DiTConfig, geom: Geometry, dtype: str,
                  block: int, shards: int, cut: str, int8: tuple = ()) -> dict:
    """Write a branch's shard graphs beside its one graph (onnx/bNN_kind.sI.onnx) -> the entry's `shards` block.
    A W8A8 pack's (`int8`: its INT8 layer names; `weights` already smoothed): each part lists its own INT8 MatMuls
    (`int8`), as the branch entry does; its quantizer inputs are the branch's, cut as `shard_feed` cuts a pass."""
    from models.packs.branch_graphs import build_branch, serialize     # onnx: the host's, never the board's
    parts = []
    for spec in plan(kind, cut, shards, cfg, geom):
        part_rel = rel[:-len(".onnx")] + f".s{spec.index}.onnx"
        model = build_branch(kind, shard_weights(spec, weights), cfg, geom, dtype, block=block, shard=spec)
        names = []
        if int8:
            from models.quant.smooth import int8_tensors
            names = int8_tensors(model, kind, int8)
        data = serialize(model)
        del model
        atomic_write(tmp / part_rel, data)
        io = shard_io(spec, cfg, geom, dtype)
        parts.append({**spec.to_dict(), "onnx": part_rel, "sha256": hashlib.sha256(data).hexdigest(),
                      "bytes": len(data), "inputs": io["inputs"], "outputs": io["outputs"],
                      **({"int8": names} if int8 else {})})
    return {"cut": cut, "parts": parts}


def part_specs(entry: dict, where: str = "manifest") -> list:
    """The ShardSpecs of a manifest branch entry's parts (ShardPackError when they do not cover the cut in order)."""
    sh = entry.get("shards")
    try:
        cut, parts = sh["cut"], sh["parts"]
        specs = [ShardSpec(entry["kind"], cut, int(p["index"]), len(parts), int(p["range"][0]), int(p["range"][1]),
                           int(p["of"])) for p in parts]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ShardPackError(f"{where}: bad shards entry ({e!r})") from None
    check_shards(len(specs))
    ends = [0] + [s.b for s in specs]
    if cut not in CUTS or [s.index for s in specs] != list(range(len(specs))) or \
            any(s.a != e for s, e in zip(specs, ends)) or specs[-1].b != specs[-1].total:
        raise ShardPackError(f"{where}: the shards of a {entry.get('kind')} branch do not cover its {cut} in order")
    return specs


def part_files(entry: dict, onnx: bool = True) -> list:
    """(relative path, sha256) of every file of a branch entry's shards (ONNX unless not `onnx`, and compiled RKNN)."""
    out = []
    for p in (entry.get("shards") or {}).get("parts", ()):
        if onnx:
            out.append((p["onnx"], p["sha256"]))
        if isinstance(p.get("rknn"), dict):
            out.append((p["rknn"]["file"], p["rknn"]["sha256"]))
    return out


def uncompiled_parts(entry: dict) -> list:
    """The ONNX names of a branch entry's shards that have no compiled model."""
    return [p["onnx"] for p in (entry.get("shards") or {}).get("parts", ()) if not isinstance(p.get("rknn"), dict)]


def shard_count(manifest: dict) -> int:
    """Shards per branch of a pack (1: every branch one graph)."""
    return int((manifest.get("shards") or {}).get("n", 1))


class ShardResolver:
    """shards_of(path) for the lifecycle: a branch file of a sharded pack (PACK/onnx/bNN_kind.onnx) -> its shard
    files and specs; None for a pack without shards or a file it does not list. One manifest read per pack."""

    def __init__(self):
        self._packs: dict = {}
        self._lock = threading.Lock()

    def _table(self, pack: Path) -> dict:
        with self._lock:
            if pack not in self._packs:
                table = {}
                try:
                    for b in sharded_branches(pack):
                        specs = part_specs(b, str(pack / MANIFEST))
                        table[str((pack / b["onnx"]).resolve())] = (
                            [str((pack / p["onnx"]).resolve()) for p in b["shards"]["parts"]], specs)
                except (OSError, ValueError, KeyError, TypeError):
                    table = {}                # not a pack's branch: run it as one graph (its loader reports why)
                self._packs[pack] = table
            return self._packs[pack]

    def __call__(self, path) -> Optional[tuple]:
        p = Path(path).resolve()
        return self._table(p.parent.parent).get(str(p))
