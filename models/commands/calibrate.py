"""`anima-models calibrate PACK --models DIR --prompts FILE --out CALIB`: the branch inputs of real jobs, for INT8.

    anima-models calibrate packs/anima-512-fp32 --models MODELS --prompts prompts.txt --out calib/anima-512 \\
        [--seeds 0,1] [--steps 20] [--cfg 4] [--samples 8] [--holdout 4]

Runs every prompt (one a line; blank lines and lines starting with # skipped) with every seed in process on ONNX
Runtime, the CFG passes a job at that cfg runs (both; at --cfg 1 the conditional one alone, as ComfyUI and the
pipeline do: the negative prompt is then not encoded), every sampled sigma (Euler, no Spectrum: every step
computed), and keeps per branch the
per-channel abs maxima of its input (SmoothQuant's statistics) and a bounded sample of whole inputs (the toolkit's
quantizer dataset, plus held-out ones for quant-check). docs/quant.md says how it is used.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from models.commands import UserError

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("pack", help="a pack of the checkpoint at the size to calibrate (FP32 or FP16; ONNX graphs)")
    p.add_argument("--models", required=True, metavar="DIR", help="models folder (its text encoder and tokenizers)")
    p.add_argument("--dit", default=None, metavar="FILE", help="the DiT file holding the LLM adapter (default: the "
                   "checkpoint the pack was built from)")
    p.add_argument("--prompts", required=True, metavar="FILE", help="prompts, one a line")
    p.add_argument("--negative", default="", help="negative prompt of every job (default empty)")
    p.add_argument("--out", required=True, metavar="CALIB", help="calibration folder to write")
    p.add_argument("--seeds", default="0,1", help="seeds, comma-separated (default 0,1)")
    p.add_argument("--steps", type=int, default=20, help="steps per job (default 20)")
    p.add_argument("--cfg", type=float, default=4.0, help="CFG scale (default 4)")
    p.add_argument("--samples", type=int, default=8, help="whole inputs kept per branch for the quantizer (default 8)")
    p.add_argument("--holdout", type=int, default=4, help="held-out inputs kept per branch for quant-check "
                   "(default 4)")


def read_prompts(path: str) -> list:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"--prompts {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--prompts {path}: not readable as UTF-8 text ({e})") from None
    prompts = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    if not prompts:
        raise UserError(f"--prompts {path}: no prompts in it (one a line)")
    return prompts


def _numbers(args) -> list:
    try:
        seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--seeds {args.seeds!r}: integers, comma-separated") from None
    if not seeds or any(s < 0 for s in seeds):
        raise UserError(f"--seeds {args.seeds!r}: at least one seed, each >= 0")
    for name in ("steps", "samples", "holdout"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1, got {getattr(args, name)}")
    return seeds


def _encode(args, pack, prompts: list, passes: int) -> list:
    """[(cond, uncond)] per prompt by the models folder's text encoder; uncond None at one pass (cfg 1)."""
    from models.setup.models_dir import resolve_models
    from models.text.conditioning import TextEncoder
    dit = args.dit or pack.source.get("path")
    paths = resolve_models(args.models, {"dit": dit}, need=("dit", "text_encoder", "qwen_tokenizer", "t5_tokenizer"))
    enc = TextEncoder.from_files(str(paths.text_encoder), str(paths.dit), str(paths.qwen_tokenizer),
                                 str(paths.t5_tokenizer))
    try:
        pairs = [enc.encode_pair(p, args.negative) if passes == 2 else (enc.encode(p), None) for p in prompts]
    finally:
        enc.close()
    if pairs[0][0].shape[0] != pack.geometry.text_tokens:
        raise UserError(f"{args.pack}: a pack of {pack.geometry.text_tokens} context rows; calibrate a pack with the "
                        f"default {pairs[0][0].shape[0]}")
    return pairs


def _jobs(pairs: list, seeds: list) -> tuple:
    """(contexts, jobs): every context encoded, in order (a prompt's cond, then its uncond when there is one), and
    per prompt and seed (cond, uncond, seed, (context id of each pass))."""
    contexts, jobs = [], []
    for cond, uncond in pairs:
        ids = tuple(range(len(contexts), len(contexts) + (1 if uncond is None else 2)))
        contexts += [cond] if uncond is None else [cond, uncond]
        jobs += [(cond, uncond, seed, ids) for seed in seeds]
    return contexts, jobs


def run(args) -> int:
    from models.packs.pack import load_pack
    from models.quant.calib import Collector, collect, write_calib
    from models.runtime.dit_runner import DiTRunner
    from models.sampling.denoise import make_sampler
    from models.sampling.sampler import cfg_passes
    seeds = _numbers(args)
    passes = cfg_passes(args.cfg)
    if passes == 1 and args.negative:
        log.warning("--negative %r: at cfg 1 no unconditional pass runs (ComfyUI's rule), so the negative prompt "
                    "changes nothing and is not encoded", args.negative)
    prompts = read_prompts(args.prompts)
    pack = load_pack(args.pack)
    t0 = time.perf_counter()
    contexts, jobs = _jobs(_encode(args, pack, prompts, passes), seeds)
    runner = DiTRunner(pack, "onnx")
    col = Collector(args.samples, args.holdout)
    try:
        sigmas = collect(runner, jobs, make_sampler(args.steps, args.cfg, spectrum=None), col)
    finally:
        runner.close()
    info = {"source_sha256": pack.source["sha256"], "geometry": pack.geometry.to_dict(), "pack_dtype": pack.dtype,
            "prompts": len(prompts), "seeds": seeds, "steps": args.steps, "cfg": args.cfg, "passes": passes,
            "sigmas": sorted(set(sigmas), reverse=True)}
    out = write_calib(args.out, col, contexts, info)
    print(f"calibration {out}: {len(jobs)} jobs x {args.steps} steps x {passes} passes = {col.records} records; "
          f"{len(col.keep.slots)} samples + {len(col.held.slots)} held out per branch, {len(col.absmax)} branches, "
          f"{time.perf_counter() - t0:.1f} s")
    return 0
