"""Calibration: the branch inputs of real jobs (in process, ONNX Runtime), kept compactly.

A calibration folder holds `calib.safetensors` and `calib.json`:
- `absmax.bNN_kind` [D] f32: per input channel, the largest |xn| any collected call fed that branch (what SmoothQuant's
  factors are computed from); held-out records never enter it;
- `sample.bNN_kind.K` [L, D] f16: a bounded reservoir of whole branch inputs per branch (the toolkit's quantizer
  dataset), and `heldout.bNN_kind.K` the same for records kept out of both (what quant-check compares on);
- `context.C` [S, Dc] f16: the contexts the cross-attention samples were fed with (one per prompt and CFG pass run:
  two at cfg > 1, the prompt's alone at cfg 1).
calib.json says which job, sigma and context each sample came from. Both files are written atomically.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from models.base.durable import atomic_write

log = logging.getLogger(__name__)

CALIB_FILE = "calib.safetensors"
CALIB_JSON = "calib.json"
CALIB_KIND = "anima-calibration"
HOLDOUT_EVERY = 3                    # stream record p is held out when p % 3 == 2


class CalibError(ValueError):
    """A calibration folder that is missing, unreadable or made for another checkpoint or size."""


@dataclass
class Reservoir:
    """Algorithm R over the stream of records, one decision per record shared by every branch (so a kept record keeps
    all of a call's branch inputs); deterministic in its seed."""
    size: int
    seed: int
    seen: int = 0
    slots: list = field(default_factory=list)        # [(record meta, {branch: xn f16})]

    def offer(self, meta: dict, xns: dict) -> None:
        rng = np.random.default_rng([self.seed, self.seen])
        self.seen += 1
        if len(self.slots) < self.size:
            self.slots.append((meta, {k: v.astype(np.float16) for k, v in xns.items()}))
            return
        j = int(rng.integers(0, self.seen))
        if j < self.size:
            self.slots[j] = (meta, {k: v.astype(np.float16) for k, v in xns.items()})


class Collector:
    """Receives every pass's trace (per block: {kind: {"xn"}}) with where it came from."""

    def __init__(self, samples: int, holdout: int, seed: int = 0):
        self.absmax: dict = {}
        self.keep = Reservoir(samples, seed)
        self.held = Reservoir(holdout, seed + 1)
        self.records = 0

    def add(self, trace: list, meta: dict) -> None:
        xns = {f"b{b:02d}_{kind}": rec[kind]["xn"] for b, rec in enumerate(trace) for kind in ("self", "cross", "ffn")}
        held = self.records % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
        self.records += 1
        if held:
            self.held.offer(meta, xns)
            return
        for name, xn in xns.items():
            m = np.abs(xn).max(axis=0).astype(np.float32)               # [D]
            prev = self.absmax.get(name)
            self.absmax[name] = m if prev is None else np.maximum(prev, m)
        self.keep.offer(meta, xns)


def collect(runner, jobs: list, sampler, collector: Collector) -> list:
    """Run each job (cond, uncond, seed, context ids) to the end with `sampler`, tracing the passes the sampler runs:
    both CFG passes, or at cfg 1 the conditional one alone (uncond None: ComfyUI runs no unconditional pass there,
    so its inputs never reach a branch and must not enter the statistics); -> the sigmas met."""
    from models.sampling.denoise import start_or_resume
    from models.dit.partition import LATENT_SCALE
    g = runner.geom
    shape = (runner.cfg.latent_channels, g.height // LATENT_SCALE, g.width // LATENT_SCALE)
    sigmas = []
    for j, (cond, uncond, seed, ctx_ids) in enumerate(jobs):
        def model_fn(x, sigma, j=j, contexts=(cond, uncond)[:sampler.passes], ctx_ids=ctx_ids):
            outs = []
            for p, ctx in enumerate(contexts):
                tr: list = []
                outs.append(runner.forward_passes([x], sigma, [ctx], trace=tr)[0])
                collector.add(tr, {"job": j, "sigma": float(sigma), "pass": p, "context": ctx_ids[p]})
            sigmas.append(float(sigma))
            return outs[0], (outs[1] if len(outs) > 1 else None)
        state = start_or_resume(sampler, seed, shape)
        sampler.sample(model_fn, state=state)
        log.info("calibration job %d/%d done (%d records)", j + 1, len(jobs), collector.records)
    return sigmas


def write_calib(out, collector: Collector, contexts: list, info: dict) -> Path:
    """The calibration folder at `out` (created if needed): tensors then the JSON that describes them."""
    from models.base.safetensors_io import TensorEntry, write_safetensors
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    entries = [TensorEntry(f"absmax.{k}", "F32", tuple(v.shape), v) for k, v in sorted(collector.absmax.items())]
    samples: dict = {}
    for prefix, res in (("sample", collector.keep), ("heldout", collector.held)):
        for i, (meta, xns) in enumerate(res.slots):
            for name, xn in xns.items():
                entries.append(TensorEntry(f"{prefix}.{name}.{i}", "F16", tuple(xn.shape), xn))
            samples.setdefault(prefix, []).append(meta)
    for c, ctx in enumerate(contexts):
        entries.append(TensorEntry(f"context.{c}", "F16", tuple(ctx.shape), np.asarray(ctx, np.float16)))
    write_safetensors(out / CALIB_FILE, entries, metadata={"kind": CALIB_KIND})
    from models.records.manifest import file_sha256
    doc = {"kind": CALIB_KIND, **info, "records": collector.records, "samples": samples.get("sample", []),
           "heldout": samples.get("heldout", []), "contexts": len(contexts),
           "branches": sorted(collector.absmax), "tensors_sha256": file_sha256(out / CALIB_FILE)}
    atomic_write(out / CALIB_JSON, json.dumps(doc, indent=1) + "\n")
    return out


@dataclass
class Calibration:
    """A calibration folder, read: its description and its tensors (read on demand)."""
    dir: Path
    info: dict
    file: object

    def absmax(self, name: str) -> np.ndarray:
        return self.file.get(f"absmax.{name}")

    def inputs(self, name: str, held_out: bool = False) -> list:
        """[(xn [L, D] f32, context [S, Dc] f32 | None)] of one branch (bNN_kind)."""
        prefix, metas = ("heldout", self.info["heldout"]) if held_out else ("sample", self.info["samples"])
        out = []
        for i, meta in enumerate(metas):
            ctx = self.file.get(f"context.{meta['context']}") if name.endswith("_cross") else None
            out.append((self.file.get(f"{prefix}.{name}.{i}"), ctx))
        return out

    def context(self, c: int) -> np.ndarray:
        return self.file.get(f"context.{c}")


def read_calib(folder) -> Calibration:
    """A calibration folder written by `write_calib`; CalibError naming what is wrong."""
    from models.records.manifest import file_sha256
    from models.base.safetensors_io import SafeTensorsError, SafeTensorsFile
    d = Path(folder)
    try:
        info = json.loads((d / CALIB_JSON).read_text())
    except FileNotFoundError:
        raise CalibError(f"{d}: no {CALIB_JSON} (make one with `anima-models calibrate`)") from None
    except (OSError, ValueError) as e:
        raise CalibError(f"{d / CALIB_JSON}: not readable JSON ({e})") from None
    if not isinstance(info, dict) or info.get("kind") != CALIB_KIND:
        raise CalibError(f"{d / CALIB_JSON}: field 'kind' is not {CALIB_KIND!r}")
    for k in ("source_sha256", "geometry", "samples", "heldout", "branches", "tensors_sha256"):
        if k not in info:
            raise CalibError(f"{d / CALIB_JSON}: field {k!r} is missing")
    if not (d / CALIB_FILE).is_file() or file_sha256(d / CALIB_FILE) != info["tensors_sha256"]:
        raise CalibError(f"{d / CALIB_FILE}: missing or not the file {CALIB_JSON} describes (sha256 differs)")
    try:
        f = SafeTensorsFile(d / CALIB_FILE)
    except (SafeTensorsError, OSError) as e:
        raise CalibError(f"{d / CALIB_FILE}: not readable ({e})") from None
    return Calibration(d, info, f)
