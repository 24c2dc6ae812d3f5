"""orchestrator.engine.timing_plot: the panels are drawn from the report's figures (checked as data and through the PNG's
`anima-plot` chunk, not pixels); the memory trace stays bounded; bad reports are a message, not a traceback."""
import io
import json
import subprocess
import sys

import pytest
from PIL import Image

from orchestrator.engine import timing_plot
from orchestrator.engine.report import MEMORY_POINTS, JobReport, MemoryTrace
from protocol import messages as m

ONE_PASS = m.DenoisePass(image=1, images=1)      # a job of one image, one sampling pass


def _report(board=None) -> dict:
    r = JobReport("20260101-000000-abcdef", {"prompt": "a", "width": 128, "height": 128, "steps": 4})
    r.add_pass(ONE_PASS, {"computed_steps": [1, 2, 4], "forecast_steps": [3], "branch_calls": 9, "host_s": 0.3,
                  "transport_s": 0.1,
                  "branches": {"self": {"load_s": 0.5, "init_s": 0.25, "infer_s": 1.0, "release_s": 0.125,
                                        "calls": 3},
                               "ffn": {"load_s": 0.75, "init_s": 0.5, "infer_s": 2.0, "release_s": 0.25,
                                       "visible_s": 1.5, "calls": 3}}, "executor_backend": "onnx"})
    for t in range(20):
        r.memory.add("scheduler", 1.0 + 0.2 * t, 300.0 + t)
        r.memory.add("executor", 1.0 + 0.2 * t, 500.0 - t)
    r.memory.add("encoder", 0.1, 2500.0)
    r.phases = [["encoding", 0.0, 1.0], ["denoising", 1.0, 5.0], ["decoding", 5.0, 6.0]]
    d = json.loads(json.dumps(r.to_dict()))
    assert d["executor_backend"] == "onnx"
    # the scheduler's per-step figures (DENOISED.steps, one StepTimes each)
    d["steps"] = [{"step": 1, "computed": True, "wall_s": 1.5, "infer_s": 1.0, "lifecycle_s": 0.25, "host_s": 0.1,
                   "host_work_s": 0.1, "transport_s": 0.05, "calls": 3},
                  {"step": 2, "computed": True, "wall_s": 1.25, "infer_s": 0.75, "lifecycle_s": 0.25, "host_s": 0.1,
                   "host_work_s": 0.1, "transport_s": 0.05, "calls": 3},
                  {"step": 3, "computed": False, "wall_s": 0.01, "calls": 0},
                  {"step": 4, "computed": True, "wall_s": 1.0, "infer_s": 0.5, "lifecycle_s": 0.25, "host_s": 0.1,
                   "host_work_s": 0.1, "transport_s": 0.05, "calls": 3}]
    if board:
        d["board"] = board
    return d


def test_panels_are_the_reports_figures():
    report = _report()
    data = timing_plot.plot_data(report)
    panels = {p["name"]: p for p in data["panels"]}
    assert list(panels) == ["steps", "branches", "memory"]
    steps = panels["steps"]
    assert steps["x"] == [1, 2, 3, 4] and steps["computed"] == [True, True, False, True]
    s = steps["series"]
    # named by the backend that ran (report.json executor_backend, from the executor's READY), not "NPU" on a CPU
    assert s["branch inference (onnx)"] == [1.0, 0.75, 0.0, 0.5] and not any("NPU" in k for k in s)
    assert s["visible lifecycle (load/init/release waited for)"] == [0.25, 0.25, 0.0, 0.25]
    assert s["host ops"] == [0.1, 0.1, 0.0, 0.1] and s["transport"] == [0.05, 0.05, 0.0, 0.05]
    # the rest of each step's wall time (sampler, state file), never negative
    assert s["other (sampler, state file)"] == pytest.approx([0.1, 0.1, 0.01, 0.1])
    for i, st in enumerate(report["steps"]):
        assert sum(v[i] for v in s.values()) == pytest.approx(st["wall_s"])
    assert panels["branches"]["series"]["ffn"] == {"load_s": 0.75, "init_s": 0.5, "infer_s": 2.0, "release_s": 0.25}
    assert panels["branches"]["labels"] == {"self": "self (3 calls)", "ffn": "ffn (3 calls)"}   # no calls: left out
    assert "VAE" not in panels["branches"]["title"]                          # the torch VAE has no per-model phases
    assert panels["branches"]["notes"]["ffn"] == "lifecycle 1.50 s visible, 0.00 s hidden; 0 cached"
    mem = panels["memory"]
    assert list(mem["series"]) == ["encoder", "scheduler", "executor"]
    assert mem["series"]["executor"][0] == [1.0, 500.0] and len(mem["series"]["executor"]) == 20
    assert mem["phases"][1] == ["denoising", 1.0, 5.0]
    assert data["provenance"] == "measured on this machine" and "(measured on this machine)" in steps["title"]


def test_png_is_valid_and_names_its_panels(tmp_path):
    report = _report()
    (tmp_path / "report.json").write_text(json.dumps(report))
    path = timing_plot.write_plot(tmp_path / "report.json")
    assert path == tmp_path / "timing.png"
    img = Image.open(io.BytesIO(path.read_bytes()))
    img.verify()
    img = Image.open(path)
    assert img.format == "PNG" and img.size[0] == 1200 and img.size[1] > 900
    drawn = json.loads(img.text["anima-plot"])
    assert drawn["panels"] == {"steps": sorted(timing_plot.plot_data(report)["panels"][0]["series"]),
                               "branches": ["ffn", "self"], "memory": ["encoder", "executor", "scheduler"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "timing.png"]     # no temporary left


def test_a_vae_packs_models_join_the_branch_panel():
    """The VAE stage on a pack reports each model's lifecycle phases flat in DECODED (stages.vae._model_timings of
    PackDecoder's timings): the trunk and tile rows sit beside the executor's kinds, labelled as the VAE stage's own
    measured figures, also when the executor's are paced to the modelled board."""
    from stages.vae import _model_timings
    pack_timings = {"trunk": {"load_s": 0.5, "init_s": 0.25, "infer_s": 2.0, "release_s": 0.125},
                    "tile": {"load_s": 0.375, "init_s": 0.25, "infer_s": 3.0, "release_s": 0.0625},
                    "tiles": 6, "blend_s": 0.01}
    for board in (None, {"label": "modelled", "time_scale": 0.05, "steps": []}):
        report = _report(board=board)
        report["vae_timings"] = {"load_s": 1.0, "decode_s": 6.5, "png_s": 0.1, **_model_timings(pack_timings)}
        branches = {p["name"]: p for p in timing_plot.plot_data(report)["panels"]}["branches"]
        assert list(branches["series"]) == ["self", "ffn", "vae trunk", "vae tile"]
        assert branches["series"]["vae tile"] == {"load_s": 0.375, "init_s": 0.25, "infer_s": 3.0, "release_s": 0.0625}
        assert branches["labels"]["vae trunk"] == "VAE pack trunk (VAE stage, measured here)"
        assert "VAE pack models" in branches["title"] and "vae trunk" not in branches["notes"]
    png, _ = timing_plot.render(report)
    assert "vae tile" in json.loads(Image.open(io.BytesIO(png)).text["anima-plot"])["panels"]["branches"]


def test_board_sim_reports_say_modelled():
    """A board-sim job: the per-step panel is the report's board rows (modelled board seconds), every series says
    where it comes from; the executor panel says it was paced; memory stays measured."""
    rows = [{"step": 1, "computed": True, "wall_s": 50.0, "npu_s": 30.0, "lifecycle_s": 8.0, "host_s": 6.0,
             "transport_s": 0.4, "other_s": 0.1, "infer_s": 35.5, "io_s": 5.5},
            {"step": 2, "computed": False, "wall_s": 0.02, "npu_s": 0.0, "lifecycle_s": 0.0, "host_s": 0.0,
             "transport_s": 0.0, "other_s": 0.02, "infer_s": 0.0, "io_s": 0.0}]
    board = {"label": "modelled", "source": "board_cost.toml (reference board figures)", "time_scale": 0.05,
             "steps": rows}
    data = timing_plot.plot_data(_report(board=board))
    steps, branches, memory = data["panels"]
    assert "MODELLED RK3588 (board_cost.toml" in steps["title"] and steps["x"] == [1, 2]
    s = steps["series"]
    assert s["branch inference (MODELLED NPU + tensor I/O)"] == [35.5, 0.0]
    assert s["transport (measured here)"] == [0.4, 0.0] and s["other: sampler, state file (measured here)"][1] == 0.02
    assert all(("MODELLED" in k) != ("measured" in k) for k in s)            # each series says which it is
    for i, r in enumerate(rows):
        assert sum(v[i] for v in s.values()) == pytest.approx(r["wall_s"])
    assert "MODELLED RK3588 x time_scale 0.05" in branches["title"]
    assert "measured" in memory["title"] and "MODELLED" not in memory["title"]
    png, _ = timing_plot.render(_report(board=board))
    assert "MODELLED" in json.loads(Image.open(io.BytesIO(png)).text["anima-plot"])["provenance"]


def test_a_report_without_figures_still_gets_a_picture():
    png, data = timing_plot.render({"job": "x"})
    assert data["panels"] == [] and Image.open(io.BytesIO(png)).format == "PNG"


def test_memory_trace_is_bounded_and_keeps_the_span():
    trace = MemoryTrace()
    for i in range(5000):
        trace.add("executor", 0.2 * i, float(i))
    points = trace.series["executor"]
    assert MEMORY_POINTS // 2 <= len(points) <= MEMORY_POINTS
    times = [t for t, _ in points]
    assert times == sorted(times) and times[0] == 0.0 and times[-1] > 0.2 * 4900
    trace.add("executor", 2000.0, None)                                      # a stage gone: nothing recorded
    assert trace.series["executor"][-1][0] < 2000.0


def test_bad_report_is_a_message(tmp_path):
    (tmp_path / "report.json").write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "orchestrator.engine.timing_plot", str(tmp_path / "report.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "timing plot:" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "timing.png").exists()


def test_a_board_sim_job_of_two_passes_prices_each_on_its_own_pack(pipeline_assets):
    """A hires job's first pass runs the small pack, its second the large one: the report's modelled board prices
    each pass's steps on its own pack (the board NPU seconds per step differ by size), summed."""
    from models.board.account import board_section
    from models.board.cost import BoardModel
    from tests.pipeline_harness import tiny_assets
    _, large = pipeline_assets                              # the session's 128x128 pack, and a 64x64 one beside it
    packs = {(64, 64): tiny_assets(large.parent, (64, 64))[1], (128, 128): large}
    rows = [{"step": n, "computed": True, "wall_s": 1.0, "infer_s": 0.5, "lifecycle_s": 0.1, "host_s": 0.1,
             "transport_s": 0.01, "calls": 3} for n in (1, 2)]
    r = JobReport("20260101-000000-abcdef", {"prompt": "a", "width": 64, "height": 64, "steps": 2})
    for size, name in (((64, 64), "first"), ((128, 128), "hires")):
        r.board = {"pack_dir": str(packs[size]), "time_scale": 1.0}
        r.add_pass(m.DenoisePass(image=1, images=1, name=name), {"steps": rows, "branch_calls": 6})
    board = r.to_dict()["board"]
    alone = {size: board_section([(rows, BoardModel.for_pack(packs[size]))], 1.0, {}) for size in packs}
    small, large = alone[(64, 64)]["modelled"]["npu_s"], alone[(128, 128)]["modelled"]["npu_s"]
    assert large > small > 0                                # a per-size figure: one model for both would be wrong
    assert board["modelled"]["npu_s"] == pytest.approx(small + large)
    assert board["denoise_board_s"] == pytest.approx(sum(a["denoise_board_s"] for a in alone.values()))
    assert len(board["steps"]) == 4
