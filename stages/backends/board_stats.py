"""Memory and NPU figures a board exposes: process PSS, swap, dma-buf totals, RKNPU load and driver version."""
from __future__ import annotations

import re
from typing import Optional

SMAPS_ROLLUP = "/proc/self/smaps_rollup"
MEMINFO = "/proc/meminfo"
DMA_BUF_INFO = "/sys/kernel/debug/dma_buf/bufinfo"      # root + debugfs; absent on most desktops
RKNPU_LOAD = "/sys/kernel/debug/rknpu/load"              # "NPU load:  Core0:  0%, Core1:  0%, Core2:  0%,"
RKNPU_VERSION = "/sys/kernel/debug/rknpu/version"        # "RKNPU driver: v0.9.8"
RKNPU_MM = "/sys/kernel/debug/rknpu/mm"                  # the driver's own memory table, where it has one


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:                 # absent, or not readable without root / debugfs
        return None


def pss_kb(pid: str = "self") -> Optional[int]:
    """Proportional set size of a process in KiB (smaps_rollup), None when the kernel does not expose it."""
    text = _read(SMAPS_ROLLUP if pid == "self" else f"/proc/{pid}/smaps_rollup")
    m = re.search(r"^Pss:\s+(\d+) kB", text or "", re.M)
    return int(m.group(1)) if m else None


def meminfo_kb() -> dict:
    """/proc/meminfo as {field: KiB}."""
    out = {}
    for line in (_read(MEMINFO) or "").splitlines():
        m = re.match(r"(\w+):\s+(\d+)", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def swap_used_kb() -> Optional[int]:
    mi = meminfo_kb()
    if "SwapTotal" not in mi:
        return None
    return mi["SwapTotal"] - mi.get("SwapFree", 0)


def dma_buf_bytes() -> Optional[int]:
    """Total bytes of all dma-buf objects (the NPU's weight/feature buffers live there), None when unreadable."""
    text = _read(DMA_BUF_INFO)
    if text is None:
        return None
    m = re.search(r"Total\s+\d+\s+objects,\s+(\d+)\s+bytes", text)
    if m:
        return int(m.group(1))
    # older kernels: one row per buffer, size first (hex or decimal)
    total = 0
    for line in text.splitlines():
        m = re.match(r"\s*(0x[0-9a-fA-F]+|\d+)\s+", line)
        if m:
            total += int(m.group(1), 0)
    return total


def npu_load() -> Optional[dict]:
    """{"Core0": 12, ...} percent busy per NPU core, None when unreadable."""
    text = _read(RKNPU_LOAD)
    if text is None:
        return None
    return {c: int(p) for c, p in re.findall(r"(Core\d+):\s*(\d+)%", text)} or None


def npu_driver_version() -> Optional[str]:
    text = _read(RKNPU_VERSION)
    m = re.search(r"v?(\d+\.\d+\.\d+)", text or "")
    return m.group(1) if m else None


def snapshot() -> dict:
    """Everything readable now; unreadable figures are None (a desktop has no dma-buf/NPU files)."""
    return {"pss_kb": pss_kb(), "swap_used_kb": swap_used_kb(), "dma_buf_bytes": dma_buf_bytes(),
            "npu_load": npu_load()}
