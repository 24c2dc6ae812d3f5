"""bench/board.py --calibrate against the LABELLED STAND-IN (no RK3588 here): the board's measured figures written in
the cost file's format, read back by the cost model, and round-tripped through board-sim and `auto`, which then
run on them ([stage.executor] board_cost)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from models.runtime.backends.board_sim import Board, BoardSimBackend
from models.board import auto as board_auto
from models.board.cost import BoardModel, load_cost
from models.runtime.lifecycle import run_branch
from models.packs.pack import load_pack
from models.dit.partition import KINDS

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_board", ROOT / "bench" / "board.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def calibrated(rknn_pack, tmp_path_factory):
    out = tmp_path_factory.mktemp("calibrated") / "board-cost.toml"
    cal = _bench().calibrate(rknn_pack[0], out, lite="standin", contexts=(1, 2, 3), repeats=2)
    return rknn_pack[0], out, cal


def test_the_calibration_is_a_cost_file_of_this_boards_figures(calibrated):
    pack_dir, out, cal = calibrated
    cost = load_cost(out)
    assert cost["calibration"]["label"] == "measured" and cost["calibration"]["standin"] is True
    assert cal.io_split and cal.models == {"self": 2, "cross": 2, "ffn": 2}       # blocks 0 and 27 compiled
    model = BoardModel.for_pack(pack_dir, "full", out)
    pack = load_pack(pack_dir, check=False)
    assert model.measured and model.source == str(out)
    # the file's reference configuration is the calibrated pack: "full" is the pack's own shape, nothing scaled
    assert (model.shape.width, model.shape.tokens, model.shape.blocks) == (pack.config.width, pack.geometry.tokens,
                                                                           pack.config.blocks)
    for kind in KINDS:
        f, life = model.kinds[kind], cal.lifecycle_s[kind]
        assert f.npu_s == pytest.approx(cal.npu_pass_s[kind], rel=1e-6)
        assert (f.load_s, f.init_s, f.release_s) == pytest.approx((life["load"], life["init"], life["release"]),
                                                                  rel=1e-6)
        b_in, b_out = cal.bytes_per_call[kind]
        assert (f.bytes_in, f.bytes_out) == (b_in, b_out)            # the cost model counts what RKNNLite moved
        assert f.io_s == pytest.approx(b_in / 1e6 * cal.in_ms_per_mb / 1000 + b_out / 1e6 * cal.out_ms_per_mb / 1000)
    assert model.host_block_s == pytest.approx(cal.host_block_s)
    assert [model.speedup(n) for n in (1, 2, 3)] == pytest.approx(cal.speedup)
    assert cal.speedup[0] == 1.0 and cal.speedup[1] <= cal.speedup[2]
    assert model.mem_drop_mib(cal.mem_contexts[-1]) >= model.mem_drop_mib(1) > 0
    assert model.on_demand_step_s() == pytest.approx(sum(cal.step_parts().values()), rel=1e-6)
    # what a calibration does not measure is the project's, and the job figures with it
    assert cost["job"] == load_cost()["job"] and cost["lifecycle"]["cpu_slots"] == 3


def test_the_calibration_prints_as_the_model_reads_it(calibrated, capsys):
    _, out, _ = calibrated
    _bench().print_calibration(out)
    text = capsys.readouterr().out
    assert "a board's own calibration" in text
    assert all(f"auto on a {ram} GB board with these figures: " in text for ram in (8, 16, 32))
    assert f'board_cost = "{out}"' in text


def test_board_sim_and_auto_run_on_the_calibration(calibrated):
    """board_cost makes board-sim pace every phase to the board's measured figure, and `auto` choose on them."""
    from models.board.policy import resolve_policy
    pack_dir, out, cal = calibrated
    pack = load_pack(pack_dir, check=False)
    model = BoardModel.for_pack(pack.dir, "full", out)
    ram = _board_ram_with_room(model, cal)
    be = BoardSimBackend(threads=1, board=Board(ram, 1.0, "full", out))
    rng = np.random.default_rng(1)
    b = pack.branch(0, "ffn")
    feeds = [{i["name"]: rng.standard_normal(i["shape"]).astype(np.float16) for i in b["inputs"]} for _ in range(2)]
    run_branch(be, pack.dir / b["onnx"], feeds)
    rep = {p["phase"]: p for p in be.report["phases"]}
    life = cal.lifecycle_s["ffn"]
    assert rep["load"]["modelled_s"] == pytest.approx(life["load"]) and rep["init"]["modelled_s"] == pytest.approx(
        life["init"]) and rep["release"]["modelled_s"] == pytest.approx(life["release"])
    assert rep["npu"]["modelled_s"] == pytest.approx(cal.npu_pass_s["ffn"], rel=1e-3)
    assert rep["io"]["modelled_s"] == pytest.approx(model.kinds["ffn"].io_s)
    # auto on board-sim and on rknn (its MemAvailable) choose on the calibrated model, not on cost.toml
    want = board_auto.choose(model, model.context_budget_mib(ram))[0].policy
    got = resolve_policy("auto", "board-sim", BoardSimBackend, {"board_ram_gb": ram, "board_cost": str(out)},
                         (pack.dir,))
    assert got == want
    # the backend takes board_cost from [stage.executor] as a constructor setting
    assert BoardSimBackend(board_cost=str(out), time_scale=0.5).board.board_cost == str(out)


def _board_ram_with_room(model: BoardModel, cal) -> int:
    """The smallest modelled board whose memory holds every calibrated context beside the calibration's baseline.
    The baseline is the calibrating machine's used memory (MemTotal - MemAvailable): on a board, its own; here,
    this x86 machine's, which the suite's and other processes can take past an 8 GB board's usable memory."""
    from models.board.cost import BOARD_RAMS_GB
    need = max(cal.mem_contexts)
    ram = next((r for r in BOARD_RAMS_GB if model.contexts_fit(model.context_budget_mib(r)) >= need), None)
    assert ram is not None, f"no modelled board holds {need} contexts beside the calibrated baseline " \
                            f"{cal.baseline_gib:.1f} GiB (this machine's used memory when it calibrated)"
    return ram


def test_board_cost_in_the_pipeline_config(calibrated, tmp_path):
    """[stage.executor] board_cost is relative to the config file and checked when the file is read."""
    from stages.config import ConfigError, load_config
    _, out, _ = calibrated
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "mine.toml").write_bytes(out.read_bytes())
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text('backend = "board-sim"\n[stage.executor]\nboard_cost = "figs/mine.toml"\n')
    got = load_config(cfg).stage_settings("executor")["board_cost"]
    assert got == str((tmp_path / "figs" / "mine.toml").resolve())
    (tmp_path / "figs" / "bad.toml").write_text("[npu]\ncores = 3\n")
    cfg.write_text('backend = "board-sim"\n[stage.executor]\nboard_cost = "figs/bad.toml"\n')
    with pytest.raises(ConfigError, match=r"stage\.executor\.board_cost: board cost model .*bad\.toml"):
        load_config(cfg)
    cfg.write_text('backend = "board-sim"\n[stage.executor]\nboard_cost = "figs/none.toml"\n')
    with pytest.raises(ConfigError, match=r"stage\.executor\.board_cost: .*none\.toml"):
        load_config(cfg)
