"""Durable file writes: one `atomic_write` for every file a job or a pack depends on.

A file is written to a temporary created exclusively (O_CREAT|O_EXCL, so no planted link or file is ever followed or
reused) in the destination's own folder, flushed and fsynced, renamed over the destination (or linked into place when
an existing file must be kept), and then the folder itself is fsynced so the rename survives a power cut. A reader
sees the old file or the new one, never a torn one; a crash leaves at most a stale temporary, which
`remove_stale_temporaries` finds by its name.

    atomic_write(path, b"bytes")                              # replace path
    atomic_write(path, "text\n")                              # str is written as UTF-8
    atomic_write(path, lambda f: np.save(f, array))           # a writer callable gets the open binary file
    atomic_write(path, data, overwrite=False)                 # FileExistsError when path exists (kept untouched)

A folder of files that belong together (a model pack) is built the same way, as a whole:

    with building_folder(out) as tmp:                         # tmp: a new hidden sibling of `out`
        ...write into tmp...                                  # an exception removes tmp, `out` stays as it was
    # on success tmp was renamed to `out` (a previous `out` moved aside first, then removed)
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Union

TEMP_PREFIX = "."            # temporaries are hidden files: ".<name>.<random>.tmp"
TEMP_SUFFIX = ".tmp"

Payload = Union[bytes, bytearray, memoryview, str, Callable[[BinaryIO], None]]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(folder) -> None:
    """fsync a directory, so a rename or a new entry in it survives a power cut."""
    fd = os.open(os.fspath(folder), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, data: Payload, *, mode: int | None = None, overwrite: bool = True) -> Path:
    """Write `data` to `path` durably and atomically; returns the path.

    mode: the file's permission bits (default 0o666 less the umask, as open() would give); overwrite=False keeps an
    existing `path` (raises FileExistsError, the temporary removed). The temporary lives in path's folder, so the
    rename never crosses a file system."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name[:200]}.", suffix=TEMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            elif isinstance(data, str):
                f.write(data.encode("utf-8"))
            else:
                f.write(data)
            f.flush()
            os.fchmod(f.fileno(), (0o666 & ~_umask()) if mode is None else mode)
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)              # replaces a link at `path` itself, never its target
        else:
            os.link(tmp, path)                 # EEXIST when anything (file, link, folder) is already there
            os.unlink(tmp)
        tmp = None
        fsync_dir(folder)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
    return path


def is_temporary(name: str) -> bool:
    """True for a name `atomic_write` gives its temporaries."""
    return name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX) and name.count(".") >= 3


def temporary_target(name: str) -> str | None:
    """The file name a temporary of `atomic_write` was for (".y.png.k3j2.tmp" -> "y.png"), else None."""
    if not is_temporary(name):
        return None
    return name[len(TEMP_PREFIX):-len(TEMP_SUFFIX)].rsplit(".", 1)[0]


def remove_stale_temporaries(folder, older_than_s: float = 0.0,
                             targets: Callable[[str], bool] | None = None) -> list[Path]:
    """Remove temporaries `atomic_write` left in `folder` (not recursive) by a crash: those at least `older_than_s`
    old and, when `targets` is given, only those whose destination name it accepts; regular files only, links and
    anything else are left alone. Returns what was removed."""
    removed, now = [], time.time()
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return removed
    for e in entries:
        target = temporary_target(e.name)
        if target is None or (targets is not None and not targets(target)):
            continue
        try:
            st = e.stat(follow_symlinks=False)
            if not e.is_file(follow_symlinks=False) or now - st.st_mtime < older_than_s:
                continue
            os.unlink(e.path)
            removed.append(Path(e.path))
        except OSError as err:
            if err.errno != errno.ENOENT:
                raise
    return removed


@contextmanager
def building_folder(out) -> Iterator[Path]:
    """Yield a fresh temporary sibling folder of `out` (mode 0777 less the umask); when the block ends without an
    exception it becomes `out` (an existing `out` is moved aside first and removed after), else it is removed."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    os.chmod(tmp, 0o777 & ~_umask())                 # mkdtemp makes 0700; a pack is an ordinary folder
    try:
        yield tmp
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "previous")
        os.replace(tmp, out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
