"""What Linux exposes about memory and the NPU under /proc and /sys: process RSS, PSS, swap and peak RSS, the system's
MemAvailable and swap, dma-buf totals, RKNPU load and driver version.

The one reader of each file. The paths are module constants so tests can point them at a fake tree; a file that is
absent or unreadable (no debugfs, not root, not Linux) reads as None, never as an error.
"""
from __future__ import annotations

import os
import re
from typing import Optional

STATM = "/proc/self/statm"
SMAPS_ROLLUP = "/proc/{pid}/smaps_rollup"               # {pid}: "self" or a process id
STATUS = "/proc/{pid}/status"
MEMINFO = "/proc/meminfo"
DMA_BUF_INFO = "/sys/kernel/debug/dma_buf/bufinfo"      # root + debugfs; absent on most desktops
RKNPU_LOAD = "/sys/kernel/debug/rknpu/load"              # "NPU load:  Core0:  0%, Core1:  0%, Core2:  0%,"
RKNPU_VERSION = "/sys/kernel/debug/rknpu/version"        # "RKNPU driver: v0.9.8"
RKNPU_MM = "/sys/kernel/debug/rknpu/mm"                  # the driver's own memory table, where it has one
DRAM_DEVFREQ = "/sys/class/devfreq/dmc"                  # RK3588 DRAM: governor, cur_freq (Hz); no root needed

DEVICE_TREE_COMPATIBLE = "/proc/device-tree/compatible"   # NUL-separated "vendor,board" and "rockchip,rk3588"
DEVFREQ = "/sys/class/devfreq"                            # one folder per scaled device: dmc (DRAM), *.npu, *.gpu
CPUFREQ = "/sys/devices/system/cpu/cpufreq"               # policy0, policy4, policy6 on an RK3588
LIB_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib/aarch64-linux-gnu", "/usr/local/lib")   # where librknnrt.so goes

_KB_LINE = re.compile(r"^(\w+):\s+(\d+)", re.M)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:                 # absent, or not readable without root / debugfs
        return None


def _kb_fields(text: Optional[str]) -> dict:
    """"Name:   123 kB" lines (smaps_rollup, status, meminfo) as {name: KiB}."""
    return {k: int(v) for k, v in _KB_LINE.findall(text or "")}


def rss_bytes() -> int:
    """Resident set size of this process (statm: cheap enough to read per phase); 0 when unreadable."""
    try:
        return int((_read(STATM) or "").split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, IndexError):
        return 0


def smaps_kb(pid="self") -> dict:
    """A process's smaps_rollup as {field: KiB} (Rss, Pss, Swap, ...; a few ms to read); {} when unreadable."""
    return _kb_fields(_read(SMAPS_ROLLUP.format(pid=pid)))


def pss_kb(pid="self") -> Optional[int]:
    """Proportional set size of a process in KiB, None when the kernel does not expose it."""
    return smaps_kb(pid).get("Pss")


def status_kb(pid="self") -> dict:
    """A process's status lines that are sizes (VmRSS, VmHWM, RssAnon, RssFile, ...) as {field: KiB}; {} when
    unreadable."""
    return _kb_fields(_read(STATUS.format(pid=pid)))


def vm_hwm_kb(pid="self") -> Optional[int]:
    """A process's peak resident set size (VmHWM in its status) in KiB, None when unreadable."""
    return status_kb(pid).get("VmHWM")


def meminfo_kb() -> dict:
    """/proc/meminfo as {field: KiB}."""
    return _kb_fields(_read(MEMINFO))


def mem_available_mib() -> Optional[float]:
    """The system's MemAvailable in MiB, None when unreadable."""
    kb = meminfo_kb().get("MemAvailable")
    return None if kb is None else kb / 1024.0


def swap_used_kb() -> Optional[int]:
    mi = meminfo_kb()
    if "SwapTotal" not in mi:
        return None
    return mi["SwapTotal"] - mi.get("SwapFree", 0)


def process_memory_mb(pss: bool = True) -> dict:
    """{"rss": MiB} from statm (cheap), plus "pss" and "swap" from smaps_rollup when `pss` and readable."""
    out: dict = {"rss": rss_bytes() / 2**20}
    if not out["rss"]:
        import psutil
        out["rss"] = psutil.Process().memory_info().rss / 2**20
    if pss:
        rollup = smaps_kb()
        out.update({key.lower(): rollup[key] / 1024.0 for key in ("Pss", "Swap") if key in rollup})
    return out


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


def dram_devfreq(root: str = DRAM_DEVFREQ) -> Optional[dict]:
    """{"governor": "dmc_ondemand", "cur_mhz": 528.0} of the DRAM's devfreq device, None where it has none (the
    `dmc_ondemand` governor can leave the DRAM at 528 of 2,112 MHz, P8 in docs/board-figures.md)."""
    gov, cur = _read(f"{root}/governor"), _read(f"{root}/cur_freq")
    if gov is None and cur is None:
        return None
    try:
        mhz = int(cur.strip()) / 1e6 if cur is not None else None
    except ValueError:
        mhz = None
    return {"governor": gov.strip() if gov is not None else None, "cur_mhz": mhz}


def soc_compatible() -> Optional[list]:
    """The device tree's compatible strings (["radxa,rock-5b", "rockchip,rk3588"]), None without a device tree
    (x86 PCs)."""
    text = _read(DEVICE_TREE_COMPATIBLE)
    return None if text is None else [c for c in text.split("\x00") if c]


def is_rk3588() -> bool:
    """True on an RK3588 board (its device tree says so); False on a PC, where nothing of the board may be read."""
    return any("rk3588" in c for c in soc_compatible() or ())


def devfreq_governors() -> dict:
    """{device folder name: governor} of every devfreq device (DRAM "dmc", the NPU "fdab0000.npu", ...); {} when
    there are none."""
    try:
        names = sorted(os.listdir(DEVFREQ))
    except OSError:
        return {}
    out = {}
    for name in names:
        gov = _read(os.path.join(DEVFREQ, name, "governor"))
        if gov is not None:
            out[name] = gov.strip()
    return out


def cpufreq_governors() -> dict:
    """{cpufreq policy: scaling governor} ("policy0": "schedutil"); {} when there is no cpufreq."""
    try:
        names = sorted(n for n in os.listdir(CPUFREQ) if n.startswith("policy"))
    except OSError:
        return {}
    out = {}
    for name in names:
        gov = _read(os.path.join(CPUFREQ, name, "scaling_governor"))
        if gov is not None:
            out[name] = gov.strip()
    return out


def find_library(name: str) -> Optional[str]:
    """The first LIB_DIRS folder (or $LD_LIBRARY_PATH folder) holding `name`, as a path; None when none does."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(LIB_DIRS)
    for d in dirs:
        path = os.path.join(d, name)
        if os.path.isfile(path):
            return path
    return None
