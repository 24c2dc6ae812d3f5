"""How much the upload folders (RUN/input, temp, output: ComfyUI's `type`s) hold, their quota and their pruning.

stage.http.max_uploads_mb bounds the folders together: a file past it is refused (UploadsFull, HTTP 507) before it is
written. The sum is kept as a running total, walked again when it says full and every USAGE_FRESH_S (the CLI writes
and `prune` removes files too), so an upload costs no walk of the folders. `orchestrator prune --older-than AGE`
removes the uploads unchanged for AGE (a job keeps its own copy of its inputs at submit; img2img's kept images are
touched when used again); `orchestrator doctor` prints their size.
"""
from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

KINDS = ("input", "temp", "output")              # ComfyUI's upload types; `input` by default
USAGE_FRESH_S = 30.0                             # the running total is walked again after this

_usage: dict[str, tuple[int, float]] = {}        # run folder -> (upload bytes, monotonic time walked)
_lock = threading.Lock()


class UploadsFull(ValueError):
    """The upload folders would pass their quota (stage.http.max_uploads_mb; HTTP 507): the message says how to
    make room."""


def upload_files(run_root: Path):
    """(path, lstat) of every regular file in RUN/input, temp and output (no link followed, none listed)."""
    base = Path(os.path.realpath(run_root))
    for kind in KINDS:
        for top, dirs, names in os.walk(base / kind):        # os.walk descends into no linked folder
            for n in names:
                try:
                    st = os.lstat(os.path.join(top, n))
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield Path(top) / n, st


def uploads_size(run_root: Path) -> tuple[int, int]:
    """(files, bytes) in the upload folders."""
    files = total = 0
    for _, st in upload_files(run_root):
        files, total = files + 1, total + st.st_size
    return files, total


def check_room(run_root: Path, adding: int, quota_bytes: int | None) -> None:
    """UploadsFull when `adding` bytes more would pass the quota (None or 0: no quota). The folders are walked when
    the running total says full and every USAGE_FRESH_S (others write and prune them too), not at every upload;
    uploads written at the same moment may pass the quota by one upload each."""
    if not quota_bytes:
        return
    key = os.path.realpath(run_root)
    with _lock:
        used, walked = _usage.get(key, (None, 0.0))
    if used is None or used + adding > quota_bytes or time.monotonic() - walked > USAGE_FRESH_S:
        used, walked = uploads_size(run_root)[1], time.monotonic()
    full = used + adding > quota_bytes
    with _lock:
        _usage[key] = (used if full else used + adding, walked)
    if full:
        raise UploadsFull(f"the upload folders (RUN/input, temp, output) hold {used / 1e6:,.1f} MB; this "
                          f"{adding / 1e6:,.1f} MB would pass stage.http.max_uploads_mb = {quota_bytes // 2**20}: "
                          "remove old uploads (orchestrator prune --older-than 7d) or raise it in pipeline.toml")


def prune_uploads(run_root: Path, older_than_s: float, now: float | None = None) -> list[tuple[Path, int]]:
    """Remove the uploads not changed for `older_than_s` (an img2img request's kept image is touched when it is used
    again) -> (path, bytes) of each. No job needs them: a job keeps its own copy of its inputs at submit."""
    cutoff = (time.time() if now is None else now) - older_than_s
    removed = []
    for path, _ in list(upload_files(run_root)):
        try:
            st = os.lstat(path)                      # as it is now: one used again meanwhile stays
            if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                os.unlink(path)
                removed.append((path, st.st_size))
        except FileNotFoundError:
            continue
    return removed
