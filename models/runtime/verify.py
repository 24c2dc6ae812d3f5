"""Numeric verification of a pack against the FP32 torch reference: per branch (isolated) and through all blocks."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from models.packs.pack import Pack, PackError, load_pack
from models.dit.partition import parse_blocks

log = logging.getLogger(__name__)

# Pass marks per pack dtype. "branch": each branch fed the reference's own input (isolated); "hidden": the hidden
# state after each block when the pack runs the whole forward on its own; "final": the velocity v. A row passes when
# cos >= min_cos, it has no NaN/Inf, and max AE <= max_rel_ae * max|reference|. FP32 packs must agree to rounding;
# FP16 marks leave room for FP16 rounding through 28 blocks (and for an NPU's FP16 accumulation) yet catch a wrong or
# damaged branch, which lands far below them.
THRESHOLDS = {
    "fp32": {"branch": {"min_cos": 0.999999, "max_rel_ae": 1e-3},
             "hidden": {"min_cos": 0.999999, "max_rel_ae": 1e-3},
             "final": {"min_cos": 0.999999, "max_rel_ae": 1e-3}},
    "fp16": {"branch": {"min_cos": 0.999, "max_rel_ae": 0.05},
             "hidden": {"min_cos": 0.999, "max_rel_ae": 0.05},
             "final": {"min_cos": 0.999, "max_rel_ae": 0.05}},
}
DEFAULT_SIGMA = 0.6
TEXT_ROWS = 120                         # non-zero context rows of the random prompt (the rest is zero padding)


def metrics(got, ref) -> dict:
    """cos, MAE, max AE, max AE relative to max|ref|, and the count of NaN/Inf in `got`."""
    g = np.asarray(got, np.float64).ravel()
    r = np.asarray(ref, np.float64).ravel()
    bad = int(g.size - np.isfinite(g).sum())
    gf = np.where(np.isfinite(g), g, 0.0)
    d = np.abs(gf - r)
    denom = np.linalg.norm(gf) * np.linalg.norm(r)
    cos = float(gf @ r / denom) if denom > 0 else (1.0 if not np.any(gf) and not np.any(r) else 0.0)
    scale = float(np.abs(r).max()) if r.size else 0.0
    return {"cos": cos, "mae": float(d.mean()), "max_ae": float(d.max()),
            "rel_max_ae": float(d.max() / scale) if scale > 0 else float(d.max()), "nonfinite": bad}


@dataclass
class VerifyReport:
    pack: str
    checkpoint: str
    backend: str
    dtype: str
    seed: int
    sigma: float
    thresholds: dict
    rows: list = field(default_factory=list)  # {"block", "what", "scope", metrics..., "ok"}
    timing: object = None                     # the pack forward's ForwardTiming (isolated passes included)

    @property
    def failures(self) -> list:
        return [r for r in self.rows if not r["ok"]]

    @property
    def ok(self) -> bool:
        return not self.failures

    def add(self, block, what: str, scope: str, m: dict) -> None:
        th = self.thresholds[scope]
        ok = m["nonfinite"] == 0 and m["cos"] >= th["min_cos"] and m["rel_max_ae"] <= th["max_rel_ae"]
        self.rows.append({"block": block, "what": what, "scope": scope, **m, "ok": bool(ok)})

    def to_dict(self) -> dict:
        return {"pack": self.pack, "checkpoint": self.checkpoint, "backend": self.backend, "dtype": self.dtype,
                "seed": self.seed, "sigma": self.sigma, "thresholds": self.thresholds, "ok": self.ok,
                "failures": len(self.failures), "rows": self.rows}

    def table(self) -> str:
        head = f"{'block':>5}  {'what':<7}{'scope':<8}{'cos':>14}{'MAE':>11}{'max AE':>11}{'rel':>10}{'NaN/Inf':>8}  ok"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            b = "" if r["block"] is None else str(r["block"])
            lines.append(f"{b:>5}  {r['what']:<7}{r['scope']:<8}{r['cos']:>14.10f}{r['mae']:>11.3e}"
                         f"{r['max_ae']:>11.3e}{r['rel_max_ae']:>10.2e}{r['nonfinite']:>8d}  {'ok' if r['ok'] else 'FAIL'}")
        th = self.thresholds
        lines.append(f"{self.dtype} marks: " + ", ".join(f"{k} cos >= {v['min_cos']}, max AE <= {v['max_rel_ae']}·max|ref|"
                                                         for k, v in th.items()))
        lines.append(f"{'PASS' if self.ok else 'FAIL'}: {len(self.failures)} of {len(self.rows)} rows below the marks")
        return "\n".join(lines)


class _ReferenceProbe:
    """Feeds every selected branch the reference's own xn and scores its output against the reference's y."""

    def __init__(self, trace, blocks: set, report: VerifyReport):
        self.trace, self.blocks, self.report = trace, blocks, report

    def feed(self, block: int, kind: str):
        return {"xn": self.trace[block][kind]["xn"]} if block in self.blocks else None

    def result(self, block: int, kind: str, y) -> None:
        self.report.add(block, kind, "branch", metrics(y, self.trace[block][kind]["y"]))


def resolve_checkpoint(pack: Pack, checkpoint: Optional[str]) -> str:
    """The checkpoint to compare with: the given path, else the one recorded in the manifest if it still exists."""
    if checkpoint is None:
        checkpoint = pack.source.get("path")
        if not checkpoint or not os.path.isfile(checkpoint):
            raise PackError(f"{pack.dir}: the checkpoint it was built from ({checkpoint}) is not there; "
                            "pass the checkpoint path (--checkpoint)")
    elif not os.path.isfile(checkpoint):
        raise FileNotFoundError(f"checkpoint {checkpoint}: no such file")
    return checkpoint


def random_inputs(pack: Pack, seed: int) -> tuple:
    """A seeded latent x [C, h, w] ~ N(0, 1) and a context [S, Dc] with TEXT_ROWS non-zero rows, both f32."""
    rng = np.random.default_rng(seed)
    g, c = pack.geometry, pack.config
    x = rng.standard_normal((c.latent_channels, g.latent_h, g.latent_w), dtype=np.float32)
    ctx = np.zeros((g.text_tokens, c.context_dim), np.float32)
    ctx[:TEXT_ROWS] = rng.standard_normal((TEXT_ROWS, c.context_dim), dtype=np.float32)
    return x, ctx


def verify_pack(pack, checkpoint: Optional[str] = None, backend: str = "onnx", threads: Optional[int] = None,
                blocks: Optional[str] = None, seed: int = 0, sigma: float = DEFAULT_SIGMA,
                thresholds: Optional[dict] = None) -> VerifyReport:
    """Run the reference (with trace) and the pack (same inputs) and score branches, hidden states and v."""
    from models.dit.checkpoint import DiTCheckpoint
    from models.runtime.dit_runner import DiTRunner
    from models.dit.reference import reference_forward

    pack = pack if isinstance(pack, Pack) else load_pack(pack)
    ckpt_path = resolve_checkpoint(pack, checkpoint)
    ckpt = DiTCheckpoint.open(ckpt_path)
    if ckpt.sha256() != pack.source["sha256"]:
        raise PackError(f"{ckpt_path}: not the checkpoint this pack was built from "
                        f"(sha256 {ckpt.sha256()[:12]}…, manifest {pack.source['sha256'][:12]}…)")
    selected = set(parse_blocks(blocks, pack.config.blocks))
    report = VerifyReport(str(pack.dir), ckpt_path, backend, pack.dtype, seed, float(sigma),
                          thresholds or THRESHOLDS[pack.dtype])
    x, ctx = random_inputs(pack, seed)
    # 1) the oracle, with every branch's input and output
    log.info("verify: reference forward (FP32 torch) ...")
    v_ref, ref = reference_forward(ckpt, x, sigma, ctx, trace=True)
    # 2) the pack through the backend: the forward on its own (cumulative) plus an isolated pass per selected branch
    log.info("verify: pack forward through backend %r ...", backend)
    runner = DiTRunner(pack, backend=backend, threads=threads)
    trace: list = []
    v = runner.forward_passes([x], sigma, [ctx], trace=trace, probe=_ReferenceProbe(ref, selected, report))[0]
    # 3) cumulative rows after the isolated ones of each block, then the prediction
    rows, report.rows = report.rows, []
    for b in sorted(selected):
        report.rows += [r for r in rows if r["block"] == b]
        report.add(b, "hidden", "hidden", metrics(trace[b]["x_out"], ref[b]["x_out"]))
    report.add(None, "v", "final", metrics(v, v_ref))
    report.timing = runner.last_timing
    return report
