"""Issue 43's settings that go with the model and the job priced before it runs: a pack's sampling record (pack and
bundle options, the manifest reader), prompt.json / generate / the daemon / A1111 taking it where the job sets none
while a ComfyUI graph stays as sent, a negative prompt at cfg 1 not encoded, and `orchestrator estimate` (its last
line an interface) checked against the board bench's own projection and the reference board's Spectrum figure."""
from __future__ import annotations

import io
import json
import os
import re
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from models.records.manifest import ManifestError, pack_sampling, sampling_info
from models.packs.sampling import BASE, TURBO, parse_sampling, record_sampling
from orchestrator.terminal import cli
from orchestrator.engine.estimate import BoardSettings, Estimate, estimate_spec
from orchestrator.engine.prompt_spec import parse_prompt_obj, prompt_record, resolve_prompt
from protocol import messages as m

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^estimate job_s=(\d+\.\d) encode_s=(\d+\.\d) denoise_s=(\d+\.\d) decode_s=(\d+\.\d) "
                  r"calls=(\d+) passes=([12]) \[modelled\]$")


# ---------------------------------------------------------------- the sampling record

def test_presets_are_the_sources_settings_and_options_name_themselves():
    # docs/model-facts.md: the ComfyUI template (30 steps, cfg 4, er_sde, simple); the Turbo card (cfg 1, 8-12 steps)
    assert BASE == {"steps": 30, "cfg": 4.0, "sampler": "er_sde", "scheduler": "simple"}
    assert TURBO["cfg"] == 1.0 and 8 <= TURBO["steps"] <= 12
    assert parse_sampling() is None and parse_sampling("turbo") == TURBO
    own = parse_sampling(text='{"steps": 10, "cfg": 1, "sampler": "euler", "scheduler": "beta"}')
    assert own == {"steps": 10, "cfg": 1.0, "sampler": "euler", "scheduler": "beta"}
    for kw, want in (({"preset": "fast"}, "--sampling 'fast'"), ({"text": "{"}, "--sampling-json: not JSON"),
                     ({"text": '{"steps": 8}'}, "'cfg' is missing"),
                     ({"text": '{"steps": 8, "cfg": 1, "sampler": "nope", "scheduler": "simple"}'}, "sampler 'nope'"),
                     ({"text": '{"steps": 0, "cfg": 1, "sampler": "euler", "scheduler": "simple"}'}, "'steps'"),
                     ({"preset": "turbo", "text": "{}"}, "give one of them")):
        with pytest.raises(ValueError, match=re.escape(want)):
            parse_sampling(**kw)


def test_a_pack_records_its_sampling_and_the_one_reader_gives_it(pipeline_assets, tmp_path):
    import shutil
    _, pack = pipeline_assets
    mine = tmp_path / "pack"                                 # the manifest alone: the reader reads nothing else
    mine.mkdir()
    shutil.copy(pack / "manifest.json", mine / "manifest.json")
    assert pack_sampling(mine) is None                       # packs built before: none (prompt.json's defaults)
    assert record_sampling(mine, TURBO) and not record_sampling(mine, TURBO)     # rewritten once
    assert pack_sampling(mine) == TURBO
    assert json.loads((mine / "manifest.json").read_text())["sampling"] == TURBO
    bad = json.loads((mine / "manifest.json").read_text())
    bad["sampling"]["cfg"] = "one"
    with pytest.raises(ManifestError, match="cfg"):
        sampling_info(bad)


def test_pack_sampling_option_writes_the_record(tiny_dit, tmp_path):
    from models.commands.cli import main as models_main
    out = tmp_path / "turbo64"
    assert models_main(["pack", str(tiny_dit), "--out", str(out), "--resolution", "64x64", "--sampling",
                        "turbo"]) == 0
    assert pack_sampling(out) == TURBO
    from orchestrator.engine.packs import read_pack
    assert read_pack(out).sampling == TURBO
    assert models_main(["pack", str(tiny_dit), "--out", str(tmp_path / "x"), "--resolution", "64x64",
                        "--sampling-json", '{"steps": 3}']) != 0
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- the job takes it where it sets none

def test_unset_fields_take_the_record_of_the_pack_the_job_runs_on():
    sizes, rec = [(64, 64), (64, 128)], {(64, 64): None, (64, 128): TURBO}
    plain = resolve_prompt(prompt_record({"prompt": "a"}), resolution=sizes, sampling=rec)
    # a pack without a record: today's prompt.json defaults, unchanged
    assert (plain.steps, plain.cfg, plain.sampler, plain.scheduler) == (30, 4.0, "euler", "sgm_uniform")
    turbo = resolve_prompt(prompt_record({"prompt": "a", "height": 128}), resolution=sizes, sampling=rec)
    assert (turbo.steps, turbo.cfg, turbo.sampler, turbo.scheduler) == (8, 1.0, "er_sde", "simple")
    own = resolve_prompt(prompt_record({"prompt": "a", "height": 128, "steps": 12, "sampler": "euler"}),
                         resolution=sizes, sampling=rec)
    assert (own.steps, own.cfg, own.sampler, own.scheduler) == (12, 1.0, "euler", "simple")
    # Spectrum's default follows the sampler the job runs (heun does not take it)
    heun = resolve_prompt(prompt_record({"prompt": "a"}), resolution=[(64, 64)],
                          sampling={(64, 64): {**TURBO, "sampler": "heun"}})
    assert heun.sampler == "heun" and not heun.spectrum.enabled


def test_a_comfyui_graph_stays_exactly_as_sent():
    from orchestrator.http.comfy_graph import graph_to_job
    from tests.comfy_graphs import standard_graph
    job = graph_to_job(standard_graph(steps=5, cfg=4.0), sizes=[(128, 128)])
    spec = resolve_prompt(prompt_record(job.spec), resolution=[(128, 128)], sampling={(128, 128): TURBO})
    assert (spec.steps, spec.cfg) == (5, 4.0)
    assert (spec.sampler, spec.scheduler) == (job.spec["sampler"], job.spec["scheduler"])


def test_a1111_txt2img_leaves_unset_settings_to_a_recording_pack():
    from orchestrator.http.a1111 import to_spec
    body = {"prompt": "a", "negative_prompt": "b"}
    assert {k: to_spec(body)[k] for k in ("steps", "cfg", "sampler")} == {"steps": 20, "cfg": 7.0,
                                                                           "sampler": "euler"}   # A1111's own
    left = to_spec(body, recorded=True)
    assert not {"steps", "cfg", "sampler", "scheduler"} & set(left)
    spec = resolve_prompt(prompt_record(left), resolution=[(512, 512)], sampling={(512, 512): TURBO})
    assert (spec.steps, spec.cfg, spec.sampler) == (8, 1.0, "er_sde")
    asked = to_spec({**body, "steps": 11, "cfg_scale": 2.5, "sampler_name": "DPM++ 2M"}, recorded=True)
    assert (asked["steps"], asked["cfg"], asked["sampler"]) == (11, 2.5, "dpmpp_2m")


# ---------------------------------------------------------------- cfg 1: no negative prompt

def test_at_cfg_1_the_negative_prompt_is_not_encoded_and_the_record_says_so():
    from orchestrator.engine.report import JobReport, format_table, job_warnings
    one = parse_prompt_obj({"prompt": "a", "negative_prompt": "bad", "cfg": 1, "seed": 1})
    assert one.negative_ignored()
    assert not parse_prompt_obj({"prompt": "a", "negative_prompt": "bad", "cfg": 1.5}).negative_ignored()
    # a hires pass at another cfg runs an unconditional pass: the negative counts there
    hires = parse_prompt_obj({"prompt": "a", "negative_prompt": "bad", "cfg": 1, "hires": {"scale": 2, "cfg": 4}})
    assert not hires.negative_ignored() and not job_warnings(hires.to_dict())
    report = JobReport("j", one.to_dict()).to_dict()
    assert report["warnings"] and "not encoded" in report["warnings"][0]
    assert "warning: cfg 1: the negative prompt changes nothing" in format_table(report)
    assert JobReport("j", {**one.to_dict(), "negative_prompt": ""}).to_dict()["warnings"] == []


def test_the_encoder_is_sent_no_negative_prompt_at_cfg_1(monkeypatch):
    """The flow's ENCODE (the encoder and arena stubbed): the prompt only at cfg 1, both above it. The sampler at cfg
    1 runs no unconditional pass (models/sampling/sampler.py, as ComfyUI), so nothing reads that context."""
    from orchestrator.engine.plan import run as flow
    from models.sampling.sampler import Sampler
    assert Sampler(steps=4, cfg=1.0).passes == 1
    sent = []

    class Stop(Exception):
        pass

    def call(stage, msg, timeout):
        sent.append(msg)
        raise Stop

    for cfg, negative in ((1.0, ""), (4.0, "bad")):
        f = flow.PlanRunner.__new__(flow.PlanRunner)
        f.spec = parse_prompt_obj({"prompt": "a", "negative_prompt": "bad", "cfg": cfg, "seed": 1,
                                   "width": 64, "height": 64})
        f.job = type("J", (), {"id": "j"})()
        f.cfg = type("C", (), {"is_remote": staticmethod(lambda name: True)})()
        f.pack = type("P", (), {"text_tokens": 512})()
        f.settings = type("O", (), {"encode_timeout_s": 1.0})()
        f.control = type("S", (), {"call": staticmethod(call)})()
        with pytest.raises(Stop):
            f._encode_first((None, None))
        assert sent[-1].negative == negative and sent[-1].prompt == "a"


# ---------------------------------------------------------------- the estimate

def _reference_spec(**kw):
    obj = {**json.loads((ROOT / "examples" / "prompt.json").read_text()), **kw}
    for side, text in (("positive", "prompt"), ("negative", "negative_prompt")):
        if side in kw:                          # the entries say their side's text (prompt.json's rule: once)
            obj.pop(text, None)
    return parse_prompt_obj(obj, resolution=[(512, 512)])


def test_calls_follow_the_reference_boards_spectrum_run():
    """examples/prompt.json (20 steps, Spectrum): 11 computed steps, the reference board's own count (R8,
    cost.toml [job] spectrum_computed_steps); cfg 1 halves the passes, not the calls."""
    from models.board.cost import load_cost
    e = estimate_spec(_reference_spec(), {(512, 512): None}, BoardSettings())
    assert (e.calls, e.passes) == (load_cost()["job"]["spectrum_computed_steps"], 2)
    one = estimate_spec(_reference_spec(cfg=1.0), {(512, 512): None}, BoardSettings())
    assert (one.calls, one.passes) == (e.calls, 1) and one.denoise_s < e.denoise_s
    assert estimate_spec(_reference_spec(spectrum=False), {(512, 512): None}, BoardSettings()).calls == 20
    two = estimate_spec(_reference_spec(batch=2), {(512, 512): None}, BoardSettings())
    assert two.calls == 2 * e.calls and two.decode_s == pytest.approx(2 * e.decode_s)


def test_keeping_the_base_image_prices_its_decode_without_another_vae_start():
    """hires.keep_base on the latent path: one more decode per image at the first size, the VAE already up (its
    lifecycle not counted again); the pixel path decodes the first image anyway: the same price."""
    from models.board.account import job_figures
    from orchestrator.engine.estimate import board_model_for
    packs, board = {(512, 512): None, (768, 768): None}, BoardSettings()

    def est(**hires):
        obj = {**json.loads((ROOT / "examples" / "prompt.json").read_text()), "batch": 2,
               "hires": {"scale": 1.5, **hires}}
        return estimate_spec(parse_prompt_obj(obj, resolution=list(packs)), packs, board)
    model = board_model_for(None, (512, 512), board)
    first = job_figures(model, vae_up=True)["decode_npu_s"]
    assert est(keep_base=True).decode_s == pytest.approx(est().decode_s + 2 * first)
    assert 0 < first < job_figures(model)["decode_npu_s"]
    pixel = {"space": "pixel", "method": "lanczos"}
    assert est(keep_base=True, **pixel).decode_s == pytest.approx(est(**pixel).decode_s)


@pytest.mark.parametrize("policy,cfg", [("prefetch2", 4.0), ("prefetch+dual_core", 4.0), ("on-demand", 1.0)])
def test_the_estimate_is_the_board_benchs_projection(policy, cfg):
    """bench/overhead.py --analytic (its own sum of encode, the policy's timeline over the calls, and decode) for the
    same policy, calls, passes, size and VAE: the same job seconds."""
    sys.path.insert(0, str(ROOT))
    from bench import overhead
    spec = _reference_spec(cfg=cfg)
    e = estimate_spec(spec, {(512, 512): None}, BoardSettings(policy=policy))
    out = io.StringIO()
    with redirect_stdout(out):
        assert overhead.main(["--analytic", "--policy", policy, "--board-ram", "8", "--calls", str(e.calls),
                              "--cfg", str(cfg), "--resolution", "512x512", "--vae", "npu"]) == 0
    bench_job = float(out.getvalue().strip().splitlines()[-1].split("job_s=")[1])
    assert round(e.job_s, 1) == pytest.approx(bench_job, abs=0.06)
    cpu = estimate_spec(spec, {(512, 512): None}, BoardSettings(policy=policy, vae="cpu"))
    assert cpu.decode_s == pytest.approx(155.04)             # the reference's sd.cpp CPU VAE at 512x512 (R11)


def test_auto_prices_the_pack_the_board_model_picks_as_the_bench_does():
    """No run folder, `auto`: the 1 MP Turbo 8-step cfg 1 job on the pack bench/overhead.py --analytic --policy auto
    prices (the sharded pack auto picks: 875 s of denoise, not the unsharded pack's), and its encoder at cfg 1 (the
    prompt alone): the bench's own job seconds, line for line, cold and with every prompt cached (--warm; on 8 GB
    the VAE is not kept up through the denoise, so the two differ by the encoder alone)."""
    sys.path.insert(0, str(ROOT))
    from bench import overhead
    spec = parse_prompt_obj({"prompt": "a lighthouse", "negative_prompt": "blurry", "width": 1024, "height": 1024,
                             "steps": 8, "cfg": 1, "sampler": "er_sde", "scheduler": "simple", "spectrum": False},
                            resolution=[(1024, 1024)])
    jobs = {}
    for cached in (False, True):
        e = jobs[cached] = estimate_spec(spec, {(1024, 1024): None}, BoardSettings(), cached=cached)
        out = io.StringIO()
        with redirect_stdout(out):
            assert overhead.main(["--analytic", "--policy", "auto", "--board-ram", "8", "--vae", "npu", "--resolution",
                                  "1024x1024", "--calls", "8", "--cfg", "1"] + (["--warm"] if cached else [])) == 0
        bench_job = float(out.getvalue().strip().splitlines()[-1].split("job_s=")[1])
        assert (e.calls, e.passes) == (8, 1) and "shards" in e.policy
        assert round(e.job_s, 1) == pytest.approx(bench_job, abs=0.06)
        assert (e.encode_s == 0.0) == cached and (cached or 23 < e.encode_s < 24)
    assert jobs[False].job_s <= 1000.0            # issue 43's modelled target, FP16 pack, cold


def test_an_unsharded_run_folder_pack_is_priced_as_built_and_says_what_shards_would_give(tmp_path):
    """A run folder's 1 MP pack of one graph per branch (as `bundle` builds them): priced as the board runs it, with a
    note naming `pack --shards N` and its denoise; that figure is bench/overhead.py --analytic --pack on the same pack
    (auto weighing the sharded builds), and a pack built sharded is priced with its own shards (no note)."""
    sys.path.insert(0, str(ROOT))
    from bench import overhead
    from tests.doubles_harness import fake_pack
    pack = fake_pack(tmp_path / "p1024", 1024, 1024)
    spec = parse_prompt_obj({"prompt": "a", "width": 1024, "height": 1024, "steps": 8, "cfg": 1,
                             "sampler": "er_sde", "scheduler": "simple", "spectrum": False},
                            resolution=[(1024, 1024)])
    e = estimate_spec(spec, {(1024, 1024): pack}, BoardSettings())
    note = next(n for n in e.notes if "not sharded" in n)
    n, sharded_s = re.search(r"--shards (\d)` the denoise would be (\d+\.\d) s", note).groups()
    assert int(n) > 1 and float(sharded_s) < e.denoise_s
    out = io.StringIO()
    with redirect_stdout(out):
        assert overhead.main(["--analytic", "--pack", str(pack), "--policy", "auto", "--board-ram", "8", "--vae",
                              "npu", "--resolution", "1024x1024", "--calls", "8", "--cfg", "1"]) == 0
    bench_job = float(out.getvalue().strip().splitlines()[-1].split("job_s=")[1])
    assert e.encode_s + float(sharded_s) + e.decode_s == pytest.approx(bench_job, abs=0.15)
    man = json.loads((pack / "manifest.json").read_text())
    man["shards"] = {"n": int(n), "cuts": {"self": "heads", "cross": "heads", "ffn": "heads"}}
    (pack / "manifest.json").write_text(json.dumps(man))
    again = estimate_spec(spec, {(1024, 1024): pack}, BoardSettings())
    assert not any("not sharded" in x for x in again.notes) and again.denoise_s < e.denoise_s


def test_estimate_line_round_trips_and_keeps_its_format():
    e = Estimate(39.0, 553.84, 25.0, 11, 2, "auto: prefetch2", 8, (512, 512), "models/board/cost.toml")
    assert LINE.match(e.line()) and e.line() == ("estimate job_s=617.8 encode_s=39.0 denoise_s=553.8 decode_s=25.0 "
                                                 "calls=11 passes=2 [modelled]")
    assert Estimate.from_dict(json.loads(json.dumps(e.to_dict()))) == e
    assert all(line.startswith("modelled") for line in e.lines()[:-1])


def test_cli_estimate_without_a_run_folder(tmp_path, capsys):
    assert cli.main(["--run", str(tmp_path / "none"), "estimate", str(ROOT / "examples" / "prompt.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert LINE.match(out[-1]) and "calls=11 passes=2" in out[-1]
    bad = tmp_path / "bad.json"
    bad.write_text('{"prompt": "a", "cfg": 0}')
    assert cli.main(["--run", str(tmp_path / "none"), "estimate", str(bad)]) == 2
    assert "'cfg'" in capsys.readouterr().err


@pytest.fixture
def turbo_daemon(tmp_path):
    """inproc_daemon's run folder with its 64x64 pack recording Turbo's settings."""
    from tests.conftest import open_inproc_daemon
    with open_inproc_daemon(tmp_path, lambda pack: record_sampling(pack, TURBO)) as client:
        yield client


def test_a_turbo_run_folder_estimates_and_queues_turbo_jobs(turbo_daemon, tmp_path, capsys):
    from models.sampling.sampler import Sampler
    from models.sampling.spectrum import SpectrumSettings
    rf, daemon = turbo_daemon.daemon.rf, turbo_daemon.daemon
    prompt = tmp_path / "p.json"
    prompt.write_text(json.dumps({"prompt": "1girl", "negative_prompt": "worst quality", "seed": 3}))
    run = ["--run", str(rf.root)]
    assert cli.main(run + ["estimate", str(prompt)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    calls = len(Sampler(steps=8, cfg=1.0, sampler="er_sde", scheduler="simple", spectrum=SpectrumSettings()).plan())
    assert LINE.match(out[-1]) and f"calls={calls} passes=1" in out[-1], out
    assert any("not encoded" in line for line in out)
    assert cli.main(run + ["generate", "1girl", "--estimate", "--steps", "12"], connect=turbo_daemon.connect) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert LINE.match(line) and "passes=1" in line and daemon.store.entries()[0] == []     # nothing queued
    # the daemon's ESTIMATE: checked as SUBMIT is, nothing queued
    reply = daemon.handle(m.EstimateJob(prompt=prompt_record({"prompt": "a"}), base_dir=str(tmp_path)))
    assert isinstance(reply, m.Estimated) and json.loads(reply.estimate)["passes"] == 1
    refused = daemon.handle(m.EstimateJob(prompt=prompt_record({"prompt": "a", "width": 128}),
                                          base_dir=str(tmp_path)))
    assert isinstance(refused, m.Error) and refused.field == "width"
    assert daemon.store.entries()[0] == []
    # a submit: the job runs Turbo's settings, a set field kept
    assert cli.main(run + ["submit", str(prompt)], connect=turbo_daemon.connect) == 0
    job = daemon.store.entries()[0][-1]
    spec = daemon.store.get(job.id).spec
    assert (spec["steps"], spec["cfg"], spec["sampler"], spec["scheduler"]) == (8, 1.0, "er_sde", "simple")
    info = daemon.handle(m.Info())
    assert info.packs[0].sampling.to_dict() == TURBO


def test_the_report_shows_the_estimate_beside_the_measured():
    from orchestrator.engine.report import JobReport, format_table
    e = Estimate(39.0, 553.8, 25.0, 11, 2, "auto: prefetch2", 8, (512, 512), "models/board/cost.toml")
    r = JobReport("j", {"prompt": "a", "cfg": 4.0})
    r.estimate = e.to_dict()
    r.stages["encoder"].wall_s, r.stages["scheduler"].wall_s, r.stages["vae"].wall_s = 1.5, 12.25, 0.75
    d = json.loads(json.dumps(r.to_dict()))
    assert d["estimate"]["job_s"] == pytest.approx(617.8) and d["estimate"]["label"] == "modelled"
    text = format_table(d).splitlines()
    est = next(line for line in text if line.startswith("estimate (modelled)"))
    meas = next(line for line in text if line.startswith("measured"))
    assert est.split()[2:6] == ["39.0", "553.8", "25.0", "617.8"]
    assert meas.split()[1:4] == ["1.5", "12.2", "0.8"]


def test_entries_are_priced_as_their_branch_sweeps():
    """Two combined prompts at cfg 4: 3 DiT passes a call, two sweeps of the branches (the plain job's one);
    the halves at 8 steps (euler / simple): one sweep a call but at sigma 0.75 (both halves and the negative). The
    sweeps are priced as CFG calls of the same policy and pack: twice the calls, twice the seconds less the cold
    start's share."""
    base = dict(spectrum=False, steps=8, sampler="euler", scheduler="simple", cfg=4.0)
    plain = estimate_spec(_reference_spec(**base), {(512, 512): None}, BoardSettings())
    two = estimate_spec(_reference_spec(**base, positive=[{"text": "a"}, {"text": "b"}]), {(512, 512): None},
                        BoardSettings())
    assert (plain.calls, plain.passes) == (8, 2)
    assert (two.calls, two.passes) == (8, 3) and any("16 branch sweeps" in n for n in two.notes)
    assert 1.5 * plain.denoise_s < two.denoise_s <= 2.0 * plain.denoise_s + 1e-9
    halves = estimate_spec(_reference_spec(**base, positive=[{"text": "a", "end": 0.5}, {"text": "b", "start": 0.5}]),
                           {(512, 512): None}, BoardSettings())
    assert any("9 branch sweeps" in n for n in halves.notes) and halves.passes == 3


def test_the_shard_search_is_done_once_per_pack_board_and_call_count(tmp_path, monkeypatch):
    """Every job's report priced its job, and the shard note searched the sharded builds each time (~7 s a job
    before its encoder on a busy 2-core machine: bench/fuzz_http.py's accepted jobs waited for it); the answer is kept
    by the pack's shape, the cost file, size, calls and passes: the same job again does not search, another step
    count or a changed cost file does, and the note is the same as the search's."""
    from models.board import auto
    from orchestrator.engine import estimate
    from tests.doubles_harness import fake_pack
    monkeypatch.setattr(estimate, "_SHARD_CHOICES", estimate.OrderedDict())
    searches = []
    real = auto.choose_pack
    monkeypatch.setattr(auto, "choose_pack", lambda *a, **k: searches.append(k["computed_steps"]) or real(*a, **k))
    pack = fake_pack(tmp_path / "p1024", 1024, 1024)

    def note(steps, board=BoardSettings()):
        spec = parse_prompt_obj({"prompt": "a", "width": 1024, "height": 1024, "steps": steps, "cfg": 1,
                                 "sampler": "er_sde", "scheduler": "simple", "spectrum": False},
                                resolution=[(1024, 1024)])
        return [n for n in estimate_spec(spec, {(1024, 1024): pack}, board).notes if "not sharded" in n]
    first = note(8)
    assert first and note(8) == first and searches == [8]
    assert note(9) and searches == [8, 9]
    cost = tmp_path / "cost.toml"
    from models.board.cost import COST_FILE
    cost.write_bytes(COST_FILE.read_bytes())
    assert note(8, BoardSettings(board_cost=str(cost))) == first and searches == [8, 9, 8]
    os.utime(cost, ns=(1, 1))                                 # the file changed: searched again
    assert note(8, BoardSettings(board_cost=str(cost))) == first and searches == [8, 9, 8, 8]
