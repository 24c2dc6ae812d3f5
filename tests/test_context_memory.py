"""A context's memory beyond its weights: the compiler's planned memory read from a real rknn-toolkit2 build log, the
board model's activation memory per size (checked against measured shard figures it was not fitted to), whether a
size's largest branch call fits the 8 GB board (modelled), and `doctor`'s line per size."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from models.board.cost import BoardModel, Shape
from models.packs.memory_fit import fit_at, internal_mib
from models.rknn.buildlog import parse_build_log

DATA = Path(__file__).parent / "data" / "rknn"
MIB = 2 ** 20
# captured from rknn-toolkit2 2.5.0 compiling block 0's self-attention of the synthetic `small` preset (16 heads,
# head dim 16, D 256) at 1024x1024: 4,096 image tokens
SELF_4096 = DATA / "self_16heads_4096tokens.log"


def _table_ends(text: str) -> dict:
    """The highest [Start, End) end address of the Feature and the Const Tensor tables: the memory the compiler's
    tensor tables place, read without the parser's summary lines."""
    ends, table = {"Feature": 0, "Const": 0}, None
    for line in text.splitlines():
        m = re.search(r"(Feature|Const) Tensor Information Table", line)
        if m:
            table = m.group(1)
        m = re.search(r"\|\s*0x[0-9a-f]+\s+(0x[0-9a-f]+)\s+0x[0-9a-f]+\s*$", line)
        if m and table:
            ends[table] = max(ends[table], int(m.group(1), 16))
    return ends


def test_the_build_log_gives_the_compilers_planned_memory():
    text = SELF_4096.read_text(errors="replace")
    log = parse_build_log(text)
    ends = _table_ends(text)
    # the weights: the Const table's extent, up to the compiler's alignment padding
    assert 0 <= log.weight_bytes - ends["Const"] <= 4096, (log.weight_bytes, ends)
    # the activations: at least what the Feature table places, and at least one FP16 score tensor [16, 4096, 4096]
    # (the log prints this one in C's %g form, 1.06816e+06KB)
    assert log.internal_bytes >= max(ends["Feature"], 16 * 4096 * 4096 * 2)
    assert log.internal_bytes < 3 * 16 * 4096 * 4096 * 2
    assert log.summary()["internal_bytes"] == log.internal_bytes
    small = parse_build_log((DATA / "gelu_fused_npu_only.log").read_text())
    assert small.internal_bytes == 104 * 1024 and small.weight_bytes == round(66.125 * 1024)
    assert parse_build_log("D RKNN: [1:2:3.4] Total Internal Memory Size: 1.5MB\n").internal_bytes == 1.5 * MIB
    assert parse_build_log("no statistics here").internal_bytes == 0


def test_the_activation_model_predicts_the_measured_query_row_shards():
    # cost.toml's self_rows_kib are measured but not used by the model: its self-attention at the `small` widths for
    # the first of 2 and of 3 query-row shards must land on them, never under (the model keeps K/V whole)
    model = BoardModel()
    cm = model.cost["context_memory"]
    small = Shape(width=cm["width"], heads=cm["heads"], head_dim=16, ffn_width=cm["ffn_width"], context_dim=1024,
                  blocks=1, tokens=4096)
    for n, rows in ((2, 2048), (3, 1366)):
        got = internal_mib("self", small, model.cost, rows=rows)
        measured = cm["self_rows_kib"][str(n)] / 1024
        assert measured <= got <= measured * 1.02, (n, got, measured)
    # and the whole branch's two measured points, which it was fitted to, come back
    for tokens, kib in zip(cm["tokens"], cm["self_kib"]):
        got = internal_mib("self", Shape(256, 16, 16, 1024, 1024, 1, tokens), model.cost)
        assert got == pytest.approx(kib / 1024, rel=1e-9)


def test_one_megapixel_fits_the_8gb_board_and_2048_does_not():
    f = fit_at(1024, 1024)
    assert f.kind == "self" and f.tokens == 4096 and f.fits
    # the arena's growth counted by hand: per CFG pass xn and y [L, D] FP16, and the shared RoPE tables [L, hd/2]
    # twice, for 4,096 - 1,024 more tokens
    grow = (4096 - 1024) * (2 * 2 * 2048 * 2 + 2 * 64 * 2) / MIB
    assert f.arena_growth_mib == pytest.approx(grow, abs=0.01)
    # two FP16 score buffers [16, L, L] grow from 1,024 to 4,096 tokens: the context grows at least by them
    assert f.context_mib - BoardModel().context_mib(1) >= 2 * 16 * (4096 ** 2 - 1024 ** 2) * 2 / MIB
    assert f.need_mib <= f.budget_mib == pytest.approx(BoardModel().context_budget_mib(8))
    assert "fits beside" in f.line() or "more fit beside" in f.line()
    assert f.line().endswith("(modelled)")
    big = fit_at(2048, 2048)
    assert not big.fits and "does not fit by" in big.line() and big.line().endswith("(modelled)")
    # three query-row shards: each context smaller, the call's contexts together not
    three = fit_at(1024, 1024, shards=3)
    assert three.context_mib < f.context_mib < three.call_mib


def test_a_size_under_512_prints_the_arenas_shrink_signed():
    # 256x256 has fewer tokens than 512x512: the arena shrinks, and the line says so with one sign ("arena -7 MiB")
    f = fit_at(256, 256)
    assert f.arena_growth_mib < -0.5
    assert f"arena -{round(-f.arena_growth_mib):,} MiB)" in f.line() and "+-" not in f.line()
    assert f"arena +{round(fit_at(1024, 1024).arena_growth_mib):,} MiB)" in fit_at(1024, 1024).line()


class _Cfg:
    """What check_size_memory reads of a pipeline config: its packs, the executor's table, the backend."""

    def __init__(self, packs, executor, backend="onnx"):
        self.packs, self.executor, self.backend = packs, executor, backend

    def stage_settings(self, name):
        return self.executor if name == "executor" else {}


def test_doctor_prints_one_memory_line_per_size(tmp_path, tiny_dit, monkeypatch):
    from models.packs.pack import build_pack
    from models.runtime import probes
    from orchestrator.ops.doctor import FAIL, OK, WARN, Doctor
    packs = []
    for w, h in ((64, 64), (96, 64)):
        packs.append(tmp_path / f"pack{w}x{h}")
        build_pack(tiny_dit, packs[-1], (w, h), "fp16")

    def check(executor):
        d = Doctor(rf=None)
        d.cfg = _Cfg(packs, {k: v for k, v in executor.items() if k != "backend"}, executor["backend"])
        d.check_size_memory()
        assert [c.name for c in d.checks] == ["memory-64x64", "memory-96x64"]
        assert all(c.text.endswith("(modelled)") for c in d.checks)
        return d.checks

    assert {c.status for c in check({"backend": "onnx"})} == {OK}
    assert all("8 GB board" in c.text and "more fit beside it" in c.text for c in check({"backend": "onnx"}))
    # a 4 GB board leaves no memory for contexts once the stages and host weights are in (modelled)
    small = check({"backend": "board-sim", "board_ram_gb": 4})
    assert {c.status for c in small} == {FAIL} and all("does not fit by" in c.text for c in small)
    # on the board's NPU: this board's MemAvailable now (measured) is the budget, and a shortfall is a warning
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable: 1600000 kB\n")
    monkeypatch.setattr(probes, "MEMINFO", str(meminfo))
    monkeypatch.setattr(probes, "is_rk3588", lambda: True)             # the board's device tree says so
    low = check({"backend": "rknn"})
    assert {c.status for c in low} == {WARN} and all("MemAvailable 1562 MiB (measured)" in c.text for c in low)


def test_compile_records_each_contexts_planned_memory(rknn_pack):
    from models.records.manifest import manifest_json
    pack, report = rknn_pack
    compiled = [b for b in manifest_json(pack)["branches"] if "rknn" in b]
    assert len(compiled) == 6
    for b in compiled:
        e = b["rknn"]
        # a context holds at least its graph's own inputs and outputs, and the weights the graph file carries
        io_bytes = max(2 * int(np.prod(t["shape"])) for t in b["inputs"] + b["outputs"])
        assert e["internal_bytes"] >= io_bytes, (b["kind"], e["internal_bytes"], io_bytes)
        assert 0 < e["weight_mem_bytes"] <= e["bytes"], (b["kind"], e)
    by_name = {r["name"]: r for r in report["branches"]}
    assert all(by_name[f"b{b['block']:02d}_{b['kind']}"]["internal_bytes"] == b["rknn"]["internal_bytes"]
               for b in compiled)
