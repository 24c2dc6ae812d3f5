"""Daily use through the REAL pipeline (supervisord + the real stages on the tiny bundle, 128x128 pack, 2 steps):
`orchestrator generate` and `submit -` as a user runs them (subprocesses), Ctrl-C on both, the PNG's chunks read as
ComfyUI reads them, and the job's timing.png with the report figures it was drawn from."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from PIL import Image

from models.setup.models_dir import resolve_models
from models.packs.pack import load_pack
from models.sampling.spectrum import SpectrumSettings
from orchestrator.http.comfy_graph import ModelNames, graph_to_job
from tests.comfy_png import read_comfy_png
from tests.pipeline_harness import Pipeline

SIZE = (128, 128)
CLI_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def pipe(pipeline_assets, board_stages):
    models, pack = pipeline_assets
    p = Pipeline.start(models, pack, threads=1, timing_plot=True, extra_toml=board_stages)     # the board's stages
    try:
        yield p
    finally:
        p.stop_clean()


def cli(pipe, *args, cwd, stdin=None, timeout=CLI_TIMEOUT_S):
    """The orchestrator CLI as a user runs it: its own process, this run folder."""
    return subprocess.run([sys.executable, "-m", "orchestrator.terminal.cli", "--run", str(pipe.root), *args], cwd=cwd,
                          input=stdin, capture_output=True, timeout=timeout)


def _clean(pipe):
    assert pipe.leftover_segments() == [], "a /dev/shm segment outlived its job"
    assert pipe.strays() == [] and pipe.stage_children() == [], "a process outlived its job (the plot's child?)"


def test_generate_one_line_prints_the_image_path(pipe, pipeline_assets, tmp_path):
    r = cli(pipe, "generate", "1girl, silver hair, (blue eyes:1.2)", "--negative", "worst quality", "--seed", "7",
            "--steps", "2", "-o", "out.png", cwd=tmp_path)
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0, err + pipe.logs()
    image = tmp_path / "out.png"
    assert out.splitlines()[-1] == str(image) and image.is_file()
    assert "queued (seed 7" in err and "computed steps" in err and "timing plot" in err
    job = err.split("job ", 1)[1].split()[0]
    info = pipe.status(job)
    assert info.state == "done" and info.image == str(image)

    # the PNG as ComfyUI reads it: the editor graph is loaded, and both graphs are this job
    png = read_comfy_png(image.read_bytes())
    assert png["dropped"] == "workflow"
    models, pack_dir = pipeline_assets
    pack = load_pack(pack_dir)
    files = resolve_models(models, {}, need=("text_encoder", "vae"))
    names = ModelNames(unet=(pack.source["name"],), clip=(files.text_encoder.name,), vae=(files.vae.name,))
    spec = graph_to_job(png["prompt"], names=names, sizes=[SIZE]).spec          # the loaders name these files
    sp = spec.pop("spectrum")                  # `generate` keeps Spectrum on: the graph carries it as its node
    assert sp["enabled"] is True and SpectrumSettings.from_dict(sp) == SpectrumSettings()
    assert spec == {"prompt": "1girl, silver hair, (blue eyes:1.2)", "negative_prompt": "worst quality", "seed": 7,
                    "steps": 2, "cfg": 4.0, "width": 128, "height": 128, "sampler": "euler",
                    "scheduler": "sgm_uniform"}
    assert "Seed: 7" in png["texts"]["parameters"] and json.loads(png["texts"]["anima"])["job"] == job

    # timing.png next to report.json, drawn from the report's figures
    report = pipe.report(job)
    plot = pipe.job_dir(job) / "timing.png"
    Image.open(plot).verify()
    drawn = json.loads(Image.open(plot).text["anima-plot"])
    assert drawn["provenance"] == "measured on this machine"
    # the executor's branch kinds, and the board VAE's pack models (one trunk call, then the tile model) beside them
    assert {"trunk_infer_s", "tile_infer_s"} <= set(report["vae_timings"]), report["vae_timings"]
    assert drawn["panels"]["branches"] == sorted([*report["branches"], "vae trunk", "vae tile"])
    assert set(drawn["panels"]["memory"]) == {"encoder", "scheduler", "executor", "vae"} == set(
        report["memory"]["series"])
    assert [p[0] for p in report["phases"]] == ["encoding", "denoising", "decoding"]
    denoise = report["phases"][1]
    for stage in ("scheduler", "executor"):
        times = [t for t, _ in report["memory"]["series"][stage]]
        assert len(times) >= 2 and min(times) >= denoise[1] - 0.5 and max(times) <= denoise[2] + 0.5
    _clean(pipe)


def test_submit_stdin_and_ctrl_c_leaves_the_job_running(pipe, tmp_path):
    """`submit - --wait` reads prompt.json from stdin; Ctrl-C stops following and the job goes on to its image (one
    job for both: each costs an encoder start)."""
    body = tmp_path / "body.json"
    # 2 steps: Ctrl-C comes once step 1 is reported, with a step and the decode still to go
    body.write_text(json.dumps({"prompt": "a cat", "seed": 11, "steps": 2, "spectrum": False, "output": "cats"}))
    (tmp_path / "cats").mkdir()
    job, rc, err = _start_and_interrupt(pipe, ["submit", "-", "--wait"], tmp_path, stdin=body)
    assert rc == 130 and f"job {job} goes on" in err and "Traceback" not in err, err
    info = pipe.wait(job, timeout_s=300)
    assert info.state == "done", f"{info.error}\n{pipe.logs()}"                  # not cancelled: it went on
    assert info.image == str(tmp_path / "cats" / f"{job}.png")                   # relative to where it ran
    assert json.loads(Image.open(info.image).text["anima"])["seed"] == 11
    _clean(pipe)
    # bad input on stdin: exit 2 naming the field, nothing queued
    before = len(list(pipe.rf.jobs.iterdir()))
    r = cli(pipe, "submit", "-", cwd=tmp_path, stdin=b'{"prompt": "a", "steps": 0}')
    assert r.returncode == 2 and b"field 'steps'" in r.stderr
    r = cli(pipe, "submit", "-", cwd=tmp_path, stdin=b"")
    assert r.returncode == 2 and b"standard input is empty" in r.stderr
    assert len(list(pipe.rf.jobs.iterdir())) == before


def test_generate_bad_input_names_the_option_and_queues_nothing(pipe, tmp_path):
    before = len(list(pipe.rf.jobs.iterdir()))
    for args, flag in ((["-W", "256", "-H", "256"], "-W/--width"), (["--steps", "0"], "--steps"),
                       (["--cfg", "nan"], "--cfg"), (["-o", str(tmp_path / "no" / "x.png")], "-o/--output"),
                       (["--scheduler", "Karras"], "--scheduler"),
                       (["--sampler", "Euler a"], "--sampler")):
        r = cli(pipe, "generate", "a", *args, cwd=tmp_path)
        assert r.returncode == 2 and f"error: {flag}: ".encode() in r.stderr, (args, r.stderr)
        assert b"Traceback" not in r.stderr
    r = cli(pipe, "generate", "", cwd=tmp_path)
    assert r.returncode == 2 and b"PROMPT: must not be empty" in r.stderr
    assert len(list(pipe.rf.jobs.iterdir())) == before


def _start_and_interrupt(pipe, args, tmp_path, stdin=None):
    """Run the CLI (`stdin`: a file it reads as standard input), wait until its job is denoising, press Ctrl-C
    (SIGINT). -> (job, exit status, stderr)."""
    with open(stdin or os.devnull, "rb") as f:
        # SIGINT as a terminal's Ctrl-C finds it: a suite started in the background by a non-interactive shell (`make
        # test &`, CI runners) inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored.
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.terminal.cli", "--run", str(pipe.root), *args],
                                cwd=tmp_path, stdin=f, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        for line in proc.stderr:                    # a line per state or step change (stderr is not a terminal)
            lines.append(line)
            if "step 1/" in line:
                break
        assert lines and "step 1/" in lines[-1], "".join(lines) + pipe.logs()
        job = "".join(lines).split("job ", 1)[1].split()[0]
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
        return job, proc.returncode, "".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_cancels_generate(pipe, tmp_path):
    job, rc, err = _start_and_interrupt(pipe, ["generate", "a long one", "--steps", "40", "--no-spectrum"], tmp_path)
    assert rc == 130 and f"job {job} cancelled (Ctrl-C)" in err and "Traceback" not in err, err
    assert pipe.wait(job, ("cancelled",), timeout_s=120).state == "cancelled"
    _clean(pipe)



def test_reload_after_adding_packs_runs_the_next_hires_and_lora_jobs(pipe, pipeline_assets, tmp_path):
    """Issue 44, on the running pipeline (last in this module: it leaves the pipeline on the edited file): a pack of
    another size and a LoRA-ready pack added with `init --add-pack`, the LoRAs' models folder and the VAE pack of the
    new size (`anima-models pack-vae`) edited in by hand; a job is refused naming `orchestrator reload` until it ran,
    then the hires job and the LoRA job run, with no other command."""
    import re
    import shutil
    import time
    import urllib.request

    from models.commands.cli import main as models_main
    from models.lora.synth import write_lora
    from tests.pipeline_harness import tiny_assets
    models, pack = pipeline_assets
    ready = tiny_assets(pack.parent, (64, 64), lora_rank=4)[1]                  # LoRA-ready, the new size
    vae64 = tmp_path / "vae-64x64"                                              # the board VAE's pack of that size
    vae_file = resolve_models(models, {}, need=("vae",)).vae
    assert models_main(["pack-vae", str(vae_file), "--out", str(vae64), "--resolution", "64x64"]) == 0
    mine = shutil.copytree(models, tmp_path / "models", copy_function=os.link)  # the session's folder stays as it is
    (mine / "loras").mkdir(exist_ok=True)
    write_lora("tiny", 5, mine / "loras" / "style.safetensors", "kohya", rank=4, groups=("blocks",))
    r = cli(pipe, "init", "--add-pack", str(ready), cwd=tmp_path)
    assert r.returncode == 0 and "added" in r.stdout.decode(), r.stderr.decode()
    toml = pipe.rf.pipeline_toml
    text = re.sub(r'^models_dir = .*$', f'models_dir = "{mine}"', toml.read_text(), count=1, flags=re.M)
    toml.write_text(re.sub(r'^(vae_pack = \[[^\]]*)\]', rf'\1, "{vae64}"]', text, count=1, flags=re.M))
    hires = ("generate", "a", "--seed", "3", "--steps", "1", "-W", "64", "-H", "64", "--hires", "128x128",
             "--hires-steps", "1", "-o", "hires.png")      # 1 step a pass: the sizes and the packs are the subject
    r = cli(pipe, *hires, cwd=tmp_path)
    assert r.returncode != 0 and "orchestrator reload" in r.stderr.decode(), r.stderr.decode()
    r = cli(pipe, "reload", cwd=tmp_path)
    out = r.stdout.decode()
    assert r.returncode == 0 and all(f"{p} RUNNING" in out for p in ("scheduler", "executor", "orchestrator", "http")), \
        r.stderr.decode() + pipe.logs()
    r = cli(pipe, *hires, cwd=tmp_path)
    assert r.returncode == 0, r.stderr.decode() + pipe.logs()
    assert Image.open(tmp_path / "hires.png").size == (128, 128)
    r = cli(pipe, "generate", "a", "--seed", "4", "--steps", "1", "-W", "64", "-H", "64", "--lora", "style",
            "-o", "lora.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr.decode() + pipe.logs()
    assert Image.open(tmp_path / "lora.png").size == (64, 64)
    deadline, listed = time.monotonic() + 60, ""
    while "style.safetensors" not in listed and time.monotonic() < deadline:     # the front restarted, new port
        try:
            with urllib.request.urlopen(pipe.http_url().rstrip("/") + "/object_info/LoraLoader", timeout=10) as page:
                listed = page.read().decode()
        except OSError as e:
            listed = f"{e}"
            time.sleep(0.5)
    assert "style.safetensors" in listed, listed + pipe.logs()   # the front's LoRAs: those of the new models folder
    assert "nothing to reload" in cli(pipe, "reload", cwd=tmp_path).stdout.decode()
    _clean(pipe)
