"""Process memory figures for reports: RSS, PSS and swap from /proc/self/smaps_rollup (Linux), peak RSS."""
from __future__ import annotations

import resource
import sys

from models.branch_runtime import rss_bytes

SMAPS_ROLLUP = "/proc/self/smaps_rollup"


def process_memory_mb(pss: bool = True, path: str = SMAPS_ROLLUP) -> dict:
    """{"rss": MB} from /proc/self/statm (cheap), plus "pss" and "swap" from smaps_rollup (a few ms) when `pss`."""
    out: dict = {"rss": rss_bytes() / 2**20}
    if not out["rss"]:
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
