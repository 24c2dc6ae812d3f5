"""models/runtime/probes.py: the one reader of each /proc and /sys file, against fake trees (and this machine's own /proc)."""
from __future__ import annotations

from models.runtime import probes

ROLLUP = """55cfb391f000-7fffd7730000 ---p 00000000 00:00 0                          [rollup]
Rss:                1776 kB
Pss:                 211 kB
Pss_Dirty:           116 kB
Pss_Anon:            116 kB
Pss_File:             95 kB
Shared_Clean:       1616 kB
Swap:                 48 kB
SwapPss:              12 kB
"""
MEMINFO = """MemTotal:       24683584 kB
MemFree:        16200312 kB
MemAvailable:   23127104 kB
Active(anon):     123456 kB
SwapTotal:       2097148 kB
SwapFree:        2097000 kB
"""
STATUS = "Name:\tpython3\nVmPeak:\t  30000 kB\nVmHWM:\t    9876 kB\nVmRSS:\t    8000 kB\n"


def test_board_stats_parsers(monkeypatch, tmp_path):
    load = tmp_path / "load"
    load.write_text("NPU load:  Core0: 37%, Core1:  0%, Core2: 100%,\n")
    ver = tmp_path / "version"
    ver.write_text("RKNPU driver: v0.9.8\n")
    buf = tmp_path / "bufinfo"
    buf.write_text("\nDma-buf Objects:\nsize    \tflags   \tmode    \tcount   \texp_name\n"
                   "00004096\t00000002\t00080007\t00000003\tsystem\n\nTotal 2 objects, 8392704 bytes\n")
    monkeypatch.setattr(probes, "RKNPU_LOAD", str(load))
    monkeypatch.setattr(probes, "RKNPU_VERSION", str(ver))
    monkeypatch.setattr(probes, "DMA_BUF_INFO", str(buf))
    assert probes.npu_load() == {"Core0": 37, "Core1": 0, "Core2": 100}
    assert probes.npu_driver_version() == "0.9.8"
    assert probes.dma_buf_bytes() == 8392704
    monkeypatch.setattr(probes, "RKNPU_LOAD", str(tmp_path / "absent"))
    assert probes.npu_load() is None
    assert probes.pss_kb() > 0 and probes.swap_used_kb() is not None


def test_memory_files_of_a_fake_tree(monkeypatch, tmp_path):
    """smaps_rollup, status and meminfo are read field by field: Pss is not Pss_Anon, Swap is not SwapPss, a field
    with parentheses is skipped; MemAvailable in MiB; an absent file is None (or {}), never an error."""
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "smaps_rollup").write_text(ROLLUP)
    (tmp_path / "self" / "status").write_text(STATUS)
    (tmp_path / "meminfo").write_text(MEMINFO)
    monkeypatch.setattr(probes, "SMAPS_ROLLUP", str(tmp_path / "{pid}" / "smaps_rollup"))
    monkeypatch.setattr(probes, "STATUS", str(tmp_path / "{pid}" / "status"))
    monkeypatch.setattr(probes, "MEMINFO", str(tmp_path / "meminfo"))
    assert probes.pss_kb() == 211 and probes.smaps_kb()["Swap"] == 48 and probes.smaps_kb()["Pss_Anon"] == 116
    assert probes.vm_hwm_kb() == 9876 and probes.status_kb() == {"VmPeak": 30000, "VmHWM": 9876, "VmRSS": 8000}
    mem = probes.process_memory_mb()
    assert mem["pss"] == 211 / 1024 and mem["swap"] == 48 / 1024 and mem["rss"] > 0     # rss: this process (statm)
    assert "pss" not in probes.process_memory_mb(pss=False)
    assert probes.mem_available_mib() == 23127104 / 1024 and probes.swap_used_kb() == 148
    assert "Active" not in probes.meminfo_kb() and probes.meminfo_kb()["MemTotal"] == 24683584
    assert probes.pss_kb(4242) is None and probes.vm_hwm_kb(4242) is None and probes.smaps_kb(4242) == {}
    monkeypatch.setattr(probes, "MEMINFO", str(tmp_path / "absent"))
    assert probes.mem_available_mib() is None and probes.swap_used_kb() is None
    monkeypatch.setattr(probes, "STATM", str(tmp_path / "absent"))
    assert probes.rss_bytes() == 0


def test_this_process_is_read_from_the_real_proc():
    """statm's RSS and smaps_rollup's Rss describe the same process: within a few MiB of each other."""
    rss_kb = probes.rss_bytes() / 1024
    assert rss_kb > 0 and abs(probes.smaps_kb()["Rss"] - rss_kb) < 64 * 1024
    assert probes.vm_hwm_kb() >= 0.9 * probes.smaps_kb()["Rss"] and probes.mem_available_mib() > 0


def test_dram_devfreq_of_a_fake_tree(tmp_path):
    """The DRAM governor and clock (P8: dmc_ondemand can hold it at 528 of 2,112 MHz); None without the device."""
    dmc = tmp_path / "dmc"
    dmc.mkdir()
    (dmc / "governor").write_text("dmc_ondemand\n")
    (dmc / "cur_freq").write_text("528000000\n")
    assert probes.dram_devfreq(str(dmc)) == {"governor": "dmc_ondemand", "cur_mhz": 528.0}
    (dmc / "cur_freq").write_text("garbage")
    assert probes.dram_devfreq(str(dmc)) == {"governor": "dmc_ondemand", "cur_mhz": None}
    assert probes.dram_devfreq(str(tmp_path / "none")) is None
