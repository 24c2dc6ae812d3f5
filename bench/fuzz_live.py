"""Live fuzz targets on the real pipeline (tests/pipeline_harness.py: supervisord and the real programs): the VAE
stage's DECODE and the orchestrator daemon's SUBMIT and STATUS, driven by tests.fuzzing.fuzz_live. Used by
bench/fuzz_protocol.py (`--live`) and tests/test_stage_hardening.py (CI counts).

    from bench.fuzz_live import FUZZ_TOML, live_targets
    with Pipeline.start(models, pack, extra_toml=FUZZ_TOML) as pipe, live_targets(pipe) as targets:
        counts = fuzz_live(ctx, targets["DECODE"], 1000)

By design no fuzzed job gets past encoding: the fuzz pipeline's encoder is pointed at a text encoder file that does
not exist (FUZZ_TOML), so every queued job fails when the encoder cannot start, and no fuzzed `output` path is ever
written (a byte flip can turn one into any path on the machine). The daemon still runs those jobs through its flow,
so SUBMIT/STATUS are fuzzed while a job is in progress too.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import zmq

from orchestrator.terminal.cli import CliError
from protocol import messages as m
from protocol.arena import Arena, segment_name
from tests.fuzzing import LiveTarget, carried, json_variant
from protocol.prompt import PromptFile
from protocol.sockets import LazyPirate
from protocol.tensors import InlineFrames, TensorDesc
from stages.config import load_config

FUZZ_TOML = '[stage.encoder]\ntext_encoder = "/nonexistent/fuzz/text-encoder.safetensors"\n'   # harness extra
FUZZ_JOB = "fuzz-decode"
LATENT = (16, 8, 8)                                 # [C, h, w] → a 64×64 image
BASE_PROMPT = {"prompt": "fuzz", "negative_prompt": "", "seed": 1, "steps": 1, "cfg": 4.0}
SEEDS = ["9" * 5000, "-" + "9" * 5000, str(2**64), str(2**64 - 1), "-1", "1e400", "1.0", "true", '"7"', "null"]
STAGE_START_S = 180.0
SETTLE_S = 300.0                                    # jobs left by the SUBMIT fuzz: cancelled and finished by then


def _with_raw(base: dict, key: str, raw: str) -> str:
    """JSON text of `base` with `key` set to the raw JSON `raw` (which json.dumps may be unable to write)."""
    rest = json.dumps({k: v for k, v in base.items() if k != key})
    return rest[:-1] + f", {json.dumps(key)}: {raw}}}"


def _sandbox_outputs(sandbox: Path) -> list[str]:
    """Raw JSON values for `output`: absolute paths in the sandbox only (long names, odd names, folders)."""
    s = str(sandbox)
    paths = [f"{s}/a.png", f"{s}/sub/", f"{s}/sub/b.png", f"{s}/{'x' * 300}.png", f"{s}/{'y' * 300}/c.png",
             f"{s}/d.PNG", s, f"{s}/../{sandbox.name}/e.png", f"{s}/sub/../f.png", f"{s}/.png", f"{s}/sub/g.jpg"]
    return [json.dumps(p) for p in paths] + [f'"{s}/\\u0000.png"', f'"{s}/\\ud800.png"', '""', "null", "7"]


def _wait_live(pipe, program: str, timeout_s: float = STAGE_START_S) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = pipe.sup.info(program)
        if info.state == "RUNNING" and info.pid:
            return info.pid
        if info.state in ("STOPPED", "EXITED", "FATAL"):
            pipe.sup.start(program)
        time.sleep(0.2)
    raise AssertionError(f"{program} is not RUNNING after {timeout_s:.0f} s\n{pipe.logs()}")


def _pid(pipe, program: str):
    def pid() -> int:
        info = pipe.sup.info(program)
        return info.pid if info.state in ("STARTING", "RUNNING") else 0
    return pid


def decode_target(pipe, arena: Arena) -> LiveTarget:
    """DECODE to the real VAE stage: a local request (latent in an arena slot, PNG into the job's folder) and an
    inline one (return_png), alternating; the probe decodes a fresh inline latent."""
    job_dir = pipe.rf.jobs / FUZZ_JOB
    job_dir.mkdir(parents=True, exist_ok=True)
    slot = arena.alloc("latent", "f32", LATENT)
    rng = np.random.default_rng(0)
    arena.write(slot, rng.standard_normal(LATENT).astype(np.float32))
    meta = {"prompt": "fuzz", "seed": "1"}
    frames = InlineFrames()
    desc = frames.add(rng.standard_normal(LATENT).astype(np.float32))
    local = m.Decode(job=FUZZ_JOB, latent=slot, arena=arena.name, output=str(job_dir / "image.png"), metadata=meta)
    inline = m.Decode(job=FUZZ_JOB, latent=desc, return_png=True, metadata=meta, inline=tuple(frames.frames))

    def probe() -> m.Decode:
        f = InlineFrames()
        d = f.add(np.random.default_rng().standard_normal(LATENT).astype(np.float32))
        return m.Decode(job=FUZZ_JOB, latent=d, return_png=True, metadata=meta, inline=tuple(f.frames))

    def probe_ok(reply: m.Message) -> bool:
        return isinstance(reply, m.Decoded) and (reply.width, reply.height) == (8 * LATENT[2], 8 * LATENT[1]) \
            and reply.png is not None

    endpoint = load_config(pipe.rf.pipeline_toml).endpoint("vae")
    with LazyPirate(zmq.Context.instance(), endpoint, timeout_s=STAGE_START_S, retries=0) as link:
        m.expect(link.request(m.Hello(peer="fuzz", pid=os.getpid(), version="0")), m.Ready, "vae")   # model loaded
    empty = m.Decode(job=FUZZ_JOB, latent=TensorDesc("f32", (16, 0, 4), slot="latent", offset=slot.offset),
                     arena=arena.name, output=local.output, metadata=meta)
    corpus = [empty, m.Decode(job=FUZZ_JOB, latent=slot, arena=arena.name, output="/tmp/fuzz-anywhere.txt"),
              m.Decode(job=FUZZ_JOB, latent=slot, arena=arena.name, output=local.output,
                       tile=m.TileSettings(tile=4, overlap=0.9))]
    return LiveTarget(endpoint=endpoint, bases=[local, inline], pid=_pid(pipe, "vae"), probe=probe,
                      probe_ok=probe_ok, corpus=corpus, timeout_s=60.0)


def daemon_targets(pipe, sandbox: Path) -> dict[str, LiveTarget]:
    """SUBMIT (the message and, half the time, the prompt record inside it) and STATUS to the real daemon."""
    sandbox.mkdir(parents=True, exist_ok=True)
    (sandbox / "sub").mkdir(exist_ok=True)
    outputs = _sandbox_outputs(sandbox)
    submit = m.Submit(prompt=PromptFile.from_data(BASE_PROMPT), base_dir=str(sandbox))

    values = {"output": outputs, "seed": SEEDS}

    def payload(head: dict, rng: random.Random) -> None:
        head["prompt"] = carried(json_variant(BASE_PROMPT, rng, values))

    def is_jobs(reply: m.Message) -> bool:
        return isinstance(reply, m.Jobs)

    common = dict(endpoint=pipe.rf.daemon_endpoint, pid=_pid(pipe, "orchestrator"), probe=lambda: m.Status(),
                  probe_ok=is_jobs, timeout_s=60.0)
    def raw(key: str, value: str):
        def edit(head: dict, rng: random.Random) -> None:
            head["prompt"] = carried(_with_raw(BASE_PROMPT, key, value))
        return edit

    corpus = [(submit, raw(k, v))
              for k, v in (("seed", "9" * 5000), ("output", outputs[3]), ("prompt", '"\\ud800"'),
                           ("spectrum", "[" * 5000 + "]" * 5000))]        # values a naive reader dies on
    return {"SUBMIT": LiveTarget(bases=[submit], payload=payload, protect=frozenset({"base_dir"}), corpus=corpus,
                                 **common),
            "STATUS": LiveTarget(bases=[m.Status(), m.Status(job="nosuch"), m.Status(job="fuzz-decode")], **common)}


def settle_jobs(pipe, timeout_s: float = SETTLE_S) -> list:
    """Cancel every job the fuzz queued and wait until none is queued or running; -> the jobs (JobInfo)."""
    client = pipe.client()
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = client.call(m.Status(), m.Jobs).jobs
        active = [j for j in jobs if j.state not in ("done", "failed", "cancelled")]
        if not active:
            return list(jobs)
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs still active after {timeout_s:.0f} s: {active}\n{pipe.logs()}")
        for j in active:
            try:
                client.call(m.Cancel(job=j.job), m.Ok)
            except CliError as e:         # it ended between STATUS and CANCEL: the next look sees it
                if "is already" not in str(e):
                    raise
        time.sleep(1.0)


@contextlib.contextmanager
def live_targets(pipe):
    """{"DECODE", "SUBMIT", "STATUS"} targets on a running harness pipeline (started with FUZZ_TOML); the VAE is
    started for the DECODE fuzz; the arena, job folder and sandbox are removed afterwards."""
    _wait_live(pipe, "vae")
    arena = Arena.create(segment_name(pipe.root, "fuzz-live"), 1 << 20)
    sandbox = pipe.root / "fuzz-out"
    try:
        yield {"DECODE": decode_target(pipe, arena), **daemon_targets(pipe, sandbox)}
    finally:
        arena.close()
        shutil.rmtree(sandbox, ignore_errors=True)
        shutil.rmtree(pipe.rf.jobs / FUZZ_JOB, ignore_errors=True)
