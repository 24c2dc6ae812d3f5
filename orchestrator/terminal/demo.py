"""`make demo`: the main job on the embedded tiny model, end to end through supervisord, on any machine.

    .venv/bin/python -m orchestrator.terminal.demo --run run                     # what `make demo` runs
    .venv/bin/python -m orchestrator.terminal.demo --run run --port 8190         # `make demo PORT=8190`: the HTTP front's port
    .venv/bin/python -m orchestrator.terminal.demo --run run --stop              # shut supervisord down afterwards
    .venv/bin/python -m orchestrator.terminal.demo --run run --prompt my.json --resolution 512x512

1) the tiny models folder (random weights, real key names, ComfyUI layout) in RUN/bundle/models, written once, with
   a synthetic LoRA in its loras/ (`anima-models synth lora`, DEMO_LORA);
2) its model packs in RUN/bundle/pack-WxH-loraR: the default size, 256x256 (examples/prompt.json names no size, so
   the default pack's is used), and 1.5x and 2x of it (384x384, 512x512: the README's `--hires 1.5` and
   `-W 512 -H 512`), all LoRA-ready (LORA_RANK), so that every example of the README and docs/cookbook.md runs on the
   demo's folder as it is. Why 256x256 by default and not 512x512: the tiny model's self-attention over 1024 image
   tokens dominates a step there; the 20-step example (11 computed steps) takes ~3-4 minutes of denoising on 2 idle
   cores and far longer on a shared machine, while a 256x256 job (256 tokens) took 6.9 minutes at load average ~10
   on 2 cores (near 1.5 minutes idle); `--resolution 512x512` makes that the default (and 768, 1024 the others).
3) the run folder (`orchestrator init`) pointing at them; 4) supervisord started unless it is already up, as
   `orchestrator start` starts it (one that is shutting down, e.g. right after `supervisorctl shutdown`, is waited
   for first: it still holds the socket);
5) the prompt submitted and followed (progress, then the timing table); the PNG and report.json paths are printed.
supervisord stays up afterwards (the scheduler and executor keep serving further `orchestrator submit`s; the HTTP
front serves the web page and the ComfyUI/A1111 APIs on http://127.0.0.1:8188/, or --port), and the last lines say
where the page is and how to stop it all (`orchestrator stop`); `--stop` shuts it down instead, as that does.
Running it again reuses the bundle, the packs and the running pipeline.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from models.base.durable import atomic_write
from orchestrator.engine.runfolder import ALWAYS_ON_STAGES, EXAMPLE_PROMPT, REPO_DIR, RunFolder, init_run, missing_modules

log = logging.getLogger(__name__)

DEFAULT_PROMPT = EXAMPLE_PROMPT
DEFAULT_RESOLUTION = (256, 256)    # see the module docstring
MORE_SIZES = (1.5, 2.0)            # the other packs, times the default size: the README's hires 1.5 and 512x512
LORA_RANK = 8                      # every demo pack LoRA-ready, room for two of the demo's rank-4 LoRA
DEMO_LORA = "demo-style.safetensors"
# what the demo writes to MODELS/loras/DEMO_LORA: a rank-4 LoRA on every kind of layer (the DiT's branches and host
# layers, the LLM adapter, the text encoder), so a job with it touches every stage's LoRA path
DEMO_LORA_ARGS = ("--preset", "tiny", "--seed", "1", "--rank", "4", "--groups", "blocks,host,adapter,te")
DEMO_MARK = "# demo: "         # first line of a pipeline.toml the demo wrote (it may rewrite only those)
UP_TIMEOUT_S = 120.0           # supervisord + orchestrator daemon up


class DemoError(Exception):
    """A message that is the whole answer (exit 1)."""


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _resolution(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected WIDTHxHEIGHT like 512x512") from None
    if w <= 0 or h <= 0 or w % 8 or h % 8:
        raise argparse.ArgumentTypeError(f"{text!r}: width and height must be positive multiples of 8")
    return w, h


def demo_sizes(resolution: tuple[int, int]) -> list[tuple[int, int]]:
    """The demo's pack sizes: `resolution` (the default) and MORE_SIZES times it, each side a multiple of 8."""
    w, h = resolution
    return [resolution] + [(int(w * k) // 8 * 8, int(h * k) // 8 * 8) for k in MORE_SIZES]


def pack_name(size: tuple[int, int]) -> str:
    return f"pack-{size[0]}x{size[1]}-lora{LORA_RANK}"


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: a TCP port, 0..65535 (0: any free port)")
    return port


def prepare_models(bundle: Path, resolution: tuple[int, int]) -> tuple[Path, list[Path]]:
    """The tiny models folder with the demo's LoRA, and its packs (demo_sizes, the default first) under `bundle`,
    each kept when already complete -> (models, packs)."""
    from models.setup.models_dir import resolve_models, write_bundle
    from models.packs.pack import build_pack, load_pack
    models = bundle / "models"
    t0 = time.monotonic()
    if not (models / "anima-bundle.json").exists():
        _say(f"1) writing the embedded tiny models to {models} (random weights, real key names) ...")
    write_bundle("tiny", 0, models)                     # idempotent: a complete bundle with its stamp is kept
    write_demo_lora(models)
    dit = resolve_models(models, {}, need=("dit",)).dit
    packs = []
    for size in demo_sizes(resolution):
        pack = bundle / pack_name(size)
        if (pack / "manifest.json").exists():
            load_pack(pack, check=True)                 # a damaged pack is a clear error, not a later surprise
        else:
            _say(f"2) building the LoRA-ready model pack for {size[0]}x{size[1]} in {pack} ...")
            build_pack(dit, pack, size, "fp16", lora_rank=LORA_RANK)
        packs.append(pack)
    _say(f"   models, LoRA and packs ready ({time.monotonic() - t0:.1f} s)")
    return models, packs


def write_demo_lora(models: Path) -> Path:
    """MODELS/loras/DEMO_LORA, written as `anima-models synth lora DEMO_LORA_ARGS --out …` writes it (kept when
    there)."""
    from models.commands.cli import main as models_main
    lora = models / "loras" / DEMO_LORA
    if not lora.is_file():
        args = ["synth", "lora", *DEMO_LORA_ARGS, "--out", str(lora)]
        _say(f"1) a synthetic LoRA: anima-models {' '.join(args)}")
        with contextlib.redirect_stdout(sys.stderr):      # stdout is the demo's result lines only
            rc = models_main(args)
        if rc != 0:
            raise DemoError(f"anima-models {' '.join(args)} failed")
    return lora


def prepare_run(run: Path, models: Path, packs: list[Path], port: int | None = None) -> tuple[RunFolder, bool]:
    """`orchestrator init` for the demo: pipeline.toml names the demo's packs (the default first) and models; `port`:
    the HTTP front's ([stage.http] port). A pipeline.toml written by someone else (pointing at real models) is never
    replaced: use another --run for the demo. A demo folder missing some of the demo's packs gets them added as an
    edit (`init --add-pack`: hand edits and packs added by hand stay). -> (run folder, whether the config changed,
    e.g. another --resolution: a running pipeline must then be restarted)."""
    from orchestrator.ops.add_pack import add_packs
    rf = RunFolder.resolve(run)
    toml = rf.pipeline_toml
    pack, more = packs[0], packs[1:]
    changed = not toml.exists()
    if toml.exists():
        from stages.config import load_config
        cfg = load_config(toml)
        # the demo's pack the default and its models: the demo's folder, also with more packs added
        # (`orchestrator init --add-pack`), which it keeps
        changed = cfg.packs[:1] != (pack.resolve(),) or cfg.models_dir != models.resolve()
        if changed and not toml.read_text().startswith(DEMO_MARK):
            raise DemoError(f"{toml} is not the demo's (pack_dir {cfg.pack_dir}, models_dir {cfg.models_dir}); "
                            f"the demo leaves it alone: run it with another --run folder")
    rf = init_run(run, pack_dir=pack, packs=more, models_dir=models, force=changed)
    conf = rf.root / "supervisord.conf"
    # a run folder from before the HTTP front, or from a version whose modules were laid out otherwise: render it again
    if "[program:http]" not in conf.read_text() or missing_modules(conf.read_text()):
        init_run(run, pack_dir=pack, packs=more, models_dir=models, force=True)
        changed = True
    before = toml.read_text()
    add_packs(rf, _sizes_lacking(toml, more), [])        # a folder of an older demo: the sizes it lacks
    text = toml.read_text()
    if changed and port is None:
        text = _http_port_for_demo(text)
    if port is not None:
        text = _with_http_port(text, port)
    if not text.startswith(DEMO_MARK):
        text = f"{DEMO_MARK}the embedded tiny model (python -m orchestrator.terminal.demo)\n{text}"
    if text != toml.read_text():
        atomic_write(toml, text)
    changed = changed or _unmarked(text) != _unmarked(before)      # the mark is a comment: no restart for it
    return rf, changed


def _sizes_lacking(toml: Path, packs: list[Path]) -> list[Path]:
    """The packs of `packs` whose size no pack of the run folder serves (a pack added by hand for a size is kept)."""
    from orchestrator.engine.packs import pack_sizes, read_pack
    have = set(pack_sizes(toml) or ())
    return [p for p in packs if read_pack(p).size not in have]


def _unmarked(text: str) -> str:
    return text.split("\n", 1)[1] if text.startswith(DEMO_MARK) else text


def _with_http_port(text: str, port: int) -> str:
    """pipeline.toml's text with [stage.http] port = `port` (the line replaced or added; nothing else changes)."""
    table = re.search(r"^[ \t]*\[stage\.http\][ \t]*(#[^\n]*)?\n", text, re.M)
    if table is None:
        return f"{text.rstrip()}\n[stage.http]\nport = {port}\n"
    head, sep, rest = text[:table.start()], table.group(), text[table.end():]
    section, nxt, tail = rest.partition("\n[")
    lines = section.split("\n")
    at = next((i for i, line in enumerate(lines) if re.match(r"[ \t]*port[ \t]*=", line)), None)
    if at is None:
        lines.insert(0, f"port = {port}")
    else:
        lines[at] = f"port = {port}"
    return f"{head}{sep}{chr(10).join(lines)}{nxt}{tail}"


def _port_taken(port: int, host: str = "127.0.0.1") -> bool:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _http_port_for_demo(text: str) -> str:
    """The demo's pipeline.toml with a front that can listen: ComfyUI's port (the default) when it is free, else any
    free port (0; the one taken is in RUN/http.json and the demo prints it). A port the file already sets is kept."""
    from stages.settings import HttpSettings
    port = HttpSettings().port
    head, sep, rest = text.partition("[stage.http]\n")
    section = rest.split("\n[", 1)[0]
    if not sep or any(line.strip().startswith("port") for line in section.splitlines()) or not _port_taken(port):
        return text
    _say(f"   port {port} is taken (ComfyUI?): the HTTP front takes any free port ([stage.http] port = 0)")
    return f"{head}{sep}port = 0                   # {port} was taken when the demo wrote this: any free port\n{rest}"


def ensure_supervisord(rf: RunFolder, config_changed: bool = False) -> bool:
    """supervisord for this run folder, started unless it already answers (then its always-on programs are restarted
    when the config changed), as `orchestrator start` starts it: one that is shutting down is waited for first, and
    the stages and the job daemon are waited for (the HTTP front's state is the page line's). -> started now."""
    from orchestrator.ops import run_control
    from orchestrator.engine.supervisor import Supervisor, SupervisorError
    sup = Supervisor(rf.supervisor_sock)
    running = run_control.supervisord_state(sup) == "running"
    _say(f"4) supervisord is already running for {rf.root}" if running else
         f"4) starting supervisord for {rf.root} (as `orchestrator start`: its stages and daemon waited for)")
    try:
        if not running:
            return run_control.start(rf, UP_TIMEOUT_S, say=lambda line: _say(f"   {line}"), optional=("http",))
        if config_changed:
            _say("   the pipeline config changed: restarting orchestrator, scheduler, executor and the HTTP front")
            sup.update()                                  # supervisord rereads its config (e.g. a new program)
            for program in ALWAYS_ON_STAGES + ("orchestrator", "http"):
                if program in sup.all_info():
                    sup.restart(program)
        run_control.wait_up(rf, sup, time.monotonic() + UP_TIMEOUT_S, optional=("http",))
        return False
    except SupervisorError as e:
        raise DemoError(f"{e}\n{_log_tail(rf, 'orchestrator')}") from None


def http_front(rf: RunFolder, timeout_s: float = 30.0) -> str:
    """The HTTP front's page URL once it listens (RUN/http.json), or a line saying why it does not."""
    from orchestrator.engine.supervisor import Supervisor, SupervisorError
    sup = Supervisor(rf.supervisor_sock)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = sup.info("http")
        except (SupervisorError, OSError) as e:
            return f"the HTTP front is not running ({e})"
        if info.state == "RUNNING" and rf.http_json.exists():
            try:
                return json.loads(rf.http_json.read_text())["url"]
            except (OSError, ValueError, KeyError):
                pass
        if info.state in ("FATAL", "EXITED", "STOPPED") or time.monotonic() > deadline:
            tail = _log_tail(rf, "http", 400).strip().splitlines()
            return f"the HTTP front is {info.state}: {tail[-1] if tail else ''} (log: {rf.logs / 'http.log'})"
        time.sleep(0.2)


def _log_tail(rf: RunFolder, program: str, chars: int = 2000) -> str:
    path = rf.logs / f"{program}.log"
    try:
        return f"--- {path} (end)\n{path.read_text(errors='replace')[-chars:]}"
    except OSError:
        return f"({path} is not readable)"


def check_prompt(prompt: Path, resolution: tuple[int, int]) -> None:
    from orchestrator.engine.prompt_spec import PromptError, load_prompt
    try:
        load_prompt(prompt, resolution=resolution)
    except PromptError as e:
        raise DemoError(f"{e} (nothing was started)") from None


def submit_and_follow(rf: RunFolder, prompt: Path) -> dict:
    """Validate and queue the prompt, follow it with the progress line, print the timing table. -> result paths."""
    from orchestrator.terminal.cli import DaemonClient, _follow
    from orchestrator.engine.packs import pack_sizes
    from orchestrator.engine.prompt_spec import PromptError, parse_prompt_text, read_prompt_file, resolve_prompt
    from orchestrator.engine.report import format_table
    from protocol.messages import Submit, Submitted
    try:
        record = parse_prompt_text(read_prompt_file(prompt))     # read once: what is checked is what is sent
        resolve_prompt(record, resolution=pack_sizes(rf.pipeline_toml))
    except PromptError as e:
        raise DemoError(f"{prompt}: {e}") from None
    client = DaemonClient(rf)
    try:
        sub = client.call(Submit(prompt=record, base_dir=os.getcwd()), Submitted)
        _say(f"5) job {sub.job} queued from {prompt} (seed {sub.seed})")
        t0 = time.monotonic()
        info = _follow(client, sub.job, quiet=False)
    finally:
        client.close()
    if info.state != "done":
        raise DemoError(f"job {info.job} {info.state}: {info.error_stage}: {info.error}\n"
                        f"(logs: {rf.logs}; `orchestrator --run {rf.root} logs {info.error_stage or 'orchestrator'}`)")
    report = json.loads(Path(info.report).read_text())
    _say("")
    _say(format_table(report))
    _say("")
    _say(f"job {info.job} done in {time.monotonic() - t0:.1f} s")
    return {"job": info.job, "image": info.image, "report": info.report}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.terminal.demo", description=__doc__.split("\n")[0])
    p.add_argument("--run", default=str(REPO_DIR / "run"), help="run folder (default: the repo's run/)")
    p.add_argument("--prompt", default=str(DEFAULT_PROMPT), help="prompt.json (default: examples/prompt.json)")
    p.add_argument("--resolution", type=_resolution, default=DEFAULT_RESOLUTION,
                   help="pack resolution WIDTHxHEIGHT (default 256x256)")
    p.add_argument("--bundle", help="where the tiny models and packs go (default: RUN/bundle)")
    p.add_argument("--port", type=_port, help="the HTTP front's port ([stage.http] port; default 8188, or any "
                                              "free one when that is taken; 0: any free one)")
    p.add_argument("--stop", action="store_true", help="shut supervisord down when the job is done")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    run = Path(args.run).expanduser().resolve()
    try:
        RunFolder(run).check()
        check_prompt(Path(args.prompt), args.resolution)       # a bad prompt file fails before anything starts
        run.mkdir(parents=True, exist_ok=True, mode=0o700)
        models, packs = prepare_models(Path(args.bundle).resolve() if args.bundle else run / "bundle",
                                       args.resolution)
        rf, changed = prepare_run(run, models, packs, args.port)
        _say(f"3) run folder {rf.root} (pipeline config {rf.pipeline_toml})")
        ensure_supervisord(rf, changed)
        result = submit_and_follow(rf, Path(args.prompt).resolve())
    except (DemoError, ValueError, OSError) as e:
        _say(f"demo failed: {e}")
        return 1
    except KeyboardInterrupt:
        _say("interrupted (supervisord keeps running; the job goes on: orchestrator status)")
        return 130
    conf = rf.supervisord_conf
    print(f"image:  {result['image']}\nreport: {result['report']}")
    if args.stop:
        from orchestrator.ops import run_control
        from orchestrator.engine.supervisor import SupervisorError
        try:                                          # gone, so a next `make demo` can start it again at once
            run_control.stop(rf, say=_say)
        except SupervisorError as e:
            _say(f"demo: the job is done, but supervisord did not stop: {e}")
            return 1
    else:
        bin_dir = Path(sys.executable).parent
        url = http_front(rf)
        up = url.startswith("http")
        page = (f"  web page: {url}   (ComfyUI API: {url}prompt ... /ws; A1111 API: {url}sdapi/v1/txt2img)" if up
                else f"  web page: none: {url}; its port is [stage.http] port in {rf.pipeline_toml}")
        stays = "the HTTP front stay up" if up else "stay up; the HTTP front did not start"
        _say(f"supervisord keeps running (scheduler, executor and {stays} for the next job):\n"
             f"  {bin_dir}/orchestrator --run {rf.root} submit {args.prompt} --wait    # another job\n"
             f"  {bin_dir}/supervisorctl -c {conf} status\n"
             f"  {bin_dir}/orchestrator --run {rf.root} stop      # stop everything (and wait); start: again\n{page}\n"
             f"  every workflow on this folder (generate, A1111, ComfyUI, the page): docs/cookbook.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
