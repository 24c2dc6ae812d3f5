"""docs/cookbook.md, run: every fenced `sh` block as one bash script and the `page` block in Chromium, in the page's
order, on one demo folder (`python -m orchestrator.terminal.demo`, what `make demo` runs) started once for the module.

The blocks are read from the page itself, so the page and this test cannot drift apart. To fit the suite's time the
demo is made at half the page's default size (--resolution 128x128: packs 128, 192 and 256 instead of 256, 384 and
512) and each command is shrunk the same way before it runs: every size it names halved, every step count 2, the
page's URL the front's (the demo takes a free port here). A command this shrinking does not cover fails the test
(`_shrunk`), rather than running at full size. Each image a command writes is checked at its size (halved). After
the demo's own job the folder's text encoder is the board's ONNX one (`cookbook_folder`): the commands' jobs, not the
torch encoder's start, are what this module runs."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
COOKBOOK = REPO / "docs" / "cookbook.md"
DOC_DEFAULT, TEST_DEFAULT = 256, 128                 # the demo's default size on the page, and here
BLOCK_S = 600                                        # one block's commands, at most
CHROMIUM = Path("/usr/bin/chromium")
# the images the page's commands write (in the checkout's folder), at the page's sizes
IMAGES = {"first.png": (256, 256), "out.png": (512, 512), "hires.png": (384, 384), "two-loras.png": (256, 256),
          "inpaint.png": (256, 256), "a1111.png": (384, 384),
          "a1111-inpaint.png": (256, 256), "comfy.png": (256, 256), "comfy-img2img.png": (256, 256)}
# what each job was, from the PNG's own record (its `anima` chunk): its LoRAs (A1111 names them by their stem) and
# which of hires, init_image, mask it had
LORAS = {"two-loras.png": ["demo-style.safetensors", "mine.safetensors"],
         "a1111.png": ["demo-style"], "comfy.png": ["demo-style.safetensors"], "first.png": []}
KINDS = {"first.png": set(), "out.png": set(), "hires.png": {"hires"}, "a1111.png": {"hires"},
         "inpaint.png": {"init_image", "mask"}, "a1111-inpaint.png": {"init_image", "mask"},
         "comfy-img2img.png": {"init_image"}}


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of the page, in order."""
    return [(m["lang"], m["body"]) for m in re.finditer(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```$", text, re.M | re.S)]


def _half(m: re.Match) -> str:
    return f"{m['key']}{int(m['n']) * TEST_DEFAULT // DOC_DEFAULT}"


STEPS = re.compile(r'(?P<key>--steps |--hires-steps |"steps": |"hr_second_pass_steps": |type )(?P<n>\d+)'
                   r'(?P<tail> into (Hires steps|Steps))?')
SIZES = re.compile(r'(?P<key>-W |-H |"width": |"height": )(?P<n>\d+)')
PICK = re.compile(r'pick (?P<w>\d+)x(?P<h>\d+) in Size')


def _shrunk(body: str, url: str) -> str:
    """The block with the test's sizes, 2 steps a job and the front's URL; a step count left is an error (a size
    left shows in its image's size)."""
    out = body.replace("http://127.0.0.1:8188", url.rstrip("/"))
    out = STEPS.sub(lambda m: f"{m['key']}2{m['tail'] or ''}" if m["key"] != "type " or m["tail"] else m[0], out)
    out = SIZES.sub(_half, out)
    out = PICK.sub(lambda m: f"pick {int(m['w']) // 2}x{int(m['h']) // 2} in Size", out)
    left = [m[0] for m in re.finditer(r'steps\W{0,3}(?!2\b)\d+', out, re.I)]      # a size left: its image's check
    assert not left, f"the test does not know how to shrink {left} in docs/cookbook.md:\n{body}"
    return out


def test_the_cookbook_opens_with_make_demo_and_holds_only_runnable_blocks():
    """The page's blocks are all `sh` or `page` (what the test runs); the first is `make demo`, the one command the
    test runs its own way (`python -m orchestrator.terminal.demo`, the Makefile's demo recipe, with its test arguments)."""
    found = blocks(COOKBOOK.read_text())
    assert found and {lang for lang, _ in found} <= {"sh", "page"}, [lang for lang, _ in found]
    assert found[0] == ("sh", "make demo\n")
    assert "-m orchestrator.terminal.demo --run $(RUN)" in (REPO / "Makefile").read_text()
    assert _shrunk('generate x --steps 20 -W 512 -H 384\n"steps": 30, "width": 256', "http://h:1") == \
        'generate x --steps 2 -W 256 -H 192\n"steps": 2, "width": 128'
    with pytest.raises(AssertionError, match="does not know how to shrink"):
        _shrunk("generate x --hires 2 --hires-steps=12 -W 512", "http://h:1")


@pytest.fixture(scope="module")
def demo_folder(tiny_bundle):
    """The checkout's folder as the cookbook sees it, in a short /tmp folder: .venv and the demo's run/ (made by
    the demo at 128x128, its front on a free port, its first job 2 steps); supervisord shut down at the end. The
    demo's tiny models are the session's, hard-linked where the demo keeps them (run/bundle/models: the demo finds
    them complete and adds its LoRA to its copy), as tests/test_demo.py does; the demo writing them is that
    module's test."""
    from orchestrator.engine.supervisor import Supervisor, SupervisorError
    root = Path(tempfile.mkdtemp(prefix="anima-cb-", dir="/tmp"))
    (root / ".venv").symlink_to(REPO / ".venv")
    (root / "run").mkdir(mode=0o700)                        # a run folder is private (the demo checks)
    shutil.copytree(tiny_bundle, root / "run" / "bundle" / "models", copy_function=os.link)
    prompt = root / "two-steps.json"
    prompt.write_text(json.dumps({"prompt": "1girl, demo", "seed": 3, "steps": 2}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "orchestrator.terminal.demo", "--run", str(root / "run"), "--resolution",
           f"{TEST_DEFAULT}x{TEST_DEFAULT}", "--port", "0", "--prompt", str(prompt)]
    try:
        made = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=BLOCK_S)
        assert made.returncode == 0, made.stderr[-3000:]
        yield root, env, json.loads((root / "run" / "http.json").read_text())["url"], made
    finally:
        try:
            sup = Supervisor(root / "run" / "supervisor.sock")
            sup.shutdown()
            sup.wait_gone()
        except (SupervisorError, OSError):
            pass
        shutil.rmtree(root, ignore_errors=True)


def test_make_demo_runs_a_job_and_leaves_supervisord_up(demo_folder):
    """`make demo` as it runs (python -m orchestrator.terminal.demo, a subprocess: the fixture's run, on the folder the page's
    commands then use): models and packs found, the run folder's supervisord started, the job queued, followed and
    its timing table printed, the image and report paths last, the page's URL, supervisord left up. The demo run
    again with --stop on a running supervisord is tests/test_demo.py's."""
    from orchestrator.terminal import demo
    from orchestrator.engine.supervisor import Supervisor
    from stages.config import load_config
    root, _, _, made = demo_folder
    run = root / "run"
    out = dict(line.split(":  ", 1) if ":  " in line else line.split(": ", 1) for line in made.stdout.splitlines())
    image, report = Path(out["image"].strip()), Path(out["report"].strip())
    assert Image.open(image).size == (TEST_DEFAULT, TEST_DEFAULT) and json.loads(report.read_text())["stages"]
    assert (run / "bundle" / "models" / "loras" / demo.DEMO_LORA).is_file()
    cfg = load_config(run / "pipeline.toml")
    assert [p.name for p in cfg.packs] == [f"pack-{s}x{s}-lora8" for s in (128, 192, 256)]
    assert cfg.stage_settings("http")["port"] == 0
    for says in ("models, LoRA and packs ready", "4) starting supervisord", "5) job", "stage ", "done in",
                 "supervisord keeps running", "web page: http://127.0.0.1:"):
        assert says in made.stderr, (says, made.stderr[-2000:])
    assert Supervisor(run / "supervisor.sock").ping() == "RUNNING"    # left up for the next job


@pytest.fixture(scope="module")
def cookbook_folder(demo_folder, tiny_bundle):
    """demo_folder after the demo's own job, set as the suite's pipelines are (tests/pipeline_harness.py): one CPU
    thread a stage (`make test` runs two workers on two cores) and the board's ONNX text encoder (the [stage.encoder]
    table of board_stage_toml: the session's tiny models' encoder pack, built once per run, as test_chaos.py's
    pipeline has it; the demo's models are the same files); `orchestrator reload` restarts what that concerns, the
    front on a new free port. Each command's job starts the encoder (new prompts or LoRAs): ~1 CPU-s on ONNX
    Runtime against ~6-11 with torch + transformers, a dozen times. The page's subject is the commands; the demo's
    job as the demo sets it up is test_make_demo_runs_a_job_and_leaves_supervisord_up's, the torch encoder's jobs
    the pipeline tests' (test_e2e_pipeline, test_lora_pipeline ...)."""
    import requests
    from orchestrator.engine.runfolder import RunFolder
    from tests.pipeline_harness import board_stage_toml
    root, env, _, made = demo_folder
    run = RunFolder(root / "run")
    text = run.pipeline_toml.read_text()
    first_table = text.index("\n[") + 1                    # a top-level key goes before the first table
    run.pipeline_toml.write_text(text[:first_table] + "threads = 1\n" + text[first_table:] + "\n"
                                 + board_stage_toml(tiny_bundle, tiny_bundle.parent, stages=("encoder",)))
    r = subprocess.run([str(root / ".venv" / "bin" / "orchestrator"), "--run", "run", "reload"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=BLOCK_S)
    assert r.returncode == 0 and "orchestrator RUNNING" in r.stdout, r.stdout + r.stderr[-3000:]
    deadline = time.monotonic() + 60
    while True:                                             # the restarted front writes its URL, then answers
        try:
            url = json.loads(run.http_json.read_text())["url"]
            if requests.get(url, timeout=5).ok:
                return root, env, url, made
        except (OSError, ValueError, KeyError, requests.RequestException):
            pass
        assert time.monotonic() < deadline, "the HTTP front did not answer within 60 s of `orchestrator reload`"
        time.sleep(0.3)


def test_every_cookbook_command_runs_on_the_demo_folder(cookbook_folder):
    import psutil
    from orchestrator.engine.supervisor import Supervisor, SupervisorError
    from protocol.arena import list_segments, run_prefix
    root, env, url, _ = cookbook_folder
    for i, (lang, body) in enumerate(blocks(COOKBOOK.read_text())[1:], 1):
        script = _shrunk(body, url)
        if lang == "page":
            _do_on_the_page(script, root)
            continue
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=root, env=env, capture_output=True,
                           text=True, timeout=BLOCK_S)
        assert r.returncode == 0, f"block {i} of docs/cookbook.md failed ({r.returncode}):\n{script}\n" \
                                  f"--- stdout\n{r.stdout[-2000:]}\n--- stderr\n{r.stderr[-3000:]}"
    for name, (w, h) in IMAGES.items():
        png = Image.open(root / name)
        assert png.size == (w // 2, h // 2), (name, png.size)
    for name, loras in LORAS.items():
        spec = json.loads(Image.open(root / name).text["anima"])
        assert [entry["name"] for entry in spec.get("loras") or []] == loras, (name, spec.get("loras"))
    for name, kind in KINDS.items():
        spec = json.loads(Image.open(root / name).text["anima"])
        assert {k for k in ("hires", "init_image", "mask") if spec.get(k)} == kind, (name, spec)
    run = root / "run"
    Supervisor(run / "supervisor.sock").wait_gone()           # the last block stopped it
    with pytest.raises(SupervisorError):
        Supervisor(run / "supervisor.sock").ping()
    mine = [p for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or ())]
    _, left = psutil.wait_procs(mine, timeout=30)      # supervisord's socket goes just before its process does
    assert [p.info["cmdline"] for p in left] == [] and list_segments(run_prefix(run)) == []


def _do_on_the_page(steps: str, root: Path) -> None:
    """The page block's lines in Chromium (Playwright): open URL, type X into LABEL, pick OPTION in LABEL, tick
    LABEL, press BUTTON, wait until done. The job it made is checked at its size."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: the cookbook's page block needs Debian's chromium (`make test` "
                    "installs it)")
    from playwright.sync_api import sync_playwright
    profile = Path(tempfile.mkdtemp(prefix="anima-chromium-"))
    try:
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(str(profile), executable_path=str(CHROMIUM), headless=True,
                                                        args=["--no-sandbox", "--disable-gpu", "--no-first-run"],
                                                        bypass_csp=True)
            try:
                page = ctx.new_page()
                for line in filter(None, (s.strip() for s in steps.splitlines())):
                    _page_step(page, line)
                job = page.text_content("#live-job").split()[-1]
            finally:
                ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert Image.open(root / "run" / "jobs" / job / "image.png").size == (192, 192)      # hires 1.5 of 128


def _page_step(page, line: str) -> None:
    if m := re.fullmatch(r"open (\S+)", line):
        page.goto(m[1])
        page.wait_for_function("document.getElementById('size').options.length > 0")
        page.wait_for_function("document.getElementById('conn').textContent === 'live'")
    elif m := re.fullmatch(r'type "?(.*?)"? into (.+)', line):
        _labelled(page, m[2]).fill(m[1])
    elif m := re.fullmatch(r"pick (\S+) in (.+)", line):
        _labelled(page, m[2]).select_option(m[1])
    elif m := re.fullmatch(r"tick (.+)", line):
        _labelled(page, m[1]).check()
    elif m := re.fullmatch(r"press (.+)", line):
        page.get_by_role("button", name=m[1], exact=True).click()
    elif line == "wait until done":
        page.wait_for_function("document.getElementById('live-state').textContent === 'done'",
                               timeout=BLOCK_S * 1000)
    else:
        raise AssertionError(f"docs/cookbook.md's page block: no such step {line!r}")


def _labelled(page, label: str):
    """The control whose label reads `label` (a select's accessible name also holds its chosen option's text)."""
    words = r"\s+".join(re.escape(w) for w in label.split())      # no escaped space: JavaScript's regex refuses it
    return page.get_by_label(re.compile(rf"^\s*{words}(\s|$)"))
