"""TEST DOUBLES ONLY (not the product): stand-in stage logics for the orchestrator's own tests, run through the real
stage framework (stages/base.py) under a real supervisord. They exercise the job flow's wiring — arena slots, stage
start/stop, events, retries — not any model math. The real stages live in stages/.

    python tests/orch_doubles.py encoder|scheduler|executor|vae --config RUN/pipeline.toml

Behaviour switches (files in the run folder, so a test can flip them while the stage runs):
    RUN/double_step_s        seconds per denoising step (default 0.05)
    RUN/double_encoder_crash the encoder raises (fatal tier) on ENCODE
    RUN/double_encode_s      the next ENCODE sleeps this long first (the flag is consumed; RUN/double_encoding says so)
    RUN/double_vae_encode_s  the next VAE_ENCODE sleeps this long first (consumed; RUN/double_vae_encoding says so)
    RUN/double_decode_s      every DECODE sleeps this long first while the flag is there (RUN/double_decoding names
                             the output it is writing)
    RUN/double_start_crashes N: the encoder's next N starts exit 1 at once (a start that dies within startsecs)

VAE_ENCODE's stand-in latent: channel c is the 8x8 mean of image channel c % 3 plus a fresh random jitter below 1e-3
per call, so a job that encoded its image twice would show it. A DENOISE with an init latent gives
2 * init_latent + noise_mask (0 without one) + denoise: the test sees what reached the scheduler.
A DENOISE of a batch image (batch_size > 1) gives image batch_pos's slice of the seed's batch noise
(models.sampling.latent_ops.batch_noise) + 100 * (noise_index - batch_pos), and logs each step it runs in
RUN/double_batch_steps (one line per step: "JOBDIR POS STEP"). Every DENOISE appends a JSON line to RUN/double_denoises
(its state folder, params, cond[0, 0], uncond[0, 0]), every ENCODE one to RUN/double_encodes (pid, job, prompt,
negative, rows, the two conditioning entries). ENCODE's stand-in context of a text is len(text) everywhere; with an
entry (protocol.prompt.CondEntry) its zero_out makes that 0, then its average gives weight x it + (1 - weight) x
len(average.text), in the order the real encoder applies them. DECODE's stand-in image: each latent cell's
int(latent[0]) % 256 as an 8x8 grey block.
"""
from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path


def _crash_at_start(argv: list[str]) -> None:
    """The encoder's start dies before any heavy import: within startsecs (1 s) even on a loaded machine, else
    supervisord counts it RUNNING and restarts it itself (autorestart) instead of ending FATAL."""
    if __name__ != "__main__" or argv[1:2] != ["encoder"] or "--config" not in argv:
        return
    flag = Path(argv[argv.index("--config") + 1]).parent / "double_start_crashes"
    left = int(flag.read_text()) if flag.exists() else 0
    if left > 0:
        flag.write_text(str(left - 1))
        sys.exit(1)


_crash_at_start(sys.argv)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol import messages as m  # noqa: E402
from protocol.tensors import InlineFrames  # noqa: E402
from stages.base import stage_main  # noqa: E402


CONTEXT_DIM = 128          # the fake packs' context width (tests/doubles_harness.py: the test DiT config)


def _flag(cfg, name: str, default=None):
    p = Path(cfg.run_dir) / name
    return p.read_text().strip() if p.exists() else default


def _context_value(text: str, entry) -> float:
    """The double's context value of `text` under its conditioning entry (None: plain)."""
    value = 0.0 if entry is not None and entry.zero_out else float(len(text))
    if entry is not None and entry.average is not None:
        w = entry.average.weight
        value = w * value + (1 - w) * len(entry.average.text)
    return value


class EncoderDouble:
    def __init__(self, cfg):
        self.cfg = cfg

    def on_encode(self, msg: m.Encode, ctx) -> m.Encoded:
        if _flag(self.cfg, "double_encoder_crash") is not None:
            raise RuntimeError("double encoder told to crash")
        delay = float(_flag(self.cfg, "double_encode_s", "0"))
        if delay:                                # long enough for a test to SIGKILL it mid-request, once
            Path(self.cfg.run_dir, "double_encode_s").unlink(missing_ok=True)
            Path(self.cfg.run_dir, "double_encoding").write_text(str(os.getpid()))
            time.sleep(delay)
        vals = {"cond": _context_value(msg.prompt, msg.prompt_entry),
                "uncond": _context_value(msg.negative, msg.negative_entry)}
        entries = [None if e is None else e.to_dict() for e in (msg.prompt_entry, msg.negative_entry)]
        with open(Path(self.cfg.run_dir) / "double_encodes", "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "job": msg.job, "prompt": msg.prompt, "negative": msg.negative,
                                "rows": msg.rows, "inline": msg.arena is None, "entries": entries}) + "\n")
        if msg.arena is None:
            frames = InlineFrames()
            descs = {k: frames.add(np.full((msg.rows, CONTEXT_DIM), v, np.float32)) for k, v in vals.items()}
            return m.reply_to(msg, m.Encoded, job=msg.job, cond=descs["cond"], uncond=descs["uncond"], tokens_cond=1,
                              tokens_uncond=1, inline=tuple(frames.frames))
        arena = ctx.arena(msg.arena)
        for key, desc in (("cond", msg.cond), ("uncond", msg.uncond)):
            arena.view(desc)[...] = vals[key]                                  # [S, Dc] f32
        return m.reply_to(msg, m.Encoded, job=msg.job, cond=msg.cond, uncond=msg.uncond, tokens_cond=3,
                          tokens_uncond=1, timings={"encode_s": 0.001})


class SchedulerDouble:
    """Steps through a fake schedule, one PROGRESS per step, keeping `state.json` in the job folder (resumable)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def on_denoise(self, msg: m.Denoise, ctx) -> m.Denoised:
        t0 = time.monotonic()
        step_s = float(_flag(self.cfg, "double_step_s", "0.05"))
        state_path = Path(msg.job_dir) / "state.json"
        start = json.loads(state_path.read_text())["step"] if msg.resume and state_path.exists() else 0
        arena = ctx.arena(msg.arena)
        cond = arena.read(msg.cond)                                          # [S, Dc] f32
        p = msg.params
        with open(Path(self.cfg.run_dir) / "double_denoises", "a") as f:
            f.write(json.dumps({"job_dir": msg.job_dir, "seed": p.seed, "steps": p.steps, "cfg": p.cfg,
                                "sampler": p.sampler, "scheduler": p.scheduler, "denoise": p.denoise,
                                "spectrum": p.spectrum.enabled, "batch_size": p.batch_size,
                                "batch_pos": p.batch_pos, "noise_index": p.noise_index,
                                "width": p.width, "height": p.height, "cond": float(cond[0, 0]),
                                "start_step": p.start_step, "end_step": p.end_step, "add_noise": p.add_noise,
                                "leftover_noise": p.leftover_noise,
                                "uncond": float(arena.read(msg.uncond)[0, 0])}) + "\n")
        steps = msg.params.steps
        for step in range(start + 1, steps + 1):
            for block, branch in ((0, "self"), (0, "cross"), (0, "ffn")):
                ctx.check(msg.job)
                ctx.emit(m.Progress(job=msg.job, step=step, steps=steps, block=block, branch=branch,
                                    elapsed_s=time.monotonic() - t0, eta_s=(steps - step) * step_s))
                time.sleep(step_s / 3)
            tmp = state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step}))
            os.replace(tmp, state_path)
            if msg.params.batch_size > 1:
                with open(Path(self.cfg.run_dir) / "double_batch_steps", "a") as f:
                    f.write(f"{msg.job_dir} {msg.params.batch_pos} {step}\n")
        latent = np.full(msg.latent.shape, float(cond[0, 0]) + msg.params.seed % 7, np.float32)  # [C, h, w] f32
        p = msg.params
        if p.batch_size > 1:
            from models.sampling.latent_ops import batch_noise
            latent = (batch_noise(p.seed, (p.batch_size, *msg.latent.shape))[p.batch_pos]
                      + np.float32(100 * (p.noise_index - p.batch_pos))).astype(np.float32)
        if msg.init_latent is not None:
            mask = arena.read(msg.noise_mask) if msg.noise_mask is not None else np.float32(0)
            latent = (2 * arena.read(msg.init_latent) + mask + np.float32(msg.params.denoise)).astype(np.float32)
        arena.write(msg.latent, latent)
        sums = {k: m.PhaseSums(calls=steps, load_s=0.01, init_s=0.02, infer_s=0.03, release_s=0.004)
                for k in ("self", "cross", "ffn")}
        return m.reply_to(msg, m.Denoised, job=msg.job, latent=msg.latent, computed_steps=tuple(range(1, steps + 1)),
                          forecast_steps=(), branch_calls=3 * steps, branches=sums, host_s=0.5, transport_s=0.1,
                          wall_s=time.monotonic() - t0, resumed_from=start)


class ExecutorDouble:
    def __init__(self, cfg):
        self.cfg = cfg


class VaeDouble:
    def __init__(self, cfg):
        self.cfg = cfg

    def on_vae_encode(self, msg: m.VaeEncode, ctx) -> m.VaeEncoded:
        from stages.tensor_io import ReplyTensors, read_tensor
        delay = float(_flag(self.cfg, "double_vae_encode_s", "0"))
        if delay:
            Path(self.cfg.run_dir, "double_vae_encode_s").unlink(missing_ok=True)
            Path(self.cfg.run_dir, "double_vae_encoding").write_text(str(os.getpid()))
            time.sleep(delay)
        image = read_tensor(ctx, msg.arena, msg.image, msg.inline, field="image")      # [3, H, W] f32
        _, h, w = image.shape
        pooled = image.reshape(3, h // 8, 8, w // 8, 8).mean(axis=(2, 4))
        c = msg.latent.shape[0] if msg.latent is not None else 16
        jitter = np.random.default_rng().uniform(0, 1e-3, (c, h // 8, w // 8))
        latent = (pooled[np.arange(c) % 3] + jitter).astype(np.float32)
        out = ReplyTensors(ctx, msg.arena)
        desc = out.put(latent, msg.latent, field="latent")
        return m.reply_to(msg, m.VaeEncoded, job=msg.job, latent=desc, timings={"encode_s": 0.001},
                          inline=out.inline)

    def on_decode(self, msg: m.Decode, ctx) -> m.Decoded:
        from PIL import Image, PngImagePlugin
        from stages.tensor_io import ReplyTensors, read_tensor
        latent = read_tensor(ctx, msg.arena, msg.latent, msg.inline, field="latent")   # [C, h, w] f32
        delay = float(_flag(self.cfg, "double_decode_s", "0"))
        if delay:                                # a test SIGKILLs the VAE or the daemon mid-DECODE
            Path(self.cfg.run_dir, "double_decoding").write_text(str(msg.output))
            time.sleep(delay)
        c, h, w = latent.shape
        cells = (latent[0].astype(np.int64) % 256).astype(np.uint8)                    # [h, w]: int() per cell
        img = Image.fromarray(np.repeat(np.repeat(cells, 8, 0), 8, 1)[..., None].repeat(3, 2))
        info = PngImagePlugin.PngInfo()
        for k, v in msg.metadata.items():
            info.add_itxt(k, v)
        buf = io.BytesIO()
        img.save(buf, format="PNG", pnginfo=info)
        out, png = ReplyTensors(ctx, None), None
        if msg.output is not None:
            tmp = msg.output + ".tmp"
            Path(tmp).write_bytes(buf.getvalue())
            os.replace(tmp, msg.output)
        if msg.return_png:
            png = out.put(np.frombuffer(buf.getvalue(), np.uint8), None, field="png")
        return m.reply_to(msg, m.Decoded, job=msg.job, path=msg.output, png=png, width=w * 8, height=h * 8,
                          timings={"decode_s": 0.001}, inline=out.inline)


LOGICS = {"encoder": EncoderDouble, "scheduler": SchedulerDouble, "executor": ExecutorDouble, "vae": VaeDouble}

if __name__ == "__main__":
    stage = sys.argv.pop(1)
    sys.exit(stage_main(stage, LOGICS[stage]))
