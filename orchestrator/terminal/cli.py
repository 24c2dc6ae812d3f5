"""`orchestrator`: submit and follow jobs, control the stages under supervisord, run the job daemon.

    orchestrator init                                   # run folder (0700) + its supervisord.conf
    orchestrator init --bundle BUNDLE                   # ... with every pack of a board bundle (anima-models bundle)
    orchestrator doctor [--full]                        # is this machine and run folder ready? (exit 1: no)
    orchestrator serve --config run/pipeline.toml       # the daemon (supervisord runs it)
    orchestrator submit examples/prompt.json --wait     # validate, queue, follow, print image + timings
    orchestrator submit - < prompt.json                 # prompt.json from standard input
    orchestrator generate "1girl, ..." --steps 20 -o out.png    # one line: queue, follow, print the image path
    orchestrator estimate examples/prompt.json          # its modelled board seconds, before it runs (generate --estimate)
    orchestrator status [JOB] | cancel JOB | resume JOB
    orchestrator prune --keep 20 | --older-than 7d     # remove finished jobs (never queued or running ones)
    orchestrator start | stop                           # supervisord for the run folder, waited for
    orchestrator stages | restart executor | logs scheduler -f
    orchestrator keys generate --dir keys --name vae    # CURVE key pair, 0600
    orchestrator service install [--user] [--print]     # systemd unit: supervisord for the run folder at boot
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

from models.sampling.sampler import DEFAULT_SAMPLER, DEFAULT_SCHEDULER
from orchestrator.engine import daemon_client
from orchestrator.engine.daemon_client import DAEMON_TIMEOUT_S, DaemonDown, DaemonRefused
from orchestrator.engine.prompt_spec import (PromptError, parse_prompt_text, prompt_record,
                                      read_prompt_file, read_prompt_stream, resolve_prompt)
from orchestrator.engine.runfolder import ALWAYS_ON_STAGES, PROGRAMS, RunFolder, init_run

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130      # 128 + SIGINT, as shells report a Ctrl-C
WAIT_POLL_S = 0.25          # --wait asks the daemon this often
DAEMON_GONE_S = 120.0       # --wait keeps asking a daemon that stopped answering (being restarted) this long


class CliError(Exception):
    """A message that is the whole answer; `code` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILED, *, daemon_down: bool = False):
        super().__init__(message)
        self.code, self.daemon_down = code, daemon_down


# ---------------------------------------------------------------- daemon client


def cli_error(e: Exception) -> CliError:
    """A DaemonDown or DaemonRefused as the CLI says it: the daemon's own words, exit 2 for a request it refused
    (bad_request, failed), 1 otherwise."""
    code = EXIT_USAGE if isinstance(e, DaemonRefused) and e.code in ("bad_request", "failed") else EXIT_FAILED
    return CliError(str(e), code, daemon_down=isinstance(e, DaemonDown))


def DaemonClient(rf: RunFolder, timeout_s: float = DAEMON_TIMEOUT_S) -> daemon_client.DaemonClient:  # noqa: N802
    """The CLI's daemon client: the one over the daemon's socket, its failures as CliError."""
    return daemon_client.DaemonClient.socket(rf, timeout_s, errors=cli_error)


# ---------------------------------------------------------------- commands


def _resolution(text: str | None, rf: RunFolder) -> list[tuple[int, int]] | None:
    if text:
        try:
            w, h = (int(v) for v in text.lower().split("x"))
            return [(w, h)]
        except ValueError:
            raise CliError(f"--resolution {text!r}: expected WIDTHxHEIGHT like 512x512", EXIT_USAGE) from None
    from orchestrator.engine.packs import pack_sizes
    return pack_sizes(rf.pipeline_toml)


def cmd_submit(args, rf: RunFolder) -> int:
    # 1) read the file (or standard input) once and validate those bytes: nothing reaches the queue unless they are
    #    good, and what is sent is the record that was checked
    try:
        data = read_prompt_stream(sys.stdin.buffer) if args.prompt == "-" else read_prompt_file(args.prompt)
        prompt = parse_prompt_text(data)
        spec = resolve_prompt(prompt, resolution=_resolution(args.resolution, rf))
    except PromptError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    # 2) queue it, 3) follow it (Ctrl-C stops following; the job goes on)
    return _queue(args, rf, prompt, spec, wait=args.wait, cancel_on_interrupt=False)


def _estimate(record, rf: RunFolder, resolution: str | None = None) -> int:
    """Price a prompt record on this run folder's board settings and packs (modelled; nothing is queued): the lines
    labelled modelled, the `estimate ...` line last (orchestrator/engine/estimate.py)."""
    from orchestrator.engine.estimate import BoardSettings, EstimateError, estimate_spec, prompts_cached
    cfg = packs = None
    cached = False
    if rf.pipeline_toml.exists():
        from orchestrator.engine.packs import read_packs
        from stages.config import load_config
        cfg = load_config(rf.pipeline_toml)
        packs = read_packs(cfg.packs)
    if packs:
        sizes = _resolution(resolution, rf) if resolution else list(packs)
        spec = resolve_prompt(record, resolution=sizes, check_output=False,
                              sampling={size: p.sampling for size, p in packs.items()})
        dirs, board = {size: p.dir for size, p in packs.items()}, BoardSettings.of_config(cfg)
        cached = prompts_cached(spec, cfg, packs)
    else:       # no run folder yet: the official model at the job's size (512x512 unless it says), the defaults
        size = _resolution(resolution, rf)[0] if resolution else (record.width or 512, record.height or 512)
        spec = resolve_prompt(record, resolution=[size], check_output=False)
        dirs, board = {size: None, **({spec.hires.size(*size): None} if spec.hires else {})}, BoardSettings()
    try:
        est = estimate_spec(spec, dirs, board, cached=cached)
    except EstimateError as e:
        raise CliError(str(e)) from None
    print("\n".join(est.lines()))
    return EXIT_OK


def cmd_estimate(args, rf: RunFolder) -> int:
    try:
        data = read_prompt_stream(sys.stdin.buffer) if args.prompt == "-" else read_prompt_file(args.prompt)
        return _estimate(parse_prompt_text(data), rf, args.resolution)
    except PromptError as e:
        raise CliError(str(e), EXIT_USAGE) from None


# generate's options -> the prompt.json field each one fills (errors name the option, not the field)
GENERATE_FLAGS = {"prompt": "PROMPT", "negative_prompt": "--negative", "seed": "--seed", "steps": "--steps",
                  "cfg": "--cfg", "width": "-W/--width", "height": "-H/--height", "sampler": "--sampler",
                  "scheduler": "--scheduler", "spectrum": "--no-spectrum", "output": "-o/--output",
                  "overwrite": "--overwrite", "loras": "--lora", "init_image": "--init-image", "mask": "--mask",
                  "denoise": "--denoise", "resize_mode": "--resize-mode", "cache": "--cache",
                  "cache.reuse_threshold": "--reuse-threshold", "cache.start_percent": "--cache-start",
                  "cache.end_percent": "--cache-end", "batch": "--batch", "hires": "--hires",
                  "hires.scale": "--hires", "hires.width": "--hires", "hires.height": "--hires",
                  "hires.steps": "--hires-steps", "hires.denoise": "--hires-denoise", "hires.method": "--hires-method",
                  "hires.space": "--hires-pixel", "hires.keep_base": "--hires-keep-base",
                  "hires.sampler": "--hires-sampler", "hires.scheduler": "--hires-scheduler",
                  "hires.cfg": "--hires-cfg", "hires.seed": "--hires-seed", "hires.prompt": "--hires-prompt",
                  "hires.negative_prompt": "--hires-negative"}
# generate's hires options -> prompt.json's hires fields (--hires itself gives scale, or width and height)
HIRES_OPTIONS = {"hires_steps": "steps", "hires_denoise": "denoise", "hires_method": "method",
                 "hires_sampler": "sampler", "hires_scheduler": "scheduler", "hires_cfg": "cfg", "hires_seed": "seed",
                 "hires_prompt": "prompt", "hires_negative": "negative_prompt"}


def _hires_option(args):
    """generate's --hires SCALE|WxH and its --hires-* options -> prompt.json's `hires` (None without --hires)."""
    given = {field: getattr(args, opt) for opt, field in HIRES_OPTIONS.items() if getattr(args, opt) is not None}
    if args.hires_pixel:
        given["space"] = "pixel"
    if args.hires_keep_base:
        given["keep_base"] = True
    if args.hires is None:
        if given:
            raise CliError(f"{GENERATE_FLAGS['hires.' + next(iter(given))]}: needs --hires SCALE|WxH", EXIT_USAGE)
        return None
    text = args.hires.strip().lower()
    try:
        if "x" in text:
            w, h = text.split("x")
            size = {"width": int(w), "height": int(h)}
        else:
            size = {"scale": float(text)}
    except ValueError:
        raise CliError(f"--hires: {args.hires!r}: expected a scale (1.5) or WxH (1536x1536)", EXIT_USAGE) from None
    if args.hires_pixel and "method" not in given:
        given["method"] = "lanczos"          # the pixel path's usual filter (A1111's and ComfyUI's lanczos)
    return {**size, **given}


def _cache_option(args):
    """generate's step cache options -> prompt.json's `cache` (None without --cache)."""
    extra = {"reuse_threshold": args.reuse_threshold, "start_percent": args.cache_start,
             "end_percent": args.cache_end}
    given = {k: v for k, v in extra.items() if v is not None}
    if args.cache is None:
        if given:
            raise CliError(f"{GENERATE_FLAGS['cache.' + next(iter(given))]}: needs --cache easycache|lazycache",
                           EXIT_USAGE)
        return None
    return {"kind": args.cache, **given}
CLI_UPLOADS = "cli"                 # generate's --init-image/--mask files are uploaded into RUN/input/cli/


def _upload_file(rf: RunFolder, path: str, flag: str) -> str:
    """A local image file copied into the run folder's uploads (ComfyUI's rules: same bytes keep their name) ->
    its name as LoadImage gives it, which prompt.json's init_image/mask take; CliError (exit 2) naming the flag."""
    from models.images import ImageInputError, open_bounded
    from models.images.decode import MAX_INPUT_BYTES
    from orchestrator.engine.inputs import InputNameError, save_upload
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_INPUT_BYTES + 1)
        if len(data) > MAX_INPUT_BYTES:
            raise ImageInputError(f"larger than {MAX_INPUT_BYTES} bytes")
        open_bounded(data).close()
        name = save_upload(rf.root, "input", CLI_UPLOADS, os.path.basename(path), data, overwrite=False)
    except (OSError, ImageInputError, InputNameError) as e:
        raise CliError(f"{flag}: {path}: {e}", EXIT_USAGE) from None
    return f"{CLI_UPLOADS}/{name} [input]"


def cmd_generate(args, rf: RunFolder) -> int:
    """One line, no JSON file: the options become a prompt.json object, checked and followed exactly as `submit
    --wait` does. Ctrl-C cancels the job (it exists only for this command). With --estimate it is priced instead
    (images are not uploaded: the price follows their denoise, not their pixels)."""
    upload = (lambda _rf, path, flag: f"{CLI_UPLOADS}/estimate.png [input]") if args.estimate else _upload_file
    obj = {"prompt": args.prompt, "negative_prompt": args.negative, "seed": args.seed, "steps": args.steps,
           "cfg": args.cfg, "width": args.width, "height": args.height, "sampler": args.sampler,
           "scheduler": args.scheduler, "spectrum": False if args.no_spectrum else None, "output": args.output,
           "overwrite": True if args.overwrite else None, "denoise": args.denoise, "resize_mode": args.resize_mode,
           "init_image": args.init_image and upload(rf, args.init_image, "--init-image"),
           "mask": args.mask and upload(rf, args.mask, "--mask")}
    obj = {k: v for k, v in obj.items() if v is not None}
    for name, value in (("cache", _cache_option(args)), ("hires", _hires_option(args)), ("batch", args.batch)):
        if value is not None:
            obj[name] = value
    if args.lora:
        from models.lora.plan import parse_lora_arg
        try:
            uses = [parse_lora_arg(a) for a in args.lora]
        except ValueError as e:                # LoraError too: a strength that is not a number in range
            raise CliError(f"--lora: {e}", EXIT_USAGE) from None
        obj["loras"] = [{"name": u.path, "strength": u.strength, "clip_strength": u.clip_strength} for u in uses]
    for field in ("prompt", "negative_prompt", "output"):
        try:
            obj.get(field, "").encode("utf-8")
        except UnicodeEncodeError:          # undecodable bytes on the command line (surrogate escapes)
            raise CliError(f"{GENERATE_FLAGS[field]}: not valid UTF-8 text", EXIT_USAGE) from None
    try:
        record = prompt_record(obj)         # NaN/inf are named here, not in JSON
        if args.estimate:                   # priced, not queued
            return _estimate(record, rf)
        spec = resolve_prompt(record, resolution=_resolution(None, rf))
    except PromptError as e:
        flag = GENERATE_FLAGS.get(e.field) or GENERATE_FLAGS.get(e.field.split(".")[0].split("[")[0],
                                                                  e.field or "the options")
        detail = e.detail.replace('set "overwrite": true', "give --overwrite")    # prompt.json's words -> ours
        raise CliError(f"{flag}: {detail}", EXIT_USAGE) from None
    return _queue(args, rf, record, spec, wait=True, cancel_on_interrupt=True)


def _queue(args, rf: RunFolder, prompt, spec, *, wait: bool, cancel_on_interrupt: bool) -> int:
    """Queue a checked prompt record (the daemon resolves it again, against the packs it serves) and, with
    `wait`, follow the job to its end: progress on stderr, then the timing table, the image path last on stdout.
    Ctrl-C while following: exit 130, the job cancelled (`cancel_on_interrupt`) or left to run."""
    from protocol.messages import Submit, Submitted
    client = args.connect(rf)
    try:
        try:
            sub = client.call(Submit(prompt=prompt, base_dir=os.getcwd()), Submitted)
        except KeyboardInterrupt:
            raise CliError("interrupted before the daemon answered; the job may have been queued "
                           "(orchestrator status)", EXIT_INTERRUPTED) from None
        seed_note = " (random)" if spec.seed_random else ""
        print(f"job {sub.job} queued (seed {sub.seed}{seed_note}, {sub.position} ahead)", file=sys.stderr)
        if not wait:
            _print_result(args, sub.job, [], None)
            return EXIT_OK
        try:
            info = _follow(client, sub.job, quiet=args.json)
        except KeyboardInterrupt:
            return _interrupted(args, rf, sub.job, cancel_on_interrupt)
    finally:
        client.close()
    if info.state != "done":
        why = f": {info.error_stage}: {info.error}" if info.error else ""
        if args.json:       # still one object on stdout, so scripts learn the job id and its folder's report
            print(json.dumps({"job": info.job, "image": None, "report": info.report, "state": info.state,
                              "error": f"{info.error_stage}: {info.error}" if info.error else info.state}))
        raise CliError(f"job {info.job} {info.state}{why}", EXIT_FAILED)
    report = _read_report(info.report)
    if not args.json and report is not None:
        from orchestrator.engine.report import format_table
        print(format_table(report), file=sys.stderr)
        plot = Path(info.report).with_name("timing.png")
        print(f"report {info.report}" + (f", timing plot {plot}" if plot.exists() else ""), file=sys.stderr)
    _print_result(args, info.job, image_paths(info.image, report), info.report)
    return EXIT_OK


def _read_report(path: str | None) -> dict | None:
    """A finished job's report.json, or None when it has none (or it cannot be read: the paths still print)."""
    try:
        return json.loads(Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None


def image_paths(image: str | None, report: dict | None) -> list[str]:
    """Every image of a finished job, the first first: a batch's from its report (`images`), else the one."""
    batch = [i["image"] for i in (report or {}).get("images") or () if i.get("image")]
    return batch or ([image] if image else [])


def _interrupted(args, rf: RunFolder, job: str, cancel: bool) -> int:
    """Ctrl-C while following `job`: cancel it (generate) or leave it running (submit --wait). A second Ctrl-C
    while cancelling gives up at once and says how to cancel by hand."""
    print(file=sys.stderr)
    if not cancel:
        print(f"job {job} goes on (Ctrl-C only stopped following it): orchestrator status {job} | cancel {job}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    from protocol.messages import Cancel, Ok
    client = args.connect(rf)        # a fresh socket: the interrupted request may have left the old one mid-call
    try:
        client.call(Cancel(job=job), Ok)
        print(f"job {job} cancelled (Ctrl-C)", file=sys.stderr)
    except (KeyboardInterrupt, CliError) as e:
        why = "interrupted again" if isinstance(e, KeyboardInterrupt) else str(e)
        print(f"job {job} NOT cancelled ({why}): orchestrator cancel {job}", file=sys.stderr)
    finally:
        client.close()
    return EXIT_INTERRUPTED


def _print_result(args, job, images: list[str], report):
    """stdout: the image path (a batch: one line per image, the first first), or the job id when there is none yet;
    with --json one object, `image` the first and `images` all of them."""
    if args.json:
        print(json.dumps({"job": job, "image": images[0] if images else None, "report": report, "images": images}))
    else:
        print("\n".join(images) or job)


def _job_info(client: DaemonClient, job: str):
    from protocol.messages import Jobs, Status
    jobs = client.call(Status(job=job), Jobs).jobs
    if not jobs:
        raise CliError(f"the daemon does not know job {job}")
    return jobs[0]


def _progress_line(info) -> str:
    """`JOB: queued (2 ahead)`, `JOB: encoding the prompt`, or a denoising job's bar and step (the page's words:
    orchestrator/engine/progress_text.py)."""
    from orchestrator.engine.progress_text import phase_text
    p = info.progress
    if info.state != "denoising" or p is None:
        return f"{info.job}: {phase_text(info)}"
    width = 24
    filled = int(width * (p.step - 1) / max(p.steps, 1))
    return f"[{'#' * filled}{'.' * (width - filled)}] {phase_text(info)}"


def _follow(client: DaemonClient, job: str, *, quiet: bool):
    tty = sys.stderr.isatty()
    last, gone_since = "", None
    while True:
        try:
            info = _job_info(client, job)
            gone_since = None
        except CliError as e:           # the daemon restarting (supervisord brings it back): keep asking a while
            if "not answering" not in str(e):
                raise
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > DAEMON_GONE_S:
                raise
            print(f"{job}: the orchestrator daemon is not answering; waiting", file=sys.stderr, flush=True)
            time.sleep(1.0)
            continue
        line = _progress_line(info)
        # a terminal gets one line redrawn per branch; a log gets a line per step or state change
        key = line if tty else (info.state, info.progress.step if info.progress else None, info.denoise_pass)
        if key != last:
            if tty:
                print("\r" + line.ljust(79), end="", file=sys.stderr, flush=True)
            elif not quiet or info.progress is None:
                print(line, file=sys.stderr, flush=True)
            last = key
        if info.state in ("done", "failed", "cancelled"):
            if tty:
                print(file=sys.stderr)
            return info
        time.sleep(WAIT_POLL_S)


def _status_job(args, rf: RunFolder) -> int:
    """`status JOB`: the job in detail, from the daemon; from its folder when the daemon does not answer (said so on
    stderr: no progress or queue position then, and a job the daemon was running may have moved on)."""
    from orchestrator.terminal import job_view
    from orchestrator.engine.jobs import JobError
    from protocol.messages import Jobs, Status
    client = args.connect(rf)
    try:
        info = client.call(Status(job=args.job, detail=True), Jobs).jobs[0]
    except CliError as e:
        if not e.daemon_down:
            raise
        try:
            info = job_view.from_folder(rf, args.job)
        except JobError as je:
            raise CliError(f"{e}; and in its folder: {je}") from None
        print(f"the orchestrator daemon does not answer: job {args.job} as read from its folder "
              f"{rf.jobs / args.job} (job.json, report.json)", file=sys.stderr)
    finally:
        client.close()
    if args.json:
        print(json.dumps([info.to_wire()]))
        return EXIT_OK
    report = _read_report(info.report)
    progress = _progress_line(info) if info.progress is not None and info.state == "denoising" else None
    print("\n".join(job_view.detail_lines(info, report, image_paths(info.image, report), progress)))
    return EXIT_OK


def cmd_status(args, rf: RunFolder) -> int:
    from protocol.messages import Jobs, Status
    if args.job:
        return _status_job(args, rf)
    client = args.connect(rf)
    try:
        jobs = client.call(Status(job=args.job), Jobs).jobs
    finally:
        client.close()
    if args.json:
        print(json.dumps([j.to_wire() for j in jobs]))
        return EXIT_OK
    if not jobs:
        print("no jobs")
    for j in jobs:
        extra = (f"  {j.error_stage}: {j.error}" if j.error_stage else f"  {j.error}") if j.error else (
            f"  {j.image}" if j.image else "")
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.created))
        print(f"{j.job}  {j.state:<9}  {created}{extra}")
        if j.progress is not None and j.state == "denoising":
            print("    " + _progress_line(j))
    return EXIT_OK


def cmd_cancel_resume(args, rf: RunFolder) -> int:
    from protocol.messages import Cancel, Ok, Resume, Submitted
    client = args.connect(rf)
    try:
        if args.command == "cancel":
            print(client.call(Cancel(job=args.job), Ok).note or f"job {args.job} cancelled")
        else:
            sub = client.call(Resume(job=args.job), Submitted)
            print(f"job {sub.job} queued again ({sub.position} ahead)")
    finally:
        client.close()
    return EXIT_OK


def cmd_prune(args, rf: RunFolder) -> int:
    from orchestrator.engine.jobs import parse_age
    from protocol.fields import ProtocolError
    from protocol.messages import Jobs, Prune
    if args.keep is None and args.older_than is None:
        raise CliError("prune needs --keep N or --older-than AGE (like 7d, 12h, 30m)", EXIT_USAGE)
    try:
        older_than_s = None if args.older_than is None else parse_age(args.older_than)
    except ValueError as e:
        raise CliError(f"--older-than: {e}", EXIT_USAGE) from None
    if args.keep is not None and args.keep < 0:
        raise CliError(f"--keep {args.keep}: must be 0 or more", EXIT_USAGE)

    def request() -> Prune:                  # the message's own bounds, said as the option the user typed
        try:
            return Prune(keep=args.keep, older_than_s=older_than_s)
        except ProtocolError as e:
            option, given = {"keep": ("--keep", args.keep), "older_than_s": ("--older-than", args.older_than)}.get(
                e.field, (e.field, ""))
            raise CliError(f"{option} {str(given)[:40]}: {e.detail}" + (" (seconds)" if option == "--older-than"
                                                                         else ""), EXIT_USAGE) from None
    request()
    client = args.connect(rf)         # the daemon is the queue's one writer: it removes them, a batch per request
    removed = 0
    try:
        while True:
            reply = client.call(request(), Jobs)
            for j in reply.jobs:
                finished = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.updated))
                print(f"removed {j.job}  {j.state:<9}  {finished}  {rf.jobs / j.job}")
            removed += len(reply.jobs)
            if not reply.more or not reply.jobs:
                break
    finally:
        client.close()
    print(f"{removed} finished job(s) removed", file=sys.stderr)
    if older_than_s is not None:                   # uploads by the same age: a job keeps its own copy of its inputs
        from orchestrator.engine.upload_space import prune_uploads
        gone = prune_uploads(rf.root, older_than_s)
        print(f"{len(gone)} upload(s) removed ({sum(n for _, n in gone) / 1e6:,.1f} MB) from {rf.root}/input, temp, "
              "output", file=sys.stderr)
    return EXIT_OK


def _supervisor(rf: RunFolder):
    from orchestrator.engine.supervisor import Supervisor
    return Supervisor(rf.supervisor_sock)


def _program(name: str) -> str:
    if name not in PROGRAMS:
        raise CliError(f"unknown stage {name!r}; choose one of {', '.join(PROGRAMS)}", EXIT_USAGE)
    return name


def _remote_stages(rf: RunFolder) -> dict:
    """{stage: endpoint} of the tcp stages in RUN/pipeline.toml (they are not supervisord's here)."""
    if not rf.pipeline_toml.exists():
        return {}
    from stages.config import STAGES, load_config
    cfg = load_config(rf.pipeline_toml)
    return {s: cfg for s in STAGES if cfg.is_remote(s)}


def _hello(cfg, stage: str) -> str:
    import zmq
    from protocol.messages import Hello, Ready, RemoteError, expect
    from protocol.sockets import LazyPirate, PeerUnavailable
    from protocol.version import VERSION
    ctx = zmq.Context()
    try:
        with LazyPirate(ctx, cfg.endpoint(stage), peer=stage, timeout_s=2.0, retries=0,
                        curve=cfg.curve_client(stage),
                        allow_plaintext=cfg.security.allow_plaintext_loopback) as client:
            r = expect(client.request(Hello(peer="cli", pid=os.getpid(), version=VERSION)), Ready, stage)
            return f"READY     pid {r.pid:<8} remote {cfg.endpoint(stage)}"
    except (PeerUnavailable, RemoteError) as e:
        return f"UNREACHABLE remote {cfg.endpoint(stage)}: {e}"
    finally:
        ctx.term()


def cmd_start_stop(args, rf: RunFolder) -> int:
    """`start` / `stop`: supervisord for the run folder, waited for (orchestrator.ops.run_control); past --timeout a
    SupervisorError saying what it waited for (exit 1)."""
    from orchestrator.ops import run_control
    if args.timeout is not None and not 0 < args.timeout <= 24 * 3600:
        raise CliError(f"--timeout {args.timeout}: must be in (0, 86400] seconds", EXIT_USAGE)
    if args.command == "start":
        rf.check()
        run_control.start(rf, args.timeout or run_control.START_TIMEOUT_S)
    else:
        run_control.stop(rf, args.timeout or run_control.STOP_TIMEOUT_S)
    return EXIT_OK


def cmd_stages(args, rf: RunFolder) -> int:
    remote = _remote_stages(rf)
    infos = _supervisor(rf).all_info()
    now = time.time()
    for name in PROGRAMS:
        i = infos.get(name)
        if name in remote:
            print(f"{name:<13} {_hello(remote[name], name)}")
            continue
        if i is None:
            print(f"{name:<13} (not in supervisord's config)")
            continue
        up = f"up {now - i.start:.0f} s" if i.live and i.start else (i.spawnerr or i.description)
        print(f"{name:<13} {i.state:<9} pid {i.pid:<8} {up}")
    return EXIT_OK


def cmd_restart(args, rf: RunFolder) -> int:
    remote = _remote_stages(rf)
    if args.stage in remote:
        raise CliError(f"{args.stage} is remote ({remote[args.stage].endpoint(args.stage)}); restart it on its own "
                       "machine (supervisorctl there)", EXIT_USAGE)
    info = _supervisor(rf).restart(_program(args.stage))
    print(f"{args.stage} {info.state} pid {info.pid}")
    return EXIT_OK


def _stale_programs(rf: RunFolder) -> dict:
    """{program: the settings it runs with that differ from RUN/pipeline.toml} of the local programs that hold the
    file's settings from their start (the on-demand stages start on the file as it is, every job); the daemon when
    it recorded nothing (started by older code) too."""
    from stages.config import load_config
    from stages.config_digest import record_path, stale_settings
    cfg = load_config(rf.pipeline_toml)
    local = [s for s in ALWAYS_ON_STAGES if not cfg.is_remote(s)] + ["orchestrator"]
    stale = {s: keys for s in local if (keys := stale_settings(cfg, s))}
    if "orchestrator" not in stale and not record_path(cfg, "orchestrator").is_file():
        stale["orchestrator"] = ["(its start not recorded)"]
    return stale


def _wait_daemon(rf: RunFolder, timeout_s: float = DAEMON_GONE_S) -> None:
    from orchestrator.engine.daemon_probe import daemon_answers
    deadline = time.monotonic() + timeout_s
    while not daemon_answers(rf):
        if time.monotonic() > deadline:
            raise CliError(f"the orchestrator daemon did not answer within {timeout_s:.0f} s of its restart "
                           f"(orchestrator logs orchestrator)")
        time.sleep(0.3)


def cmd_reload(args, rf: RunFolder) -> int:
    stale = _stale_programs(rf)
    if not stale:
        print(f"nothing to reload: every program runs with {rf.pipeline_toml} as it is")
        return EXIT_OK
    if "orchestrator" in stale:            # the HTTP front keeps the daemon's packs (its sizes, the page) from its start
        stale["http"] = ["packs, as the orchestrator's"]
    sup = _supervisor(rf)
    for name, keys in stale.items():
        info = sup.restart(name)
        if name == "orchestrator":
            _wait_daemon(rf)
        print(f"{name} {info.state} pid {info.pid} (was running with other {', '.join(keys[:5])})")
    return EXIT_OK


def cmd_logs(args, rf: RunFolder) -> int:
    sup = _supervisor(rf)
    text, offset, _ = sup.tail(_program(args.stage), 0, args.bytes)
    sys.stdout.write(text)
    sys.stdout.flush()
    try:
        while args.follow:
            time.sleep(0.5)
            text, offset, _ = sup.tail(args.stage, offset, 64 * 1024)
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def cmd_keys(args, rf: RunFolder) -> int:
    from protocol.sockets import write_keypair
    directory = Path(args.dir) if args.dir else rf.root / "keys"
    existing = [p for p in (directory / f"{args.name}.key", directory / f"{args.name}.key_secret") if p.exists()]
    if existing and not args.force:
        raise CliError(f"{existing[0]} exists: a new key pair would break the stages already paired with it "
                       f"(use --force to replace it, or --name for another pair)", EXIT_USAGE)
    public, secret = write_keypair(directory, args.name)
    print(f"public key: {public}\nsecret key: {secret} (mode 0600; keep it on this machine)")
    return EXIT_OK


def _init_add_pack(args, rf: RunFolder) -> int:
    from orchestrator.ops.add_pack import add_packs
    if args.bundle or args.pack or args.models or args.force:
        raise CliError("--add-pack edits the run folder's pipeline.toml as it is: give it without --pack, --bundle, "
                       "--models or --force", EXIT_USAGE)
    rf.check()
    changes: list = []
    add_packs(rf, args.add_pack, changes)
    for line in changes:
        print(line)
    return EXIT_OK


def cmd_init(args, rf: RunFolder) -> int:
    if args.add_pack:
        return _init_add_pack(args, rf)
    bundle = None
    if args.bundle:
        if args.pack:
            raise CliError("--bundle names every pack: give it without --pack", EXIT_USAGE)
        from orchestrator.ops.board_bundle import board_bundle
        bundle = board_bundle(args.bundle, hashes=not args.quick)
    changes: list = []
    rf = init_run(rf.root, python=args.python, packs=args.pack, models_dir=args.models, force=args.force,
                  bundle=bundle, changes=changes)
    print(f"run folder {rf.root}\nsupervisord config {rf.supervisord_conf}\npipeline config {rf.pipeline_toml}")
    for line in changes:
        print(line)
    if bundle is not None:
        sizes = ", ".join(f"{w}x{h}" for w, h in bundle.sizes)
        from models.setup.bundle import baked_label
        lora = f", baked LoRA {baked_label(bundle.lora)}" if bundle.lora else ""
        print(f"bundle {bundle.dir}: {sizes}, backend {bundle.backend}{lora}")
    run = f" --run {rf.root}" if args.run else ""
    print(f"next: orchestrator{run} doctor, then orchestrator{run} start (supervisord -c {rf.supervisord_conf}, "
          "waited for)")
    return EXIT_OK


def cmd_doctor(args, rf: RunFolder) -> int:
    from orchestrator.ops.doctor import doctor
    return doctor(rf, full=args.full)


def cmd_service(args, rf: RunFolder) -> int:
    from orchestrator.ops import service
    try:
        t = service.target(args.name, user_unit=args.user, root=args.root)
        if args.action == "install" and args.print:
            sys.stdout.write(service.unit_text(rf, t))
            return EXIT_OK
        if args.action == "install":
            path, steps = service.install(rf, t, force=args.force)
            print(f"wrote {path} (supervisord for {rf.root})")
        else:
            removed, steps = service.uninstall(t, force=args.force)
            for path in removed:
                print(f"removed {path}")
    except service.ServiceError as e:
        raise CliError(str(e), e.code) from None
    print("next:\n" + "\n".join(f"  {s}" for s in steps))
    return EXIT_OK


def cmd_serve(args, rf: RunFolder) -> int:
    """The daemon process. A bad config or pack is exit 2, after which supervisord leaves it down (it would fail the
    same way again); anything that breaks it while serving is exit 1, and supervisord starts it again."""
    from models.packs.pack import PackError
    from orchestrator.engine.daemon import serve
    from orchestrator.http.png_formats import PNG_FORMATS
    from stages.config import ConfigError
    try:
        return serve(rf, Path(args.config), PNG_FORMATS)
    except (ConfigError, PackError) as e:
        from stages.base import config_exit
        print(f"orchestrator serve: error: {e}", file=sys.stderr, flush=True)
        return config_exit()                      # 2, once past startsecs: supervisord leaves it EXITED
    except Exception:  # noqa: BLE001 - the process broke: say why, exit for supervisord to restart it
        logging.getLogger("orchestrator.engine.daemon").exception("the orchestrator daemon failed")
        return EXIT_FAILED


# ---------------------------------------------------------------- parser


class Command(NamedTuple):
    """One subcommand: its name, its line in `orchestrator --help`, what runs it, and its arguments."""

    name: str
    help: str
    fn: Callable
    args: tuple = ()
    description: str | None = None


def arg(*flags: str, **kwargs) -> tuple:
    """One add_argument call, written down for a Command."""
    return flags, kwargs


JSON_OUT = arg("--json", action="store_true", help='print one JSON object {"job", "image", "report", "images"}')

JOB_HELP = "a job id as submit and status print it"
PROGRAM_HELP = f"a supervisord program: {', '.join(PROGRAMS)}"

COMMANDS = (
    Command("init", "create the run folder and its supervisord.conf", cmd_init, (
        arg("--python", help="interpreter for the stage programs (default: this one)"),
        arg("--pack", action="append", help="model pack folder for pipeline.toml; repeat it for more sizes "
                                            "(one pack per size, the first is the default)"),
        arg("--add-pack", action="append", metavar="PACK", help="add a model pack (another size) to the run "
                                                                 "folder's pipeline.toml, keeping every edit in it "
                                                                 "(repeatable)"),
        arg("--models", help="models folder (text encoder, VAE) for pipeline.toml; with --bundle, where LoRAs are "
                             "(its loras/; default: the run folder's models/)"),
        arg("--bundle", help="a board bundle (anima-models bundle): every pack, the encoder and the VAE, "
                             "checked, with the backend of its target"),
        arg("--quick", action="store_true", help="--bundle: check every file's presence and size, not its "
                                                 "sha256 (doctor --full does that later)"),
        arg("--force", action="store_true", help="rewrite supervisord.conf and pipeline.toml"))),
    Command("doctor", "is this machine and run folder ready? one line per check, exit 1 on a failure", cmd_doctor, (
        arg("--full", action="store_true", help="also check every pack file's sha256 (minutes for full-size "
                                                "packs)"),)),
    Command("serve", "run the job daemon (supervisord starts it)", cmd_serve, (
        arg("--config", required=True, help="pipeline config (TOML)"),)),
    Command("submit", "validate prompt.json and queue it", cmd_submit, (
        arg("prompt", help="prompt.json, or - to read it from standard input"),
        arg("--wait", action="store_true", help="follow the job to the end, then print image and timings "
                                                "(Ctrl-C stops following; the job goes on)"),
        JSON_OUT,
        arg("--resolution", help="check width/height against WxH (default: the packs' sizes, from the config)"))),
    Command("generate", "one line, no JSON file: queue a prompt, follow it, print the image path", cmd_generate, (
        arg("prompt", help="the prompt (weights as in ComfyUI: (word:1.2))"),
        arg("--negative", help="negative prompt"),
        arg("--seed", type=int, help="0 .. 2^64-1 (default: random, printed)"),
        arg("--steps", type=int, help="sampler steps (default: the pack's recorded settings, else 30)"),
        arg("--cfg", type=float, help="CFG scale (default: the pack's, else 4.0)"),
        arg("-W", "--width", type=int, help="image width (a size with a model pack; default: the first pack's)"),
        arg("-H", "--height", type=int, help="image height"),
        arg("--sampler", help=f"{DEFAULT_SAMPLER} (default, unless the pack records one), er_sde, euler_ancestral, dpmpp_2m ... "
                              "(ComfyUI's names: docs/samplers.md)"),
        arg("--scheduler", help=f"{DEFAULT_SCHEDULER} (default, unless the pack records one), simple, karras, beta ... (docs/samplers.md)"),
        arg("--no-spectrum", action="store_true", help="compute every step (no Spectrum forecasts)"),
        arg("--cache", choices=("easycache", "lazycache"),
            help="ComfyUI's EasyCache or LazyCache: reuse a model call when the input barely moved (Spectrum off; "
                 "docs/samplers.md)"),
        arg("--reuse-threshold", type=float, help="the cache's reuse_threshold, 0..3 (default 0.2)"),
        arg("--cache-start", type=float, help="the cache's start_percent, 0..1 (default 0.15)"),
        arg("--cache-end", type=float, help="the cache's end_percent, 0..1 (default 0.95)"),
        arg("-o", "--output", help="a .png file or a folder (default: the job folder's image.png)"),
        arg("--overwrite", action="store_true", help="replace an existing -o file (else it is refused)"),
        arg("--lora", action="append", default=[], metavar="NAME[:STRENGTH[:CLIP_STRENGTH]]",
            help="a LoRA under MODELS/loras/ (repeatable; strength default 1.0, the text encoder's default: "
                 "the same; docs/lora.md)"),
        arg("--init-image", metavar="FILE", help="img2img: the image to start from (copied into RUN/input/cli/; "
                                                 "docs/workflows.md)"),
        arg("--mask", metavar="FILE", help="inpaint: white (or an RGBA mask's alpha) is repainted; needs "
                                           "--init-image"),
        arg("--denoise", type=float, help="the part of the schedule sampled, in (0, 1] (default 1.0)"),
        arg("--resize-mode", type=int, choices=[0, 1, 2], help="an image of another size: 0 just resize, 1 crop "
                                                               "and resize, 2 resize and fill (default: refused)"),
        arg("--batch", type=int, metavar="N", help="N images from one seed, as ComfyUI's batch_size (default 1)"),
        arg("--hires", metavar="SCALE|WxH", help="hires fix: a second pass at SCALE times the size, or at WxH "
                                                 "(a size with a pack; docs/workflows.md)"),
        arg("--hires-steps", type=int, help="the second pass's steps (default: --steps)"),
        arg("--hires-denoise", type=float, help="the second pass's denoise, in (0, 1] (default 0.5)"),
        arg("--hires-method", help="nearest-exact (default), bilinear, area, bicubic, bislerp; with --hires-pixel "
                                   "lanczos (its default) and not bislerp"),
        arg("--hires-pixel", action="store_true", help="scale the decoded image (ImageScale) and encode it again, "
                                                        "not the latent"),
        arg("--hires-keep-base", action="store_true", help="keep the first pass's image too (base.png in the job "
                                                            "folder, NAME_base.png at --output)"),
        arg("--hires-sampler", help="the second pass's sampler (default: --sampler)"),
        arg("--hires-scheduler", help="the second pass's scheduler (default: --scheduler)"),
        arg("--hires-cfg", type=float, help="the second pass's CFG scale (default: --cfg)"),
        arg("--hires-seed", type=int, help="the second pass's noise seed (default: --seed)"),
        arg("--hires-prompt", help="the second pass's prompt (default: the prompt)"),
        arg("--hires-negative", help="the second pass's negative prompt (default: --negative)"),
        arg("--estimate", action="store_true", help="print the job's modelled board seconds (as `orchestrator "
                                                    "estimate`) instead of queueing it"),
        JSON_OUT),
        description="Queue one image and follow it to the end, as `submit --wait` does: progress and the timing "
                    "table on stderr, the image path on stdout (a batch: one line per image, the first image's "
                    "first). Unset options take prompt.json's defaults (seed: random, size: the default pack's). "
                    "Exit status: 0 done, 1 failed or cancelled, "
                    "2 bad input (the option is named), 130 Ctrl-C, which CANCELS the job."),
    Command("estimate", "price prompt.json before it runs: modelled board seconds on this run folder's board "
                        "settings and packs (nothing is queued)", cmd_estimate, (
        arg("prompt", help="prompt.json, or - to read it from standard input"),
        arg("--resolution", help="the pack size WxH to price it on (default: the job's own, as a submit picks it)")),
        description="Encode, denoise (model calls x CFG passes at the job's size and pack, under the executor's "
                    "policy on the board_ram_gb board) and decode, in MODELLED board seconds (models/board). The "
                    "last line is `estimate job_s=... encode_s=... denoise_s=... decode_s=... calls=... passes=... "
                    "[modelled]`."),
    Command("status", "every job, or one in detail (read from its folder when the daemon does not answer)",
            cmd_status, (
        arg("job", nargs="?", metavar="JOB", help=JOB_HELP + " (default: every job)"),
        arg("--json", action="store_true", help="one JSON object per job, as the daemon reports it"))),
    Command("cancel", "cancel a queued or running job", cmd_cancel_resume, (
        arg("job", metavar="JOB", help=JOB_HELP),)),
    Command("resume", "queue a failed or cancelled job again, from the stage it stopped in", cmd_cancel_resume, (
        arg("job", metavar="JOB", help=JOB_HELP),)),
    Command("prune", "remove finished jobs (done, failed, cancelled) and their folders", cmd_prune, (
        arg("--keep", type=int, help="keep the N newest finished jobs"),
        arg("--older-than", metavar="AGE", help="remove those finished longer ago than AGE: 7d, 12h, 30m or 45s "
                                                "(a bare number is seconds), and uploads unchanged for as long"))),
    Command("start", "start supervisord for the run folder and wait until its stages and the daemon are up",
            cmd_start_stop, (arg("--timeout", type=float, metavar="SECONDS",
                                 help="give up after this long (default 120)"),),
            description="Start supervisord (RUN/supervisord.conf) unless it runs, waiting first for one that is still "
                        "shutting down; return once every program it starts by itself (scheduler, executor, the "
                        "orchestrator daemon, the HTTP front) is RUNNING and the daemon answers. Exit 1 with what it "
                        "waited for when that takes longer than --timeout, or a program fails to start."),
    Command("stop", "stop every program and supervisord, and wait until supervisord has exited", cmd_start_stop, (
        arg("--timeout", type=float, metavar="SECONDS", help="give up after this long (default 180)"),),
        description="Stop every program in supervisord's shutdown order, then supervisord; return once its process "
                    "has exited and its socket is gone, so `orchestrator start` may follow at once (`supervisorctl "
                    "shutdown` returns before that). A supervisord that is not running is not an error."),
    Command("stages", "supervisord state of every program", cmd_stages),
    Command("restart", "restart one program through supervisord", cmd_restart, (
        arg("stage", metavar="PROGRAM", help=PROGRAM_HELP),)),
    Command("reload", "after an edit of pipeline.toml: restart every program it concerns (scheduler, executor, "
                      "the daemon), waiting for the daemon to answer", cmd_reload),
    Command("logs", "a program's log", cmd_logs, (
        arg("stage", metavar="PROGRAM", help=PROGRAM_HELP),
        arg("-f", "--follow", action="store_true", help="keep printing what the program writes (Ctrl-C stops)"),
        arg("--bytes", type=int, default=16 * 1024, help="how much of the end to show first"))),
    Command("keys", "CURVE key pairs for remote stages", cmd_keys, (
        arg("action", choices=["generate"]),
        arg("--dir", help="where to write (default: RUN/keys)"),
        arg("--name", default="client", help="file name stem: NAME.key and NAME.key_secret"),
        arg("--force", action="store_true", help="replace an existing key pair of that name"))),
    Command("service", "a systemd unit that starts supervisord for the run folder at boot", cmd_service, (
        arg("action", choices=["install", "uninstall"]),
        arg("--user", action="store_true", help="a user unit (~/.config/systemd/user) instead of a system "
                                                "unit (/etc/systemd/system, needs root)"),
        arg("--print", action="store_true", help="install: print the unit, write nothing"),
        arg("--name", default="anima", help="unit name (default: anima -> anima.service)"),
        arg("--root", metavar="DIR", help="write below DIR instead of / (as systemctl --root)"),
        arg("--force", action="store_true", help="replace or remove a unit written for another run folder "
                                                 "or by something else"))),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orchestrator", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="run folder (default: $ANIMA_RUN, else a source checkout's run/, else run/ in the "
                                 "current folder)")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        extra = {"description": command.description} if command.description is not None else {}
        s = sub.add_parser(command.name, help=command.help, **extra)
        # `--run` after the subcommand too (`orchestrator doctor --run R`); given there it wins
        s.add_argument("--run", default=argparse.SUPPRESS, help="run folder (as before the subcommand)")
        for flags, kwargs in command.args:
            s.add_argument(*flags, **kwargs)
        s.set_defaults(fn=command.fn)
    return p


def main(argv=None, *, connect: Callable[[RunFolder], object] | None = None) -> int:
    """`connect(rf)` -> the daemon client the job commands use: DaemonClient (its socket) unless given, e.g.
    one to a daemon in this process (orchestrator.engine.daemon_client.DaemonClient.in_process)."""
    args = build_parser().parse_args(argv)
    args.connect = connect or DaemonClient
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from orchestrator.engine.supervisor import SupervisorError
    try:
        rf = RunFolder.resolve(args.run)
        return int(args.fn(args, rf) or 0)
    except CliError as e:
        print(f"orchestrator {args.command}: error: {e}", file=sys.stderr)
        return e.code
    except SupervisorError as e:
        print(f"orchestrator {args.command}: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        # the reader went away (`orchestrator stages | head`): what it wanted was printed; no error, and no second
        # one when Python flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (ValueError, OSError) as e:
        print(f"orchestrator {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\norchestrator {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
