"""Pack manifests: THE reader, writer and file hash of every pack kind (DiT packs models/packs/pack.py, VAE packs
models/vae/pack.py, encoder packs models/text/encoder_pack.py; `anima-models compile` adds its rknn entries), the
manifest's fields typed as schema records (models/base/schema.py).

    PACK/manifest.json   {"schema": 1, "kind": KIND, "created", "tools", "source" or "sources", ...,
                          "branches": [{onnx, sha256, bytes, inputs, outputs, rknn?}]
                          or "files": [{file, sha256, bytes}]}

A manifest is written last (atomically) into a folder built as a whole (models.base.durable.building_folder): a folder
without one is not a pack. A reader checks the folder, the JSON, the kind and the schema version here, the fields
against the kind's record, and (with `check`) every file it vouches for against its sha256.
"""
import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

from models.base.durable import atomic_write
from models.base.lazy import import_target
from models.sampling.bounds import Cfg, Steps
from models.base.schema import Int, Record, SchemaError, Text, Wording

MANIFEST = "manifest.json"
HASH_CHUNK = 8 * 1024 * 1024          # bytes per read when hashing


def file_sha256(path) -> str:
    """The sha256 of a file (hex), read in HASH_CHUNK pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(HASH_CHUNK)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)


# A file whose sha256 was checked is not read again while its (size, mtime_ns, inode) stay the same: a memo file in
# the user's cache folder (ANIMA_HASH_MEMO names another; empty: no memo). Only files last changed over
# MEMO_SETTLED_NS ago are remembered (git's "racily clean" rule): a file rewritten within the clock tick of its
# check keeps its mtime, and such a change must not hide behind the memo.
MEMO_ENV = "ANIMA_HASH_MEMO"
MEMO_SETTLED_NS = 2_000_000_000
MEMO_ENTRIES = 4096                  # the oldest remembered files are dropped beyond this


def memo_path() -> Path | None:
    v = os.environ.get(MEMO_ENV)
    if v is not None:
        return Path(v) if v else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "anima-npu" / "sha256-memo.json"


class HashMemo:
    """file_sha256 remembered by (absolute path, size, mtime_ns, inode); `save()` writes what was learned (best
    effort, atomically: processes that check at once lose entries to each other, never tear the file)."""

    def __init__(self, path: Path | None = None):
        self.path = memo_path() if path is None else path
        self.entries: dict = {}
        self.changed = False
        if self.path is not None:
            try:
                data = json.loads(self.path.read_text())
                self.entries = {k: v for k, v in data.items() if isinstance(v, list) and len(v) == 4}
            except (OSError, ValueError, AttributeError):
                pass

    def sha256(self, path) -> str:
        p = Path(path).resolve()
        st = p.stat()
        ident = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self.entries.get(str(p))
        if hit is not None and hit[:3] == ident:
            return hit[3]
        sha = file_sha256(p)
        if self.path is not None and time.time_ns() - st.st_mtime_ns > MEMO_SETTLED_NS:
            self.entries.pop(str(p), None)
            self.entries[str(p)] = ident + [sha]
            self.changed = True
        return sha

    def save(self) -> None:
        if not (self.changed and self.path is not None):
            return
        keep = dict(list(self.entries.items())[-MEMO_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, json.dumps(keep))
        except OSError:
            pass                     # no memo: the next check reads the files again


def data_sha256(data) -> str:
    """The sha256 (hex) of bytes about to be written: the same digest file_sha256 gives for the file."""
    return hashlib.sha256(data).hexdigest()


def tool_versions() -> dict:
    import numpy
    out = {"python": platform.python_version(), "numpy": numpy.__version__}
    for name in ("onnx", "onnxruntime"):
        try:
            out[name] = import_target(name).__version__
        except ImportError:
            out[name] = None
    try:
        from importlib.metadata import version
        out["anima-npu"] = version("anima-npu")
    except Exception:  # not installed as a distribution (running from a source tree)
        out["anima-npu"] = None
    return out


def manifest_header(kind: str, schema: int) -> dict:
    """The fields every manifest opens with: schema, kind, created (UTC), the tools that built it."""
    return {"schema": schema, "kind": kind, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tools": tool_versions()}


def source_entry(path, sha256: str | None = None) -> dict:
    """What a pack was built from: path, name and, for a file, its sha256 (hashed here unless given) and size."""
    p = Path(path)
    out = {"path": os.path.abspath(os.fspath(p)), "name": p.name}
    if not p.is_dir():
        out.update(sha256=sha256 or file_sha256(p), bytes=p.stat().st_size)
    return out


def existing_sources(out, error: Callable[[str], Exception], *keys: str):
    """What the pack already at `out` was built from: the sha256 of each source `keys` names ("source" of a DiT or
    VAE pack, "sources.text_encoder" ...), a tuple; None when `out` is absent or an empty folder; "unreadable" for
    a manifest that does not say. `error` for a file, or a non-empty folder that is not a pack."""
    out = Path(out)
    if not out.exists():
        return None
    if not out.is_dir():
        raise error(f"{out}: exists and is not a folder")
    if not (out / MANIFEST).is_file():
        if any(out.iterdir()):
            raise error(f"{out}: a non-empty folder that is not a pack; choose another output folder")
        return None
    try:
        m = json.loads((out / MANIFEST).read_text())
        found = []
        for key in keys:
            entry = m
            for part in key.split("."):
                entry = entry[part]
            found.append(str(entry["sha256"]))
        return tuple(found)
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable"


class ManifestError(ValueError):
    """A manifest.json that cannot be read, or lacks the part a caller picks out (the message names the file)."""


def manifest_json(folder) -> dict:
    """PACK/manifest.json as plain data, without any kind's checks: what the accessors below pick from (a pack's
    loader reads it with read_manifest instead). ManifestError when it is missing, not JSON or not an object."""
    return _load_json(Path(folder) / MANIFEST, ManifestError)


def _load_json(path: Path, error: Callable[[str], Exception]) -> dict:
    """The manifest file as a JSON object, or `error` naming it: unreadable, not JSON, not an object."""
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise error(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(m, dict):
        raise error(f"{path}: not a manifest (a JSON {type(m).__name__}, not an object)")
    return m


def _part(m: dict, key: str, path) -> dict:
    v = m.get(key)
    if not isinstance(v, dict):
        raise ManifestError(f"{Path(path) / MANIFEST}: manifest field {key!r} is missing or not an object")
    return v


def quant_info(manifest: dict) -> dict | None:
    """A W8A8 pack's "quant" table (scheme, INT8 layer names, smoothing, the quantizer dataset's file), None for a
    float pack; ManifestError when it is there but malformed."""
    q = manifest.get("quant")
    if q is None:
        return None
    ds = q.get("dataset") if isinstance(q, dict) else None
    if not isinstance(q, dict) or q.get("scheme") != "w8a8" or not isinstance(q.get("int8"), list) \
            or not isinstance(ds, dict) or not isinstance(ds.get("file"), str) or not isinstance(ds.get("sha256"), str):
        raise ManifestError("manifest field 'quant' must be a table with scheme 'w8a8', a list 'int8' and a "
                            "'dataset' {file, sha256}")
    return q


def branch_int8(branch: dict) -> list:
    """The output names of a branch graph's INT8 MatMuls (empty for a float branch)."""
    names = branch.get("int8") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ManifestError(f"branch {branch.get('onnx')!r}: manifest field 'int8' must be a list of tensor names")
    return names


def sampling_info(manifest: dict) -> dict | None:
    """The sampling settings a pack or bundle records for the model it holds (`sampling`: steps, cfg, sampler,
    scheduler; `anima-models pack|bundle --sampling`, models/packs/sampling.py), None when it records none (a job
    then takes prompt.json's defaults). ManifestError when it is there but malformed."""
    s = manifest.get("sampling")
    if s is None:
        return None
    try:
        return SamplingRecord.from_data(s, where="sampling").to_dict()
    except SchemaError as e:
        raise ManifestError(e.detail) from None


def pack_sampling(folder) -> dict | None:
    """sampling_info of the pack at `folder`."""
    return sampling_info(manifest_json(folder))


def pack_quant(folder) -> dict | None:
    """quant_info of the pack at `folder`."""
    return quant_info(manifest_json(folder))


def toolkit_release(folder) -> str | None:
    """The rknn-toolkit2 release that compiled a pack (`rknn.toolkit`); None when the manifest records none (not
    compiled). ManifestError for an unreadable manifest."""
    rk = manifest_json(folder).get("rknn")
    want = rk.get("toolkit") if isinstance(rk, dict) else None
    return str(want) if want else None


def encoder_weight_shapes(folder, parts=("adapter", "qwen3")) -> tuple:
    """({key: shape}, ...) of the weights each named graph of an encoder pack lists (`graphs.PART.weights`: key ->
    [file, offset, shape, transposed]; a transposed weight given back in the checkpoint's [out, in] order).
    ManifestError when the manifest lists none (an encoder pack exported before LoRA support)."""
    graphs = _part(manifest_json(folder), "graphs", folder)
    out = []
    try:
        for part in parts:
            w = graphs[part]["weights"]
            out.append({k: tuple(reversed(shape)) if transposed else tuple(shape)
                        for k, (_, _, shape, transposed) in w.items()})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ManifestError(f"{Path(folder) / MANIFEST}: the graphs list no weights ({type(e).__name__}: {e})") \
            from None
    return tuple(out)


def pack_shape_fields(folder) -> tuple[dict, dict, dict]:
    """(config, geometry, shards) of a DiT pack: the widths, the tokens and the shard plan (`{}` unsharded).
    ManifestError when config or geometry is missing."""
    m = manifest_json(folder)
    shards = m.get("shards") or {}
    if not isinstance(shards, dict):
        raise ManifestError(f"{Path(folder) / MANIFEST}: manifest field 'shards' is not an object")
    return _part(m, "config", folder), _part(m, "geometry", folder), shards


def sharded_branches(folder) -> list[dict]:
    """The branch entries of a pack cut into shards (each with its `shards.parts`); [] for a pack without shards."""
    m = manifest_json(folder)
    shards = m.get("shards") or {}
    if not isinstance(shards, dict) or shards.get("n", 1) <= 1:
        return []
    branches = m.get("branches")
    if not isinstance(branches, list):
        raise ManifestError(f"{Path(folder) / MANIFEST}: manifest field 'branches' is not a list")
    return [b for b in branches if isinstance(b, dict) and b.get("shards")]


def pack_resolution(folder) -> tuple[int, int]:
    """(width, height) in pixels a pack was built for (`resolution`). ManifestError when it records none."""
    r = manifest_json(folder).get("resolution")
    try:
        return int(r["width"]), int(r["height"])
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{Path(folder) / MANIFEST}: no resolution on record ({type(e).__name__}: {e})") from None


def peak_model_bytes(folder) -> int:
    """Bytes a DiT pack holds in memory at once at most: its host weights file plus its largest branch model (the
    compiled .rknn where there is one). ManifestError when the manifest does not say; OSError from the host file."""
    m = manifest_json(folder)
    try:
        host = (Path(folder) / m["host"]["file"]).stat().st_size
        big = max((b.get("rknn") or {}).get("bytes") or b.get("bytes") or 0 for b in m["branches"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ManifestError(f"{Path(folder) / MANIFEST}: no host file or branch sizes ({type(e).__name__}: {e})") \
            from None
    return host + big


def write_manifest(folder, manifest: dict) -> Path:
    """PACK/manifest.json, durably and atomically (a reader, or a resumed compile, never sees half of it)."""
    return atomic_write(Path(folder) / MANIFEST, json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")


# ---- the records -------------------------------------------------------------------------------------------------

class ManifestWording(Wording):
    """A manifest's words: `manifest field 'host' is missing`, `manifest field 'resolution.width': ...`."""

    def say(self, path, p):
        field, detail, code = super().say(path, p)
        if code == "missing_field":
            return "", f"manifest field {field!r} is missing", code
        return "", f"manifest field {field!r}: {detail}", code


MANIFEST_WORDS = ManifestWording()


class ManifestRecord(Record, frozen=True, forbid_unknown_fields=False):
    """A manifest part: the fields a reader relies on are typed; others (created, tools, reports) are the builder's
    record and pass."""

    WORDING: ClassVar = MANIFEST_WORDS


class SamplingRecord(ManifestRecord, frozen=True, forbid_unknown_fields=True):
    """`sampling`: the settings a job takes when it sets none (KSampler's steps, cfg, sampler_name, scheduler)."""
    steps: Steps
    cfg: Cfg
    sampler: Text(64, 1)
    scheduler: Text(64, 1)

    def __post_init__(self):
        from models.sampling.sampler import SAMPLER_NAMES, SCHEDULER_NAMES
        for name, allowed in (("sampler", SAMPLER_NAMES), ("scheduler", SCHEDULER_NAMES)):
            if getattr(self, name) not in allowed:
                raise SchemaError(name, f"{name} {getattr(self, name)!r:.80} is not one of {', '.join(allowed)}")


class FileEntry(ManifestRecord, frozen=True):
    file: str
    sha256: str
    bytes: Int(0, 2**62)


class BranchEntry(ManifestRecord, frozen=True):
    """One model of a pack: a DiT branch (block, kind) or a VAE model (name); rknn: its compiled file, once built.
    File names are checked by models.packs.pack.pack_member (they must stay inside the pack folder)."""
    onnx: Any
    sha256: str
    block: Int(0, 1023) | None = None
    kind: str = ""
    name: str | None = None
    inputs: list = []
    outputs: list = []
    rknn: dict | None = None


class Manifest(ManifestRecord, frozen=True):
    """What every manifest holds (the compile step reads only this; each kind's record requires its schema)."""
    schema: int | None = None
    kind: str = ""
    branches: list[BranchEntry] = []


def read_manifest(folder, record: type[ManifestRecord], error: Callable[[str], Exception], *, what: str,
                  kind: str | None = None, default_kind: str | None = None, schema: int | None = None,
                  hint: str = "", rebuild: str = "rebuild the pack", kind_what: str = "") -> tuple[dict, Any]:
    """(the manifest as plain data, as `record`) of the pack in `folder`, or `error(message)` naming the folder or
    the manifest and what is wrong: no folder, no manifest (an interrupted build), not JSON, another `kind` (one
    without a kind is `default_kind`), another `schema` version (`rebuild` says what to do), a field `record`
    refuses. `what` names the pack in messages ("VAE pack"; `kind_what` where another kind is refused), `hint` how to
    make one."""
    d = Path(folder)
    mpath = d / MANIFEST
    if not d.is_dir():
        raise error(f"{d}: no such {what} folder{hint}")
    if not mpath.is_file():
        raise error(f"{d}: not a complete {what} (no {MANIFEST}; a build may have been interrupted)")
    m = _load_json(mpath, error)
    got = m.get("kind", default_kind)
    if kind is not None and got != kind:
        name = kind_what or what
        article = "an" if name[:1].lower() in "aeiou" else "a"
        raise error(f"{mpath}: a {str(got)[:80]!r} folder, not {article} {name}{hint}")
    if schema is not None and m.get("schema") != schema:
        raise error(f"{mpath}: schema version {str(m.get('schema'))[:40]}, this code reads {schema}; {rebuild}")
    try:
        rec = record.from_data(m)
    except SchemaError as e:
        raise error(f"{mpath}: {e.detail}") from None
    return m, rec


def check_files(folder, files: Iterable[tuple[str, str, int | None]], error: Callable[[str], Exception], *,
                hashes: bool = True, hint: str = "") -> None:
    """`error` naming every file (relative path, sha256, size or None) that is missing, of another size, or (with
    `hashes`) whose sha256 differs from the manifest."""
    bad, memo = [], HashMemo() if hashes else None
    for rel, want, size in files:
        p = Path(folder) / rel
        if not p.is_file():
            bad.append(f"{rel} (missing)")
        elif size is not None and p.stat().st_size != size:
            bad.append(f"{rel} (size {p.stat().st_size}, manifest {size})")
        elif hashes and memo.sha256(p) != want:
            bad.append(f"{rel} (sha256 differs from the manifest)")
    if memo is not None:
        memo.save()
    if bad:
        raise error(f"{folder}: {len(bad)} file(s) differ from the manifest: {', '.join(bad)}{hint}")

