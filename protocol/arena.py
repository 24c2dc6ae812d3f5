"""Per-job shared-memory arena: POSIX shm files under /dev/shm, created and unlinked only by the orchestrator.

Ownership rules (see docs/architecture.md, "Protocol"):
- the owner (`Arena.create`) creates one segment per job, named `anima_<8 hex of the run dir>_<job>`, and unlinks it at
  job end (`close()` / leaving the `with` block) or at start-up through `reap(prefix, keep)`, which removes only
  regular files of its own user (/dev/shm is world-writable: anything else under the prefix is logged and left);
- stages `Arena.attach(name)`: they open the existing file and map it, never create, never unlink, and no resource
  tracker is involved (the file is opened directly, not through multiprocessing.shared_memory), so a killed stage
  leaks nothing.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import re
import stat
from typing import Any

import numpy as np

from protocol.tensors import DTYPES, TensorDesc, wire_dtype

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
ALIGN_BYTES = 64  # slot alignment (cache line; NPU DMA prefers >= 64)
FREE_MARGIN_BYTES = 64 * 2**20  # keep this much of /dev/shm free after an allocation
NAME_PREFIX = "anima_"
_JOB_RE = re.compile(r"\A[A-Za-z0-9_\-]{1,64}\Z")


class ArenaError(Exception):
    """Shared-memory trouble, said plainly (no space, missing segment, slot out of bounds)."""


def run_prefix(run_dir: str | os.PathLike) -> str:
    """Segment name prefix of a run directory: `anima_<8 hex>_` (a short hash of its absolute path)."""
    digest = hashlib.sha256(os.path.realpath(os.fspath(run_dir)).encode()).hexdigest()[:8]
    return f"{NAME_PREFIX}{digest}_"


def segment_name(run_dir: str | os.PathLike, job: str) -> str:
    if not _JOB_RE.match(job):
        raise ArenaError(f"job id {job!r} is not usable in a segment name (letters, digits, _ and -, at most 64)")
    return run_prefix(run_dir) + job


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def list_segments(prefix: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Names of existing segments that start with `prefix`."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def _not_ours(st: os.stat_result) -> str:
    """Why an lstat result is not a segment this user may touch ("" when it is one: a regular file we own)."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    return ""


def reap(prefix: str, keep: set[str], shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink segments named `prefix + job` whose job is not in `keep` (finished, failed or unknown jobs).

    Only regular files owned by this user are removed (lstat: links are never followed). /dev/shm is writable by
    everyone, so a directory, a link or another user's file named with the prefix is logged and left alone; nothing
    found there can stop the caller from starting."""
    removed = []
    for name in list_segments(prefix, shm_dir):
        if name[len(prefix):] in keep:
            continue
        path = os.path.join(shm_dir, name)
        try:
            why = _not_ours(os.lstat(path))
            if not why:
                os.unlink(path)        # a swap between the lstat and here can only make this fail (sticky /dev/shm)
                removed.append(name)
        except FileNotFoundError:
            continue
        except OSError as e:
            why = f"cannot remove it ({e.strerror})"
        if why:
            log.warning("left %s alone: %s (not a segment of this run)", path, why)
    if removed:
        log.info("reaped %d stale shm segment(s): %s", len(removed), ", ".join(removed))
    return removed


class SlotAllocator:
    """Bump allocator of aligned named slots inside [start, end) of an arena (the owner's, or a carved region)."""

    def __init__(self, start: int, end: int, arena_name: str = "", align: int = ALIGN_BYTES):
        self.start, self.end, self.align, self.arena_name = start, end, align, arena_name
        self.cursor = start
        self.slots: dict[str, TensorDesc] = {}

    def alloc(self, name: str, dtype: str, shape: tuple[int, ...]) -> TensorDesc:
        """A descriptor for a new slot `name` of dtype × shape (names are unique within an allocator)."""
        if name in self.slots:
            raise ArenaError(f"slot {name!r} is already allocated in {self.arena_name or 'this region'}")
        offset = -(-self.cursor // self.align) * self.align
        desc = TensorDesc(dtype, tuple(shape), slot=name, offset=offset)
        if offset + desc.nbytes > self.end:
            raise ArenaError(f"slot {name!r} ({desc.nbytes} bytes) does not fit in {self.arena_name or 'region'}: "
                             f"{self.end - offset} bytes left of {self.end - self.start}")
        self.cursor = offset + desc.nbytes
        self.slots[name] = desc
        return desc

    def remaining(self) -> tuple[int, int]:
        """(offset, nbytes) of the aligned unallocated tail, e.g. to hand over as DENOISE.scratch."""
        offset = min(-(-self.cursor // self.align) * self.align, self.end)
        return offset, self.end - offset


class Arena:
    """One mapped segment. Owners allocate slots; everyone reads and writes them through descriptors."""

    def __init__(self, name: str, mm: mmap.mmap | None, size: int, owner: bool, shm_dir: str):
        self.name, self.size, self.owner, self.shm_dir = name, size, owner, shm_dir
        self._mm = mm
        self.slots = SlotAllocator(0, size, name)

    # ---- lifetime ----
    @classmethod
    def create(cls, name: str, nbytes: int, *, shm_dir: str = SHM_DIR,
               margin_bytes: int = FREE_MARGIN_BYTES) -> "Arena":
        """Create (owner only) a segment of `nbytes`, reserving the pages now so a full /dev/shm fails here, clearly."""
        if not name.startswith(NAME_PREFIX) or "/" in name:
            raise ArenaError(f"segment name {name!r} must start with {NAME_PREFIX!r} and hold no '/'")
        if nbytes <= 0:
            raise ArenaError(f"arena size must be positive, got {nbytes}")
        free = shm_free_bytes(shm_dir)
        if nbytes + margin_bytes > free:
            raise ArenaError(f"not enough shared memory for job arena {name}: need {nbytes / 2**20:.1f} MiB "
                             f"+ {margin_bytes / 2**20:.0f} MiB margin, {shm_dir} has {free / 2**20:.1f} MiB free")
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ArenaError(f"segment {name} already exists (a job id reused? run reap() at start-up)") from None
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)  # tmpfs: commits pages now instead of SIGBUS later
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise ArenaError(f"cannot reserve {nbytes} bytes for {name} in {shm_dir}: {e.strerror}") from None
                os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        log.debug("created arena %s (%d bytes)", name, nbytes)
        return cls(name, mm, nbytes, True, shm_dir)

    @classmethod
    def attach(cls, name: str, *, shm_dir: str = SHM_DIR) -> "Arena":
        """Map an existing segment (stages): never creates, never unlinks, no resource tracker."""
        if not name.startswith(NAME_PREFIX) or "/" in name:
            raise ArenaError(f"segment name {name!r} must start with {NAME_PREFIX!r} and hold no '/'")
        try:
            fd = os.open(os.path.join(shm_dir, name), os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            raise ArenaError(f"shared-memory segment {name} does not exist (job finished or reaped?)") from None
        except OSError as e:           # ELOOP: a link; EISDIR: a folder; EACCES: someone else's
            raise ArenaError(f"shared-memory segment {name} cannot be opened: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ArenaError(f"shared-memory segment {name} is not a regular file")
            size = st.st_size
            if size == 0:
                raise ArenaError(f"shared-memory segment {name} is empty")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, mm, size, False, shm_dir)

    def close(self) -> None:
        """Unmap; the owner also unlinks. Safe to call twice. Views still held elsewhere keep the mapping alive."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                log.debug("arena %s still has live views; unmapped when they go", self.name)
            self._mm = None
        if self.owner:
            self.unlink()

    def unlink(self) -> None:
        if not self.owner:
            raise ArenaError(f"only the owner unlinks {self.name}; stages just close()")
        try:
            os.unlink(os.path.join(self.shm_dir, self.name))
        except FileNotFoundError:
            pass

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- slots ----
    def alloc(self, name: str, dtype: str, shape: tuple[int, ...]) -> TensorDesc:
        return self.slots.alloc(name, dtype, shape)

    def region(self, offset: int, nbytes: int) -> SlotAllocator:
        """An allocator over a byte range handed over in a message (e.g. DENOISE.scratch)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ArenaError(f"region [{offset}, {offset + nbytes}) is outside arena {self.name} of {self.size} bytes")
        return SlotAllocator(offset, offset + nbytes, self.name)

    def view(self, desc: TensorDesc) -> np.ndarray:
        """A writable numpy view of a slot (bounds checked against the segment)."""
        if self._mm is None:
            raise ArenaError(f"arena {self.name} is closed")
        if desc.slot is None:
            raise ArenaError(f"descriptor points at inline frame {desc.frame}, not at a slot of {self.name}")
        if desc.offset + desc.nbytes > self.size:
            raise ArenaError(f"slot {desc.slot!r} [{desc.offset}, {desc.offset + desc.nbytes}) lies outside arena "
                             f"{self.name} of {self.size} bytes")
        # view: desc.shape desc.dtype, aliasing the shared pages
        return np.frombuffer(self._mm, dtype=DTYPES[desc.dtype], count=desc.numel, offset=desc.offset).reshape(
            desc.shape)

    def write(self, desc: TensorDesc, array: np.ndarray) -> None:
        """Copy `array` into a slot; dtype and shape must match the descriptor exactly."""
        array = np.asarray(array)
        if tuple(array.shape) != desc.shape:
            raise ArenaError(f"slot {desc.slot!r} holds shape {list(desc.shape)}, got {list(array.shape)}")
        try:
            same = wire_dtype(array, desc.dtype if desc.dtype == "bf16" else None) == desc.dtype
        except ValueError as e:
            raise ArenaError(f"slot {desc.slot!r} holds {desc.dtype}: {e}") from None
        if not same:
            raise ArenaError(f"slot {desc.slot!r} holds {desc.dtype}, got {array.dtype}")
        self.view(desc)[...] = array

    def read(self, desc: TensorDesc, *, copy: bool = True) -> np.ndarray:
        v = self.view(desc)
        return v.copy() if copy else v
