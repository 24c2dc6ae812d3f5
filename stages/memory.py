"""A stage process's own memory: its peak RSS, and freed heap pages handed back to the OS (the /proc readings are
models/runtime/probes.py)."""
from __future__ import annotations

import resource
import sys


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB (ru_maxrss: kB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024.0


def _libc_trim():
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):       # not glibc (musl, macOS): nothing to trim
        return None


_MALLOC_TRIM = _libc_trim()


def return_freed_memory() -> None:
    """Hand freed heap pages back to the OS now (glibc malloc_trim; ~0.1 ms): a released branch model's buffers
    leave the RSS at once instead of lingering in malloc's arenas, which matters on an 8 GB board."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
