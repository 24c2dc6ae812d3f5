"""Process memory figures for reports: RSS, PSS and swap from /proc/self/smaps_rollup (Linux), peak RSS."""
from __future__ import annotations

import os
import resource
import sys

SMAPS_ROLLUP = "/proc/self/smaps_rollup"
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_memory_mb(pss: bool = True, path: str = SMAPS_ROLLUP) -> dict:
    """{"rss": MB} from /proc/self/statm (cheap), plus "pss" and "swap" from smaps_rollup (a few ms) when `pss`."""
    out: dict = {}
    try:
        with open("/proc/self/statm") as f:
            out["rss"] = int(f.read().split()[1]) * PAGE_BYTES / 2**20
    except (OSError, ValueError, IndexError):
        import psutil
        out["rss"] = psutil.Process().memory_info().rss / 2**20
    if pss:
        try:
            with open(path) as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in ("Pss", "Swap"):
                        out[key.lower()] = int(rest.split()[0]) / 1024.0     # kB -> MB
        except OSError:
            pass
    return out


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
