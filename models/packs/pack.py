"""Model packs: a DiT checkpoint converted for one resolution (manifest + FP32 host weights + branch ONNX), built
streaming into a temporary sibling folder and renamed into place; loading checks every file against the manifest."""
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from models.dit.config import DiTConfig
from models.base.durable import atomic_write, building_folder, fsync_dir
from models.records.manifest import (MANIFEST, BranchEntry, ManifestRecord, data_sha256, existing_sources,  # noqa: F401
                             file_sha256, manifest_header, read_manifest, source_entry, write_manifest)
from models.records.manifest import check_files as _check_listed
from models.records.manifest import ManifestError, manifest_json, pack_resolution
from models.packs.sharded import ShardPackError, choose_cuts, part_files, part_specs, shard_count, shard_entries, \
    uncompiled_parts
from models.dit.partition import (BRANCHES, PACK_DTYPES, TEXT_TOKENS, Geometry, branch_file, branch_index, branch_order,
                              pack_io_dtype, resolve)
from models.base.schema import Int
from models.dit.shards import check_shards

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
PACK_KIND = "anima-dit-pack"
HOST_FILE = "host.safetensors"
ONNX_DIR = "onnx"


class PackError(ValueError):
    """A pack that is missing, incomplete, of another checkpoint, or whose files differ from its manifest."""


class Resolution(ManifestRecord, frozen=True):
    width: Int(1, 1 << 20)
    height: Int(1, 1 << 20)


class HostEntry(ManifestRecord, frozen=True):
    file: Any                       # checked by pack_member
    sha256: str


class DiTManifest(ManifestRecord, frozen=True):
    """A DiT pack's manifest (the fields load_pack reads)."""
    schema: int
    source: dict[str, Any]
    config: dict[str, Any]
    resolution: Resolution
    dtype: str
    host: HostEntry
    branches: list[BranchEntry]
    geometry: dict[str, Any] = {}


@dataclass
class Pack:
    """A loaded pack: its folder, manifest and what the runners need from it."""
    dir: Path
    manifest: dict
    config: DiTConfig
    geometry: Geometry
    dtype: str                                  # "fp16" | "fp32"
    branches: list = field(default_factory=list)  # manifest branch entries, strict execution order

    @property
    def io_dtype(self) -> str:
        return pack_io_dtype(self.dtype)

    @property
    def host_path(self) -> Path:
        return self.dir / self.manifest["host"]["file"]

    @property
    def source(self) -> dict:
        return self.manifest["source"]

    def branch(self, block: int, kind: str) -> dict:
        return self.branches[branch_index(block, kind)]

    def branch_path(self, block: int, kind: str) -> Path:
        return self.dir / self.branch(block, kind)["onnx"]

    @property
    def identity(self) -> str:
        """A short id of what the pack computes (checkpoint, resolution, dtype, every branch file's sha256): two
        copies of a pack on two machines have the same id (a remote executor is checked against it)."""
        key = [self.source.get("sha256"), self.geometry.width, self.geometry.height, self.dtype,
               [b.get("sha256") for b in self.branches]]
        if shard_count(self.manifest) > 1:             # a sharded pack runs its shard files: they are what it computes
            key.append([sha for b in self.branches for _, sha in part_files(b)])
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

    def host_weights(self) -> dict:
        """{host key: f32 array} from host.safetensors."""
        from models.base.safetensors_io import SafeTensorsFile
        st = SafeTensorsFile(self.host_path)
        return {k: st.get(k) for k in st.keys()}


# -- building -------------------------------------------------------------------------------------------------------
def existing_pack_source(out: Path) -> Optional[str]:
    """sha256 of the checkpoint (or VAE file) an existing pack at `out` was built from; None when `out` is absent or
    empty; "unreadable" for a manifest that does not say."""
    found = existing_sources(out, PackError, "source")
    return found[0] if isinstance(found, tuple) else found


def refuse_replacing(out: Path, sha: str, size: tuple, overwrite: bool, error=PackError, source: str = "checkpoint"):
    """The builders' rule for an `out` that already holds a pack: one of another source (`sha`) or another image
    size (`size` = (width, height)) is replaced only with `overwrite`; the error names what differs."""
    prev = existing_pack_source(out)                 # a folder that is not a pack is never replaced
    if overwrite:
        return
    if prev is not None and prev != sha:
        raise error(f"{out}: holds a pack of another {source} (sha256 {prev[:12]}…, this one {sha[:12]}…); "
                    "pass overwrite (--overwrite) to replace it")
    if prev is None:
        return
    try:
        had = pack_resolution(out)
    except ManifestError:
        return                                   # no size on record: the source rule above is all there is
    if had != tuple(size):
        raise error(f"{out}: holds a pack for {had[0]}x{had[1]}, this one is {size[0]}x{size[1]} (one pack per "
                    "size: choose another folder, e.g. one named for the size); pass overwrite (--overwrite) to "
                    "replace it")


def build_pack(ckpt_path, out_dir, resolution=(512, 512), dtype: str = "fp16", overwrite: bool = False,
               context: int = TEXT_TOKENS, lora_rank: int = 0, loras=(), shards: int = 1,
               cuts: Optional[dict] = None, progress=None, quant: Optional[tuple] = None,
               sampling: Optional[dict] = None) -> Path:
    """Convert the checkpoint at `ckpt_path` into a pack at `out_dir` for `resolution` = (width, height) pixels.

    `context` > 512: cross-attention takes that many context rows plus an additive mask, so prompts longer than 512
    T5 tokens keep every row as in ComfyUI (docs/prompts.md).
    `lora_rank` R > 0: a LoRA-ready pack, whose branch projections take rank-R low-rank inputs (LoRAs chosen per
    job, docs/lora.md). `loras` ([models.lora.LoraUse]): LoRAs baked into the weights (FP32, before the pack's dtype;
    the LLM adapter and text encoder parts of a LoRA are not in a DiT pack and are left to the encoder).

    `shards` > 1: every branch also as that many shard graphs (models/packs/sharded.py), so as many contexts on as
    many NPU cores compute it at once; `cuts` ({kind: "rows" | "heads"}) fixes a kind's cut, the board model picks
    the others at this pack's size (docs/board.md section 9).

    One block at a time (peak memory ~ one branch's weights); written into a temporary sibling folder that is renamed
    into place when complete. An existing pack of a different checkpoint or size is replaced only with `overwrite`.
    `progress(blocks done, blocks)` is called after each block.
    `quant` (calibration folder, INT8 layer names, smoothing alpha or None): a W8A8 pack (models/quant/packing.py,
    docs/quant.md): smoothed weights, the factors among the host weights, the quantizer's dataset; compiled INT8.
    `sampling` ({steps, cfg, sampler, scheduler}, models/packs/sampling.py): the settings jobs that set none take.
    """
    from models.dit.checkpoint import DiTCheckpoint

    t0 = time.perf_counter()
    io_dt = pack_io_dtype(dtype)
    geom = Geometry.from_resolution(*resolution, text_tokens=context, lora_rank=lora_rank)
    out = Path(out_dir).absolute()
    ckpt = DiTCheckpoint.open(ckpt_path)
    cfg = ckpt.config
    shards, cut_of, chosen = _shard_cuts(cfg, geom, shards, cuts, lora_rank, tuple(quant[1]) if quant else ())
    sha = ckpt.sha256()
    baked = _bake_plan(ckpt, loras)
    qplan = _quant_plan(quant, ckpt, sha, geom, lora_rank, loras)
    refuse_replacing(out, sha, (geom.width, geom.height), overwrite)
    with building_folder(out) as tmp:                 # renamed to `out` when complete, removed on any error
        keys = _write_host_weights(tmp, ckpt, baked, sha, qplan)
        del ckpt                                    # its mapped pages count in RSS; the branches reopen it per block
        branches = _write_branches(tmp, ckpt_path, cfg, geom, dtype, baked, shards, cut_of, progress, qplan)
        # the manifest, last: a folder without it is not a pack
        manifest = _pack_manifest(tmp, ckpt_path, sha, cfg, geom, dtype, io_dt, len(keys), branches)
        if lora_rank or baked is not None:
            manifest["lora"] = {"rank": lora_rank, "baked": baked.report() if baked is not None else []}
        if shards > 1:
            manifest["shards"] = {"n": shards, "cuts": cut_of, "chosen": chosen}
        if qplan is not None:
            from models.quant.packing import quant_section, write_dataset
            manifest["quant"] = quant_section(qplan, write_dataset(tmp, qplan, cfg, geom))
        if sampling is not None:
            manifest["sampling"] = dict(sampling)
        write_manifest(tmp, manifest)
        fsync_dir(tmp / ONNX_DIR)                   # the ONNX files' entries, before the folder's rename
    log.info("pack %s: %d branches, %s, %dx%d, built in %.1f s", out, len(branches), dtype, geom.width, geom.height,
             time.perf_counter() - t0)
    return out


def _quant_plan(quant: Optional[tuple], ckpt, sha: str, geom: Geometry, lora_rank: int, loras):
    """The QuantPlan of a W8A8 pack with its smoothing table, or None; PackError naming the option."""
    if quant is None:
        return None
    from models.quant.packing import check_combination, open_plan, smooth_table
    try:
        check_combination(lora_rank, loras)
        plan = open_plan(quant[0], tuple(quant[1]), quant[2], sha, geom)
    except ValueError as e:
        raise PackError(str(e)) from None
    plan.smooth = smooth_table(plan, ckpt, ckpt.config)
    return plan


def _shard_cuts(cfg, geom: Geometry, shards: int, cuts: Optional[dict], lora_rank: int, int8: tuple = ()) -> tuple:
    """(shards, {kind: cut}, how the cuts were chosen) for a pack of `shards` shards (a W8A8 pack's, priced with its
    `int8` layers); PackError naming the option."""
    if lora_rank and shards != 1:                  # shard graphs take no low-rank inputs (models/packs/branch_graphs.py)
        raise PackError(f"--shards {shards} with --lora-rank {lora_rank}: a pack is sharded or LoRA-ready, not both; "
                        "drop --shards for LoRAs per job (or bake them with --lora), or drop --lora-rank")
    try:
        shards = check_shards(shards)
        cut_of, chosen = choose_cuts(cfg, geom, shards, cuts, int8) if shards > 1 else ({}, "")
    except (ShardPackError, ValueError) as e:
        raise PackError(f"--shards {shards}: {e}") from None
    return shards, cut_of, chosen


def _write_host_weights(tmp: Path, ckpt, baked, sha: str, qplan=None) -> list:
    """The host weights (FP32), streamed tensor by tensor (a W8A8 pack's smoothing factors last); their keys."""
    from models.dit.host_ops import host_keys
    from models.base.safetensors_io import TensorEntry, write_safetensors

    keys = host_keys(ckpt.config)
    entries = [TensorEntry(k, "F32", tuple(ckpt.shape(k)), (lambda k=k: _baked(baked, k, ckpt.get(k)))) for k in keys]
    if qplan is not None:
        from models.quant.packing import SMOOTH_KEY
        entries.append(TensorEntry(SMOOTH_KEY, "F32", tuple(qplan.smooth.shape), qplan.smooth))
        keys = keys + [SMOOTH_KEY]
    write_safetensors(tmp / HOST_FILE, entries, metadata={"source_sha256": sha})
    return keys


def _write_branches(tmp: Path, ckpt_path, cfg, geom: Geometry, dtype: str, baked, shards: int, cut_of: dict,
                    progress, qplan=None) -> list:
    """The branch graphs, block by block in execution order; their manifest entries."""
    (tmp / ONNX_DIR).mkdir()
    branches = []
    for block, spec in branch_order(cfg):
        if spec.kind == BRANCHES[0].kind:
            ckpt = _reopen(ckpt_path)           # drop the last block's mapped pages: they count in RSS
        prefix = f"blocks.{block}.{spec.module}."
        weights = {k: _baked(baked, prefix + k, w) for k, w in ckpt.branch_weights(block, spec.kind).items()}
        if qplan is not None:
            from models.quant.packing import branch_weights
            weights = branch_weights(qplan, block, spec.kind, weights)
        branches.append(_write_branch(tmp, spec.kind, block, weights, cfg, geom, dtype,
                                      qplan.int8 if qplan is not None else ()))
        if shards > 1:
            branches[-1]["shards"] = shard_entries(tmp, branches[-1]["onnx"], spec.kind, weights, cfg, geom, dtype,
                                                   block, shards, cut_of[spec.kind],
                                                   qplan.int8 if qplan is not None else ())
        del weights
        if spec.kind == BRANCHES[-1].kind:
            log.info("pack: block %d/%d written", block + 1, cfg.blocks)
            if progress is not None:
                progress(block + 1, cfg.blocks)
    return branches


def _write_branch(tmp: Path, kind: str, block: int, weights: dict, cfg, geom: Geometry, dtype: str,
                  int8: tuple = ()) -> dict:
    """One branch's ONNX graph written into the pack; its manifest entry (a W8A8 pack's: with its INT8 MatMuls)."""
    from models.packs.branch_graphs import build_branch, serialize

    rel = f"{ONNX_DIR}/{branch_file(block, kind)}"
    model = build_branch(kind, weights, cfg, geom, dtype, block=block)
    names = []
    if int8:
        from models.quant.smooth import int8_tensors
        names = int8_tensors(model, kind, int8)
    data = serialize(model)
    del model
    atomic_write(tmp / rel, data)
    io = resolve(kind, cfg, geom, dtype)
    entry = {"block": block, "kind": kind, "onnx": rel, "sha256": data_sha256(data),
             "bytes": len(data), "inputs": io["inputs"], "outputs": io["outputs"]}
    if int8:
        entry["int8"] = names
    return entry


def _pack_manifest(tmp: Path, ckpt_path, sha: str, cfg, geom: Geometry, dtype: str, io_dt: str, host_keys: int,
                   branches: list) -> dict:
    """The manifest of a pack whose files are written (LoRA and shard sections aside)."""
    from models.packs.branch_graphs import OPSET

    return {
        **manifest_header(PACK_KIND, SCHEMA_VERSION),
        "source": source_entry(ckpt_path, sha),
        "config": cfg.to_dict(),
        "resolution": {"width": geom.width, "height": geom.height},
        "geometry": geom.to_dict(),
        "dtype": dtype, "io_dtype": io_dt, "opset": OPSET,
        "host": {"file": HOST_FILE, "sha256": file_sha256(tmp / HOST_FILE), "keys": host_keys},
        "branches": branches,
    }


def _bake_plan(ckpt, loras):
    """The LoraPlan of the LoRAs baked into a pack (None without), resolved against the checkpoint's own keys."""
    if not loras:
        return None
    from models.lora import TargetTable, plan_loras
    plan = plan_loras(loras, TargetTable({k: ckpt.shape(k) for k in ckpt.keys()}))
    for rep in plan.report():
        left = {p: n for p, n in rep["layers"].items() if p == "adapter"}
        if left:
            log.warning("LoRA %s: its %d LLM-adapter layers run in the encoder, not in a DiT pack: apply it there "
                        "per job", rep["name"], left["adapter"])
        log.info("baking LoRA %s (strength %g): %s", rep["name"], rep["strength"], rep["layers"])
    return plan


def _baked(plan, key: str, weight):
    """A weight with the baked LoRAs merged (FP32), or as it is."""
    if plan is None or key not in plan.targets or plan.targets[key].place == "adapter":
        return weight
    return plan.merged(key, weight)


def _reopen(ckpt_path):
    """A fresh DiTCheckpoint (new memory map; the previous one is unmapped once unreferenced), opened quietly."""
    from models.dit.checkpoint import DiTCheckpoint
    lg = logging.getLogger("models.dit.checkpoint")
    level = lg.level
    lg.setLevel(logging.WARNING)
    try:
        return DiTCheckpoint.open(ckpt_path)
    finally:
        lg.setLevel(level)


# -- loading --------------------------------------------------------------------------------------------------------
def pack_member(pack_dir, rel, where: str = "") -> Path:
    """PACK/rel for a file name a manifest gives, kept inside the pack folder: a relative POSIX path with no '..', no
    NUL, that (links resolved) stays under the folder's real path; PackError otherwise. A pack may come from
    elsewhere: its manifest must not make a reader hash, load or run a file outside it."""
    where = where or str(Path(pack_dir) / MANIFEST)
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        raise PackError(f"{where}: file name {str(rel)[:200]!r} is not a relative path inside the pack")
    parts = PurePosixPath(rel).parts
    if PurePosixPath(rel).is_absolute() or ".." in parts:
        raise PackError(f"{where}: file name {rel[:200]!r} leaves the pack folder (absolute or '..')")
    root = Path(pack_dir).resolve()
    full = root.joinpath(*parts).resolve()
    if root not in full.parents:
        raise PackError(f"{where}: file {rel[:200]!r} resolves to {full}, outside the pack folder {root}")
    return root.joinpath(*parts)


# manifest "omitted": what a pack's builder removed because its backend never reads it. "onnx": the branch graphs of
# a compiled pack (a board bundle, models/setup/bundle.py): each branch (and shard) keeps its ONNX entry (name, sha256) as the record
# of what its .rknn was compiled from, but the file is gone and no reader asks for it.
OMITTED_ONNX = "onnx"


def onnx_omitted(manifest: dict) -> bool:
    """The branch graphs were removed from this (compiled) pack: only its .rknn files run."""
    return OMITTED_ONNX in (manifest.get("omitted") or ())


def omit_onnx(pack_dir) -> int:
    """Remove a compiled pack's branch ONNX graphs (what an NPU board never reads); -> bytes freed. The manifest says
    so first (written atomically), then the files go: an interruption leaves a pack whose loader still accepts it."""
    d = Path(pack_dir)
    m = manifest_json(d)
    missing = [n for b in m["branches"] for n in ([] if isinstance(b.get("rknn"), dict) else [b["onnx"]])
               + uncompiled_parts(b)]
    if missing:
        raise PackError(f"{d}: {len(missing)} branch(es) not compiled (e.g. {missing[0]}); compile the pack before "
                        "removing its ONNX graphs")
    if not onnx_omitted(m):
        m["omitted"] = sorted({*(m.get("omitted") or ()), OMITTED_ONNX})
        write_manifest(d, m)
    graphs = [rel for b in m["branches"] for rel in [b["onnx"], *(p["onnx"] for p in (b.get("shards") or {})
                                                                  .get("parts", ()))]]
    freed = 0
    for rel in graphs:
        f = pack_member(d, rel)
        if f.is_file():
            freed += f.stat().st_size
            f.unlink()
    for rel in graphs:
        parent = pack_member(d, rel).parent
        if parent != d.resolve() and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
    return freed


def pack_files(manifest: dict) -> list:
    """(relative path, sha256) of every file the manifest vouches for: host weights (DiT packs), ONNX (unless
    omitted) and any compiled RKNN."""
    files = [(manifest["host"]["file"], manifest["host"]["sha256"])] if "host" in manifest else []
    omitted = onnx_omitted(manifest)
    for b in manifest["branches"]:
        if not omitted:
            files.append((b["onnx"], b["sha256"]))
        if isinstance(b.get("rknn"), dict):
            files.append((b["rknn"]["file"], b["rknn"]["sha256"]))
        files += part_files(b, onnx=not omitted)
    from models.records.manifest import quant_info
    q = quant_info(manifest)
    if q is not None:
        files.append((q["dataset"]["file"], q["dataset"]["sha256"]))
    return files


def _recorded_sizes(manifest: dict) -> dict:
    """{relative path: bytes} of the files whose size the manifest records (branch and shard graphs, compiled models)."""
    sizes = {}
    for b in manifest["branches"]:
        for e in [b, *((b.get("shards") or {}).get("parts") or ())]:
            if isinstance(e.get("onnx"), str) and type(e.get("bytes")) is int:
                sizes[e["onnx"]] = e["bytes"]
            rk = e.get("rknn")
            if isinstance(rk, dict) and isinstance(rk.get("file"), str) and type(rk.get("bytes")) is int:
                sizes[rk["file"]] = rk["bytes"]
    return sizes


def missing_files(pack_dir, manifest: dict) -> list:
    """The files the manifest vouches for that are not in the pack folder, or not of the size it records (a quick
    look: no hashing), each named with why: 'onnx/b00_self.onnx (missing)', '... (100 bytes, the manifest says N)'."""
    sizes, out = _recorded_sizes(manifest), []
    for rel, _ in pack_files(manifest):
        p = Path(pack_dir) / rel
        if not p.is_file():
            out.append(f"{rel} (missing)")
        elif rel in sizes and p.stat().st_size != sizes[rel]:
            out.append(f"{rel} ({p.stat().st_size} bytes, the manifest says {sizes[rel]})")
    return out


def check_files(pack_dir, manifest: dict, error=PackError) -> None:
    """`error` (PackError) naming every file that is missing or whose sha256 differs from the manifest."""
    _check_listed(pack_dir, [(rel, sha, None) for rel, sha in pack_files(manifest)], error)


def load_pack(pack_dir, check: bool = True) -> Pack:
    """Read and validate a pack's manifest; with `check`, verify every file's existence and sha256."""
    d = Path(pack_dir)
    m, rec = read_manifest(d, DiTManifest, PackError, what="pack", kind_what="DiT pack", kind=PACK_KIND,
                           default_kind=PACK_KIND, schema=SCHEMA_VERSION)
    where = str(d / MANIFEST)
    try:
        cfg = DiTConfig.from_dict(rec.config)
        geom = Geometry.from_resolution(rec.resolution.width, rec.resolution.height,
                                        int(rec.geometry.get("text_tokens", TEXT_TOKENS)),
                                        int(rec.geometry.get("lora_rank", 0)))
    except (TypeError, KeyError, ValueError, OverflowError) as e:
        raise PackError(f"{where}: bad config/resolution ({e})") from None
    if rec.dtype not in PACK_DTYPES:
        raise PackError(f"{where}: manifest field 'dtype' has unsupported value {rec.dtype!r}")
    want = [(i, s.kind) for i, s in branch_order(cfg)]
    if [(b.block, b.kind) for b in rec.branches] != want:
        raise PackError(f"{where}: branch table does not list blocks 0..{cfg.blocks - 1} × "
                        f"{[s.kind for s in BRANCHES]} in order")
    pack_member(d, rec.host.file, where + " host")
    for b in rec.branches:
        bw = f"{where} branch b{b.block:02d}_{b.kind}"
        pack_member(d, b.onnx, bw)
        if b.rknn is not None:
            pack_member(d, b.rknn.get("file"), bw + " rknn")
            if not isinstance(b.rknn.get("sha256"), str):
                raise PackError(f"{bw} rknn: manifest field 'sha256' is missing")
    _check_shards(d, m, where)
    _check_config_shapes(d, rec, cfg, geom, where)
    if check:
        check_files(d, m)
    return Pack(d, m, cfg, geom, m["dtype"], list(m["branches"]))


def _check_config_shapes(d: Path, rec: "DiTManifest", cfg: DiTConfig, geom: Geometry, where: str) -> None:
    """The manifest's config against what the pack holds: each branch's inputs and outputs as the config resolves
    them, and the host weights' shapes in their file's header (read, not its data). A config that lies about the
    widths would otherwise load and then fail every job inside the scheduler."""
    for b in rec.branches:
        io = resolve(b.kind, cfg, geom, rec.dtype)
        if b.inputs != io["inputs"] or b.outputs != io["outputs"]:
            raise PackError(f"{where} branch b{b.block:02d}_{b.kind}: its inputs/outputs are not the ones the "
                            f"manifest's config gives (width {cfg.width}, {geom.tokens} tokens); rebuild the pack")
    host = d / rec.host.file
    if not host.is_file():
        return                                     # check_files names a missing file
    from models.dit.config import expected_dit_shapes
    from models.dit.host_ops import host_keys
    from models.base.safetensors_io import SafeTensorsError, SafeTensorsFile
    try:
        f = SafeTensorsFile(host)
        have = {k: tuple(f.shape(k)) for k in f.keys()}
    except (SafeTensorsError, OSError) as e:
        raise PackError(f"{where} host: {host.name} is not readable ({e})") from None
    want = expected_dit_shapes(cfg)
    bad = [k for k in host_keys(cfg) if have.get(k) != tuple(want[k])]
    if bad:
        raise PackError(f"{where} host: {host.name} holds {bad[0]} as {list(have.get(bad[0], ()))}, the manifest's "
                        f"config gives {list(want[bad[0]])}; rebuild the pack")


def _check_shards(d: Path, m: dict, where: str) -> None:
    """A sharded pack: every branch lists shards that cover its cut in order, with file names inside the pack."""
    try:
        n = check_shards(shard_count(m))
    except (TypeError, ValueError, AttributeError, OverflowError) as e:
        raise PackError(f"{where}: manifest field 'shards' must be a table with n = the shards per branch ({e})") \
            from None
    if n == 1:
        if any("shards" in b for b in m["branches"]):
            raise PackError(f"{where}: branches list shards but the pack has no top-level shards.n > 1")
        return
    for b in m["branches"]:
        bw = f"{where} branch b{b['block']:02d}_{b['kind']}"
        try:
            specs = part_specs(b, bw)
        except ShardPackError as e:
            raise PackError(str(e)) from None
        if len(specs) != n:
            raise PackError(f"{bw}: {len(specs)} shards, the pack's shards.n is {n}")
        for rel, _ in part_files(b):
            pack_member(d, rel, bw + " shards")
