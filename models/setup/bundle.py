"""A board bundle: everything a board runs, built on the PC from a ComfyUI-style models folder in one command
(`anima-models bundle`), checked on the board by `orchestrator init --bundle` and `orchestrator doctor`.

    BUNDLE/bundle.json              what is here (below), written last: a folder without it is not a bundle
    BUNDLE/dit-WxH/                 the FP16 DiT pack of one image size (models/packs/pack.py), compiled for the target
    BUNDLE/vae-WxH/                 the VAE pack of that size (models/vae/pack.py), compiled for the target
    BUNDLE/encoder/                 the text encoder for ONNX Runtime with its tokenizers (models/text/encoder_pack.py)

    bundle.json  {"schema": 1, "kind": "anima-bundle", "target": "rk3588" | "none", "toolkit": "2.5.0" | null,
                  "sizes": {"512x512": {"dit": PART, "vae": PART}}, "encoder": PART, "sources": {...},
                  "sampling"?: {"steps", "cfg", "sampler", "scheduler"} (`--sampling`, as every DiT pack records),
                  "lora": [{"name": "style.safetensors", "strength": 0.8, "sha256": HEX}], "shards": N, ...}
    PART         {"path": "dit-512x512", "kind": MANIFEST KIND, "bytes": N, "manifest_sha256": HEX}

Paths are relative to the bundle (it is copied to the board as a whole). A part is pinned by the sha256 of its
manifest, and the manifest holds the sha256 of every file, so the chain reaches every byte. `toolkit` is the
rknn-toolkit2 release that compiled the packs: the board's rknn-toolkit-lite2 and librknnrt.so must be the same
release. A `--target rk3588` bundle holds no branch ONNX graphs (models.packs.pack.omit_onnx): the NPU reads the .rknn
files only. "lora": the LoRAs baked into every DiT pack (`bundle --lora`, as `pack --lora`), each pack's manifest
agreeing. "shards": the shard graphs per branch of every DiT pack (`bundle --shards N`, as `pack --shards`; 1: one
graph per branch), each pack's manifest agreeing; a compiled bundle's shards are compiled too. `--target none` is a CPU bundle: ONNX Runtime for every stage (a PC executor; the tests here).
"""
from __future__ import annotations

import json
import re
import logging
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional

from models.base.durable import atomic_write
from models.records.manifest import MANIFEST, ManifestRecord, SamplingRecord, file_sha256, tool_versions
from models.packs.pack import PACK_KIND as DIT_KIND
from models.setup.models_dir import resolve_models
from models.packs.pack import PackError, build_pack, load_pack, missing_files, omit_onnx, onnx_omitted
from models.packs.sampling import record_sampling
from models.packs.sharded import shard_count
from models.dit.partition import MAX_LORA_RANK, parse_resolution
from models.dit.shards import MAX_SHARDS, check_shards
from models.base.schema import Int, SchemaError
from models.text.encoder_pack import PACK_KIND as ENCODER_KIND
from models.text.encoder_pack import EncoderPackError, build_encoder_pack, load_encoder_pack
from models.vae.pack import PACK_KIND as VAE_KIND
from models.vae.pack import build_vae_pack, load_vae_pack

log = logging.getLogger(__name__)

BUNDLE_JSON = "bundle.json"
BUNDLE_KIND = "anima-bundle"
SCHEMA_VERSION = 1
TARGETS = ("rk3588", "none")          # none: a CPU bundle (ONNX Runtime); rk3588: compiled with rknn-toolkit2
ENCODER_DIR = "encoder"
LORA_RANKS = range(0, MAX_LORA_RANK + 1)


class BundleError(ValueError):
    """A bundle that cannot be built or is not usable; the message names the part and the fix."""


def size_key(size: tuple) -> str:
    return f"{size[0]}x{size[1]}"


def part_dirs(size: tuple) -> tuple[str, str]:
    """The DiT and VAE pack folders of one image size, relative to the bundle."""
    return f"dit-{size_key(size)}", f"vae-{size_key(size)}"


# ---- bundle.json as records ----------------------------------------------------------------------------------------

class PartEntry(ManifestRecord, frozen=True):
    path: str
    kind: str
    bytes: Int(0, 2**62)
    manifest_sha256: str


class SizeEntry(ManifestRecord, frozen=True):
    dit: PartEntry
    vae: PartEntry


# what `toolkit` may hold: an rknn-toolkit2 release as its own metadata gives it (2.5.0, 2.3.2+local); the value reaches
# pipeline.toml's comment and every message, so nothing else passes
TOOLKIT_RELEASE = re.compile(r"[0-9]{1,4}(?:\.[0-9]{1,4}){1,3}(?:[+.-][0-9A-Za-z]{1,32}){0,4}")


class BundleRecord(ManifestRecord, frozen=True):
    schema: int
    kind: str
    target: str
    sizes: dict[str, SizeEntry]
    encoder: PartEntry
    toolkit: Optional[str] = None
    sampling: Optional[SamplingRecord] = None      # the model's sampling settings, as each DiT pack records them
    shards: Int(1, MAX_SHARDS) = 1                 # shard graphs per branch of every DiT pack (`bundle --shards`)


@dataclass(frozen=True)
class Bundle:
    dir: Path
    data: dict
    target: str
    toolkit: Optional[str]
    sizes: dict            # {(width, height): (DiT pack folder, VAE pack folder)}, absolute, in bundle.json's order
    encoder: Path
    lora: tuple = ()       # the LoRAs baked into every DiT pack: ({"name", "strength", "sha256"}, ...)

    @property
    def backend(self) -> str:
        """The model backend the bundle's packs are built for (executor and VAE)."""
        return "rknn" if self.target == "rk3588" else "onnx"


def _folder_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _part_entry(bundle: Path, rel: str, kind: str) -> dict:
    d = bundle / rel
    return {"path": rel, "kind": kind, "bytes": _folder_bytes(d), "manifest_sha256": file_sha256(d / MANIFEST)}


# ---- reading and checking ------------------------------------------------------------------------------------------

def _member(bundle: Path, rel: str, where: str) -> Path:
    parts = PurePosixPath(rel).parts
    if not rel or PurePosixPath(rel).is_absolute() or ".." in parts or "\\" in rel:
        raise BundleError(f"{where}: path {rel[:200]!r} is not a folder inside the bundle")
    d = bundle.joinpath(*parts)
    if d.exists() and not d.resolve().is_relative_to(bundle.resolve()):     # a link out of the bundle
        raise BundleError(f"{where}: path {rel[:200]!r} leads out of the bundle (a symbolic link); copy the part "
                          "into the bundle")
    return d


def _check_part(bundle: Path, entry: PartEntry, where: str, hashes: bool, target: str, toolkit: Optional[str],
                kind: str):
    """A part's folder, its manifest (the sha256 bundle.json pins), its files (present; with `hashes`, their sha256)
    and, for a compiled bundle, every model compiled for the target by the bundle's toolkit; -> the loaded pack.
    `kind`: the kind its place in bundle.json holds (a DiT pack under sizes.S.dit ...)."""
    if entry.kind != kind:
        raise BundleError(f"{where}: kind {entry.kind[:80]!r} where bundle.json holds a {kind!r}; rebuild the bundle")
    d = _member(bundle, entry.path, where)
    fix = "; copy the whole bundle again (rsync -a) or rebuild it with `anima-models bundle`"
    if not d.is_dir():
        raise BundleError(f"{where}: {d} is missing{fix}")
    mpath = d / MANIFEST
    if not mpath.is_file():
        raise BundleError(f"{where}: {d} has no {MANIFEST} (an interrupted copy or build){fix}")
    if file_sha256(mpath) != entry.manifest_sha256:
        raise BundleError(f"{where}: {mpath} is not the manifest bundle.json records (sha256 differs): another "
                          f"pack was put in its place{fix}")
    loaders = {DIT_KIND: load_pack, VAE_KIND: load_vae_pack, ENCODER_KIND: load_encoder_pack}
    if entry.kind not in loaders:
        raise BundleError(f"{where}: kind {entry.kind[:80]!r} is not one of {', '.join(loaders)}")
    try:
        pack = loaders[entry.kind](d, check=hashes)
        if entry.kind != ENCODER_KIND and not hashes:          # the encoder's loader checks presence and size itself
            gone = missing_files(d, pack.manifest)
            if gone:
                raise BundleError(f"{where}: {d}: {len(gone)} file(s) missing or cut short, e.g. {gone[0]}{fix}")
    except (PackError, EncoderPackError) as e:
        raise BundleError(f"{where}: {e}{fix}") from None
    if target != "none" and entry.kind != ENCODER_KIND:
        stale = [b.get("name") or b["onnx"] for b in pack.manifest["branches"] if not _compiled(b, target, toolkit)]
        if stale:
            raise BundleError(f"{where}: {d}: {len(stale)} model(s) not compiled for {target} with rknn-toolkit2 "
                              f"{toolkit}, e.g. {stale[0]}; rebuild the bundle with `anima-models bundle`")
    return pack


def read_bundle(bundle_dir, hashes: bool = False) -> Bundle:
    """bundle.json and every part it names, checked (BundleError naming the part and the fix): present, the manifest
    it pins, every file present (with `hashes`, its sha256), each size's DiT and VAE pack of that size, compiled for
    the target by the recorded toolkit."""
    b = Path(bundle_dir).expanduser().resolve()
    path = b / BUNDLE_JSON
    if not b.is_dir():
        raise BundleError(f"{b}: no such bundle folder (make one on the PC with `anima-models bundle`)")
    if not path.is_file():
        hint = (" (this is a model pack, not a bundle: use --pack)" if (b / MANIFEST).is_file() else
                " (an interrupted build or copy, or not a bundle: `anima-models bundle` writes it last)")
        raise BundleError(f"{b}: no {BUNDLE_JSON}{hint}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:      # RecursionError: nesting past Python's limit
        raise BundleError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(data, dict) or data.get("kind") != BUNDLE_KIND:
        raise BundleError(f"{path}: not a bundle (kind {str(data.get('kind') if isinstance(data, dict) else None)[:80]!r}"
                          f", expected {BUNDLE_KIND!r})")
    if data.get("schema") != SCHEMA_VERSION:
        raise BundleError(f"{path}: schema version {str(data.get('schema'))[:40]}, this code reads {SCHEMA_VERSION}; "
                          "rebuild the bundle with this release's `anima-models bundle`")
    try:
        rec = BundleRecord.from_data(data)
    except SchemaError as e:
        raise BundleError(f"{path}: {e.detail}") from None
    if rec.target not in TARGETS:
        raise BundleError(f"{path}: target {rec.target[:40]!r} is not one of {', '.join(TARGETS)}")
    if rec.target != "none" and not rec.toolkit:
        raise BundleError(f"{path}: target {rec.target} but no toolkit version recorded; rebuild the bundle")
    if rec.target == "none" and rec.toolkit is not None:
        raise BundleError(f"{path}: target none compiles nothing, but a toolkit is recorded ({rec.toolkit[:40]!r})")
    if rec.toolkit is not None and not TOOLKIT_RELEASE.fullmatch(rec.toolkit):
        raise BundleError(f"{path}: toolkit {rec.toolkit[:40]!r} is not a release number (such as 2.5.0)")
    if not rec.sizes:
        raise BundleError(f"{path}: 'sizes' is empty; a bundle serves at least one image size")
    sizes, lora = {}, _baked_in(path, data.get("lora", []))
    for key, entry in rec.sizes.items():
        try:
            size = parse_resolution(key)
        except ValueError as e:
            raise BundleError(f"{path}: sizes.{key[:40]}: {e}") from None
        dit = _check_part(b, entry.dit, f"{path} sizes.{key}.dit", hashes, rec.target, rec.toolkit, DIT_KIND)
        vae = _check_part(b, entry.vae, f"{path} sizes.{key}.vae", hashes, rec.target, rec.toolkit, VAE_KIND)
        if shard_count(dit.manifest) != rec.shards:
            raise BundleError(f"{path}: sizes.{key}.dit: its DiT pack has {shard_count(dit.manifest)} shard(s) per "
                              f"branch, bundle.json says {rec.shards}; rebuild the bundle")
        if _pack_baked(dit.manifest) != _pack_baked({"lora": {"baked": lora}}):
            raise BundleError(f"{path}: sizes.{key}.dit: its DiT pack has baked LoRA "
                              f"{baked_label(dit.manifest.get('lora', {}).get('baked', [])) or 'none'}, bundle.json "
                              f"says {baked_label(lora) or 'none'}; rebuild the bundle")
        got = {"dit": (dit.geometry.width, dit.geometry.height), "vae": (vae.width, vae.height)}
        for part, s in got.items():
            if s != size:
                raise BundleError(f"{path}: sizes.{key}.{part} is a {size_key(s)} pack; rebuild the bundle")
        sizes[size] = (dit.dir.resolve(), vae.dir.resolve())
    _check_part(b, rec.encoder, f"{path} encoder", hashes, rec.target, rec.toolkit, ENCODER_KIND)
    return Bundle(b, data, rec.target, rec.toolkit, sizes, _member(b, rec.encoder.path, str(path)).resolve(),
                  lora)


def _baked_in(path: Path, lora) -> tuple:
    """bundle.json's "lora" (the LoRAs baked into its DiT packs), checked: a list of {name, strength, sha256}."""
    ok = isinstance(lora, list) and all(
        isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("sha256"), str)
        and isinstance(e.get("strength"), (int, float)) and not isinstance(e.get("strength"), bool) for e in lora)
    if not ok:
        raise BundleError(f"{path}: 'lora' is not a list of {{name, strength, sha256}}; rebuild the bundle")
    return tuple({"name": e["name"][:200], "strength": float(e["strength"]), "sha256": e["sha256"][:64]}
                 for e in lora)


def baked_label(lora) -> str:
    """The baked LoRAs as the commands print them: "style.safetensors x 0.8, ..." ("" for none)."""
    return ", ".join(f"{e['name']} x {e['strength']:g}" for e in lora)


# ---- building ------------------------------------------------------------------------------------------------------

class _Sources:
    """The models folder's files and their sha256, hashed once however many parts compare against them."""

    def __init__(self, paths):
        self.paths, self._sha = paths, {}

    def sha(self, name: str) -> str:
        if name not in self._sha:
            self._sha[name] = file_sha256(getattr(self.paths, name))
        return self._sha[name]


def _existing_branch_pack(d: Path, kind: str, source_sha: str, size: tuple, build_for: tuple) -> str:
    """What a DiT or VAE pack already at `d` leaves to do: "nothing" (complete for this source, size, FP16 and LoRA
    rank (DiT), target and toolkit, ONNX graphs removed for rk3588), "compile" (the pack is complete, its compile is
    not: it resumes, keeping the models already built), or "build" (absent, broken, or of another source, size or
    rank, other baked LoRAs or shards). `build_for`: (target, toolkit, LoRA rank, baked LoRAs as _pack_baked, shards
    per branch)."""
    target, toolkit, lora_rank, baked, shards = build_for
    if not (d / MANIFEST).is_file():
        return "build"
    try:
        pack = (load_pack if kind == DIT_KIND else load_vae_pack)(d, check=True)
    except PackError as e:
        log.info("%s: rebuilt (%s)", d, e)
        return "build"
    m = pack.manifest
    if m.get("source", {}).get("sha256") != source_sha or tuple(int(m["resolution"][k]) for k in ("width", "height")) \
            != tuple(size) or (kind == DIT_KIND and (m.get("dtype") != "fp16" or pack.geometry.lora_rank != lora_rank
                               or _pack_baked(m) != baked or shard_count(m) != shards)):
        return "build"
    if target == "none":
        return "build" if onnx_omitted(m) else "nothing"
    if not onnx_omitted(m):
        return "compile"
    return "nothing" if all(_compiled(b, target, toolkit) for b in m["branches"]) else "build"


def _compiled(entry: dict, target: str, toolkit) -> bool:
    """A branch entry, and each of its shards, compiled for `target` by `toolkit`."""
    parts = [entry, *(entry.get("shards") or {}).get("parts", ())]
    return all(isinstance(e.get("rknn"), dict) and e["rknn"].get("target") == target
               and e["rknn"].get("toolkit") == toolkit for e in parts)


def _pack_baked(manifest: dict) -> tuple:
    """A DiT pack's baked LoRAs as a build compares them: ((name, strength), ...) in order."""
    return tuple((b.get("name"), float(b.get("strength", 0))) for b in manifest.get("lora", {}).get("baked", []))


def _lora_records(loras) -> list:
    """bundle.json's "lora": per baked LoRA its file's name, strength and sha256 (BundleError for a missing file)."""
    out = []
    for u in loras:
        p = Path(u.path).expanduser()
        if not p.is_file():
            raise BundleError(f"--lora {u.path}: no such file")
        out.append({"name": u.label, "strength": float(u.strength), "sha256": file_sha256(p)})
    return out


def _previous_lora(out: Path):
    """The "lora" of the bundle.json already at `out` (None when there is none or it is unreadable)."""
    try:
        return json.loads((out / BUNDLE_JSON).read_text()).get("lora", [])
    except (OSError, ValueError, AttributeError, RecursionError):
        return None


def _kept_encoder(d: Path, src: _Sources) -> bool:
    if not (d / MANIFEST).is_file():
        return False
    try:
        m = load_encoder_pack(d, check=True).manifest
    except EncoderPackError as e:
        log.info("%s: rebuilt (%s)", d, e)
        return False
    s = m.get("sources", {})
    return all(s.get(n, {}).get("sha256") == src.sha(n) for n in ("text_encoder", "dit"))


def build_bundle(models_dir, resolutions, target: str, out_dir, *, toolkit_venv=None, jobs: int = 1,
                 per_worker: int = 1, overwrite: bool = False, progress=None, overrides=None,
                 lora_rank: int = 0, loras=(), sampling: dict | None = None, shards: int = 1) -> dict:
    """Build (or complete) the bundle at `out_dir` from a ComfyUI-style models folder: per size (width, height) in
    `resolutions` an FP16 DiT pack (LoRA-ready at `lora_rank` R > 0) and a VAE pack, compiled for `target` (ONNX
    graphs then removed), the encoder pack, then bundle.json; -> bundle.json's content. A part already complete for
    these sources, size, target, toolkit and LoRA rank is kept (a run that stopped resumes); `progress` is a
    models.commands.progress.Progress. The sizes a bundle already at `out_dir` holds stay in it, after the ones
    asked for (made to match the sources, target and rank); with `overwrite` they are removed instead: no part
    folder is left that bundle.json does not list. `loras` ([models.lora.LoraUse]): baked into every DiT pack as
    `anima-models pack --lora` bakes them (a pack baked with other LoRAs, or files whose sha256 changed since the
    last bundle.json, is rebuilt). `sampling` (models/packs/sampling.py): what every DiT pack and bundle.json record as
    the settings of the model (None: none recorded). `shards`: every DiT pack also as that many shard graphs per
    branch (`anima-models pack --shards`, cuts chosen by the board model at its size), compiled with the rest."""
    if target not in TARGETS:
        raise BundleError(f"target {target!r}: choose one of {', '.join(TARGETS)}")
    asked = list(dict.fromkeys(tuple(r) for r in resolutions))
    if not asked:
        raise BundleError("no --resolution: give at least one image size, e.g. --resolution 512x512")
    _check_dit_options(lora_rank, shards)
    paths = resolve_models(models_dir, overrides)
    src = _Sources(paths)
    lora = _lora_records(loras)
    out = _bundle_folder(out_dir, asked, overwrite)
    previous = _previous_lora(out)
    baked = _pack_baked({"lora": {"baked": lora}}) if previous in (None, lora) else ("changed",)
    toolkit = _toolkit_for(target, toolkit_venv)
    steps = _Steps(progress)
    sizes = _bundle_sizes(out, asked, overwrite, steps)
    out.mkdir(parents=True, exist_ok=True)
    (out / BUNDLE_JSON).unlink(missing_ok=True)          # written last: until then this is not a bundle
    t0 = time.monotonic()
    for size in sizes:
        for rel, kind in zip(part_dirs(size), (DIT_KIND, VAE_KIND)):
            steps.step(rel)
            note = _branch_pack_part(out / rel, kind, size, paths, src, (target, toolkit, lora_rank, baked, shards),
                                     overwrite, steps, (toolkit_venv, jobs, per_worker), loras)
            if kind == DIT_KIND and record_sampling(out / rel, sampling) and note.startswith("kept"):
                note = "kept, its sampling record changed"
            steps.done(note)
    steps.step(ENCODER_DIR)
    if _kept_encoder(out / ENCODER_DIR, src):
        steps.done("kept (complete)")
    else:
        build_encoder_pack(paths.text_encoder, paths.dit, paths.qwen_tokenizer, paths.t5_tokenizer,
                           out / ENCODER_DIR, overwrite=overwrite)
        steps.done("built")
    data = {
        "schema": SCHEMA_VERSION, "kind": BUNDLE_KIND, "target": target, "toolkit": toolkit,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tools": tool_versions(),
        "sizes": {size_key(s): {"dit": _part_entry(out, part_dirs(s)[0], DIT_KIND),
                                "vae": _part_entry(out, part_dirs(s)[1], VAE_KIND)} for s in sizes},
        "encoder": _part_entry(out, ENCODER_DIR, ENCODER_KIND), "lora_rank": lora_rank, "lora": lora,
        "shards": shards, **({"sampling": dict(sampling)} if sampling is not None else {}),
        "sources": {n: {"name": getattr(paths, n).name, "sha256": src.sha(n)} for n in ("dit", "text_encoder", "vae")},
        "build_s": round(time.monotonic() - t0, 1),
    }
    atomic_write(out / BUNDLE_JSON, json.dumps(data, indent=1) + "\n")
    return data


def _check_dit_options(lora_rank: int, shards) -> None:
    """--lora-rank R in LORA_RANKS; --shards N in 1..MAX_SHARDS, not with a LoRA rank (shards take no low-rank inputs)."""
    if lora_rank and lora_rank not in LORA_RANKS:
        raise BundleError(f"--lora-rank {lora_rank}: must be in 0..{LORA_RANKS[-1]}")
    try:
        check_shards(shards)
    except (TypeError, ValueError) as e:
        raise BundleError(f"--shards {shards}: {e}") from None
    if shards > 1 and lora_rank:
        raise BundleError(f"--shards {shards} with --lora-rank {lora_rank}: a DiT pack is sharded or LoRA-ready, not "
                          "both; drop --shards for LoRAs per job (or bake them with --lora), or drop --lora-rank")


def _bundle_folder(out_dir, sizes: list, overwrite: bool) -> Path:
    """The bundle's folder, refused when it is a file or a non-empty folder of other things (unless `overwrite`)."""
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise BundleError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / BUNDLE_JSON).is_file() and not overwrite:
        known = {ENCODER_DIR, *(d for s in sizes + _part_sizes(out) for d in part_dirs(s))}
        strangers = sorted(p.name for p in out.iterdir() if p.name not in known and not p.name.startswith("."))
        if strangers:
            raise BundleError(f"{out}: a non-empty folder that is not a bundle (holds {', '.join(strangers[:5])}); "
                              "choose another --out")
    return out


PART_DIR = re.compile(r"(?:dit|vae)-([0-9]{1,5})x([0-9]{1,5})")


def _part_sizes(out: Path) -> list:
    """The image sizes of the part folders (dit-WxH, vae-WxH) at `out`, bundle.json's order first."""
    if not out.is_dir():
        return []
    found = set()
    for p in out.iterdir():
        m = PART_DIR.fullmatch(p.name)
        if m and p.is_dir():
            try:
                found.add(parse_resolution(f"{m[1]}x{m[2]}"))
            except ValueError:                   # not a size a bundle builds: left to the stranger check
                pass
    try:
        listed = [parse_resolution(k) for k in json.loads((out / BUNDLE_JSON).read_text())["sizes"]]
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        listed = []
    return [s for s in dict.fromkeys(listed + sorted(found)) if s in found]


def _bundle_sizes(out: Path, asked: list, overwrite: bool, steps: "_Steps") -> list:
    """The sizes the bundle at `out` will list: those it holds already in their order (its first, the default of a
    run folder made from it, stays the default), then the new ones asked for; with `overwrite` only those asked for,
    and the folders of the others removed (a part bundle.json does not list would still be copied)."""
    import shutil
    held = _part_sizes(out)
    earlier = [s for s in held if s not in asked]
    if earlier and overwrite:
        for s in earlier:
            for rel in part_dirs(s):
                shutil.rmtree(out / rel, ignore_errors=True)
        steps.say(f"removed {', '.join(map(size_key, earlier))} (--overwrite: only the sizes asked for stay)")
        return asked
    if earlier:
        steps.say(f"keeping {', '.join(map(size_key, earlier))} (already in the bundle; --overwrite removes it)")
    sizes = held + [s for s in asked if s not in held]
    steps.parts(2 * len(sizes) + 1)
    return sizes


def _toolkit_for(target: str, toolkit_venv):
    """The rknn-toolkit2 version that compiles for `target` (None for target none, which compiles nothing)."""
    if target == "none":
        return None
    from models.rknn.client import ToolkitError
    from models.rknn.compile import toolkit_version
    try:
        return toolkit_version(toolkit_venv)
    except ToolkitError as e:
        raise BundleError(str(e.args[0])) from None


class _Steps:
    """The bundle's parts as steps of a models.commands.progress.Progress (none: silent)."""

    def __init__(self, progress):
        self.progress = progress

    def step(self, name: str) -> None:
        if self.progress is not None:
            self.progress.start(name)

    def counter(self, unit: str):
        progress = self.progress
        return None if progress is None else (lambda done, total: progress.count(done, total, unit))

    def done(self, note: str = "") -> None:
        if self.progress is not None:
            self.progress.finish(note)

    def say(self, text: str) -> None:
        if self.progress is not None:
            print(f"{self.progress.label}: {text}", file=self.progress.stream, flush=True)
        else:
            log.info("%s", text)

    def parts(self, n: int) -> None:
        if self.progress is not None:
            self.progress.parts = max(1, n)


def _branch_pack_part(d: Path, kind: str, size: tuple, paths, src: _Sources, build_for: tuple, overwrite: bool,
                      steps: _Steps, compile_with: tuple, loras=()) -> str:
    """One size's DiT or VAE pack at `d`, kept, built and/or compiled as it needs (ONNX then removed); what was done.
    `build_for`: (target, toolkit, LoRA rank and baked LoRAs of a DiT pack); `loras`: the LoRAs to bake; `compile_with`: (toolkit venv, jobs, per_worker)."""
    source = "dit" if kind == DIT_KIND else "vae"
    target, toolkit, lora_rank, _, shards = build_for
    todo = _existing_branch_pack(d, kind, src.sha(source), size, build_for)
    if todo == "nothing":
        return "kept (complete)"
    if todo == "build" and kind == DIT_KIND:
        build_pack(paths.dit, d, size, "fp16", overwrite=overwrite, progress=steps.counter("blocks"),
                   lora_rank=lora_rank, loras=list(loras), shards=shards)
    elif todo == "build":
        build_vae_pack(paths.vae, d, size, overwrite=overwrite)
    if target == "none":
        return "built"
    venv, jobs, per_worker = compile_with
    _compile(d, target, venv, jobs, per_worker, steps.counter("models compiled"))
    freed = omit_onnx(d)
    return f"compiled, {freed / 1e6:.1f} MB of ONNX removed"


def _compile(pack: Path, target: str, venv, jobs: int, per_worker: int, progress) -> None:
    from models.rknn.compile import compile_pack
    report = compile_pack(pack, target=target, jobs=jobs, venv=venv, per_worker=per_worker, progress=progress)
    if report["failed"]:
        bad = [b for b in report["branches"] if b["status"] == "failed"]
        raise BundleError(f"{pack}: {len(bad)} model(s) failed to compile, e.g. {bad[0]['name']}: {bad[0]['error']}; "
                          "run `anima-models bundle` again to retry them (the built ones are kept)")


def total_bytes(data: dict) -> int:
    return sum(p["bytes"] for s in data["sizes"].values() for p in s.values()) + data["encoder"]["bytes"]
