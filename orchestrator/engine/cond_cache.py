"""The conditioning cache: a prompt pair's contexts kept in the run folder, so a job whose prompts were encoded before
starts no encoder (ComfyUI's execution cache skips an unchanged CLIPTextEncode node the same way).

    RUN/cache/cond/<key>.npz      cond [S, Dc] f32, uncond [S, Dc] f32, meta (JSON: token counts, checksum)

The key is a sha256 of everything the encoder's answer depends on: both texts as written (their `(word:1.2)` weights
are part of the text the encoder parses), their conditioning operations (a zeroed or averaged context is never a
plain one's), the context rows, the job's LoRAs with their strengths and their files'
identity, and the encoder's own identity (its settings and the size, mtime and inode of each of its files: a
changed file is a new encoder). An entry is written through atomic_write (write, fsync, rename), bounded by
`[stage.orchestrator] cond_cache_mb` (0: off), the least recently used dropped first (its mtime is its last use). An
entry that does not read back whole (shape, dtype, finite, checksum) is removed and never trusted.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.base.durable import atomic_write, is_temporary

log = logging.getLogger(__name__)

CACHE_DIR = Path("cache") / "cond"      # under the run folder
SUFFIX = ".npz"


@dataclass(frozen=True)
class CondEntry:
    """One prompt pair's encoding: what ENCODED carries (the contexts and T5 token counts)."""
    cond: np.ndarray            # [S, Dc] f32
    uncond: np.ndarray          # [S, Dc] f32
    tokens_cond: int
    tokens_uncond: int
    truncated: bool


def _file_ids(paths) -> list:
    """(path, size, mtime_ns, inode) of each file, a folder's files included (sorted): a file's identity without
    reading it."""
    out = []
    for p in paths:
        p = Path(p)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            st = f.stat()
            out.append([str(f), st.st_size, st.st_mtime_ns, st.st_ino])
    return out


def encoder_identity(cfg) -> str:
    """A digest of the encoder stage as configured: its settings and its files' identities (OSError: a file is
    gone; the stage would not start either)."""
    from stages.preflight import ENCODER_PARTS, encoder_files, encoder_pack_path
    settings = dict(cfg.stage_settings("encoder"))
    if settings.get("backend", "torch") == "onnx":
        files = [encoder_pack_path(cfg)]
    else:
        found = encoder_files(cfg)
        files = [getattr(found, k) for k in ENCODER_PARTS]
    blob = json.dumps({"settings": settings, "files": _file_ids(files)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def lora_identity(choices, models_dir) -> list:
    """The job's LoRAs as the encoder sees them: name, strengths, and their files' identities."""
    from models.lora.choice import lora_uses
    uses = lora_uses(choices, models_dir)
    return [[c.name, c.strength, c.te_strength, _file_ids([u.path])] for c, u in zip(choices, uses)]


def cache_key(prompt: str, negative: str, rows: int, loras: list, encoder: str, entries: tuple = (None, None)) -> str:
    """sha256 (hex) of one ENCODE's inputs: texts, rows, lora_identity(...), encoder_identity(...) and the prompt's
    and the negative's conditioning operations (protocol.prompt.CondEntry, None: plain; a plain pair's key is the
    same as before they existed)."""
    what = {"prompt": prompt, "negative": negative, "rows": rows, "loras": loras, "encoder": encoder}
    if any(e is not None for e in entries):
        what["entries"] = [None if e is None else e.to_dict() for e in entries]
    blob = json.dumps(what, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def _checksum(cond: np.ndarray, uncond: np.ndarray) -> str:
    h = hashlib.sha256(np.ascontiguousarray(cond).tobytes())
    h.update(np.ascontiguousarray(uncond).tobytes())
    return h.hexdigest()


class CondCache:
    """The cache folder, bounded to `limit_mb` (0: off: get() finds nothing, put() keeps nothing)."""

    def __init__(self, run_root: Path, limit_mb: float):
        self.dir = Path(run_root) / CACHE_DIR
        self.limit_bytes = int(limit_mb * 2**20)

    @property
    def on(self) -> bool:
        return self.limit_bytes > 0

    def _path(self, key: str) -> Path:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"cache key {key!r:.80} is not a sha256 hex digest")
        return self.dir / f"{key}{SUFFIX}"

    def has(self, key: str) -> bool:
        """Whether an entry is kept under `key` (not read: a job's own get() still checks it, and removes a bad one)."""
        return self.on and self._path(key).is_file()

    def get(self, key: str, shape: tuple) -> CondEntry | None:
        """The entry when whole and of `shape` ([S, Dc]), its use recorded (mtime); else None (a bad one removed)."""
        if not self.on:
            return None
        path = self._path(key)
        try:
            with np.load(path, allow_pickle=False) as z:
                cond, uncond, meta = z["cond"], z["uncond"], json.loads(bytes(z["meta"]).decode())
            for name, a in (("cond", cond), ("uncond", uncond)):
                if a.dtype != np.float32 or tuple(a.shape) != tuple(shape) or not np.isfinite(a).all():
                    raise ValueError(f"{name} is {a.dtype} {list(a.shape)}, expected float32 {list(shape)}, finite")
            if meta.get("sha256") != _checksum(cond, uncond):
                raise ValueError("the contexts' checksum differs from the one written")
            entry = CondEntry(cond, uncond, int(meta["tokens_cond"]), int(meta["tokens_uncond"]),
                              bool(meta["truncated"]))
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - whatever a torn or foreign file raises, it is not trusted
            log.warning("conditioning cache entry %s is unusable (%s: %s): removed", path.name, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)                   # its last use: the eviction order
        except OSError:
            pass
        return entry

    def put(self, key: str, entry: CondEntry) -> None:
        """Keep `entry` (durably), then evict the least recently used entries beyond the bound. Best effort: a full
        disk costs the cache, never the job."""
        if not self.on:
            return
        meta = {"tokens_cond": entry.tokens_cond, "tokens_uncond": entry.tokens_uncond,
                "truncated": entry.truncated, "sha256": _checksum(entry.cond, entry.uncond)}
        buf = io.BytesIO()
        np.savez(buf, cond=np.ascontiguousarray(entry.cond, dtype=np.float32),
                 uncond=np.ascontiguousarray(entry.uncond, dtype=np.float32),
                 meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
        if buf.tell() > self.limit_bytes:
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self._path(key), buf.getvalue())
            self.evict()
        except OSError as e:
            log.warning("conditioning cache: %s not kept: %s", key[:12], e)

    def evict(self) -> None:
        """Oldest use first, entries go until the folder is within the bound."""
        entries = []
        for p in self.dir.iterdir():
            if p.suffix == SUFFIX and not is_temporary(p.name):
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime_ns, st.st_size, p))
        total = sum(size for _, size, _ in entries)
        for _, size, p in sorted(entries):
            if total <= self.limit_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size


def all_cached(cfg, cache: CondCache, loras, pairs) -> bool:
    """Whether every (prompt, negative, rows, entries) of `pairs`, encoded with the job's `loras`, is kept: the job
    would start no encoder. False when it cannot be known here (cache off, a remote encoder, a file gone)."""
    if not cache.on or cfg.is_remote("encoder") or not pairs:
        return False
    try:
        enc, lid = encoder_identity(cfg), lora_identity(loras, cfg.models_dir)
    except Exception:  # noqa: BLE001 - OSError, ModelsDirError: the job's own flow reports it
        return False
    return all(cache.has(cache_key(p, n, rows, lid, enc, entries)) for p, n, rows, entries in pairs)
