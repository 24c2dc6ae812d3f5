"""Board time per job shape (MODELLED): the template, with Spectrum, and Turbo at 8 / 4 / 2 steps, per size, pack,
board RAM, cold and warm; the table docs/board.md shows, and JSON.

    .venv/bin/python bench/job_shapes.py                       # prints the table, writes bench/out/job_shapes.json
    .venv/bin/python bench/job_shapes.py --json out.json --board-ram 8

Each row is bench/overhead.py's analytic projection (`--analytic --policy auto --vae npu`: the policy and the
`pack --shards N` the board model picks) for one shape: its model calls (a Spectrum job's computed ones) and CFG
passes (1 at cfg 1). FP16 packs, and W8A8 packs of the default INT8 layers (fc1, qkv, q) priced at the reference's
measured INT8 speed-up (R13). Cold: the encoder starts, loads and runs (39 s estimate for two texts; the prompt
alone at cfg 1: models/board/account.encoder_s), the VAE loads; warm: the prompts' conditioning comes from the run
folder's cache, and the NPU VAE stays up through the denoise where the board's memory allows it beside the DiT's
contexts (models/board/account.stays_up_while_denoising: never on 8 GB). Every figure comes from
models/board/cost.toml, whose constants cite the reference figures of docs/board-figures.md (R1-R13, P1-P9, M1).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.overhead import projection  # noqa: E402
from models.board import auto as board_auto  # noqa: E402
from models.board.cost import BOARD_RAMS_GB, LABEL, BoardModel, Shape  # noqa: E402
from models.packs.memory_fit import for_auto  # noqa: E402
from models.quant.smooth import DEFAULT_INT8  # noqa: E402
from models.sampling.spectrum import SpectrumSettings, plan  # noqa: E402

OUT = ROOT / "bench" / "out" / "job_shapes.json"
SIZES = ((512, 512), (1024, 1024))
# (name, steps, model calls, CFG passes per call): the template is 30 steps of er_sde at cfg 4 (two passes a call)
SHAPES = (("template 30 steps cfg 4", 30, 30, 2),
          ("template + Spectrum", 30, len(plan(SpectrumSettings(), 30)[0]), 2),
          ("Turbo 8 steps cfg 1", 8, 8, 1),
          ("Turbo 4 steps cfg 1", 4, 4, 1),
          ("Turbo 2 steps cfg 1", 2, 2, 1))
SOURCES = ("step times R2-R8 (NPU per branch, lifecycle per weight byte), memory R9-R10, INT8 R13, VAE on the NPU "
           "docs/vae.md estimate, encoder cost.toml [job] estimate")


def row(size: tuple, pack: str, ram: int, shape: tuple, warm: bool) -> dict:
    """One job shape on the modelled board: the auto policy and pack, and the job's seconds (MODELLED)."""
    name, steps, calls, passes = shape
    base = Shape.at_resolution(*size)
    model = BoardModel(dataclasses.replace(base, int8=DEFAULT_INT8) if pack == "int8" else base)
    budget = model.context_budget_mib(ram)
    n, cuts, e = board_auto.choose_pack(model, budget, memory=for_auto(size), computed_steps=calls, passes=passes)
    p, vae_up = projection(model, e, calls, "npu", budget, warm, ram, passes)
    return {"shape": name, "steps": steps, "model_calls": calls, "cfg_passes": passes, "size": f"{size[0]}x{size[1]}",
            "pack": pack, "int8": list(DEFAULT_INT8) if pack == "int8" else [], "board_ram_gb": ram,
            "warm": warm, "vae_stays_up": vae_up, "policy": e.policy.name, "shards": n, "cuts": dict(cuts),
            "encode_s": round(p.encode_s, 1), "denoise_s": round(p.denoise_s, 1),
            "decode_npu_s": round(p.decode_npu_s, 1), "job_s": round(p.job_npu_vae_s, 1), "label": LABEL}


def table(rams=(8, 16)) -> list:
    return [row(size, pack, ram, shape, warm) for shape in SHAPES for size in SIZES for pack in ("fp16", "int8")
            for ram in rams for warm in (False, True)]


def format_row(r: dict) -> str:
    up = "VAE up" if r["vae_stays_up"] else "VAE loads"
    return (f"{r['shape']:<25} {r['size']:>9} {r['pack']:>4} {r['board_ram_gb']:>3} GB "
            f"{'warm' if r['warm'] else 'cold':<4} {r['job_s']:>8.1f} {r['encode_s']:>6.1f} {r['denoise_s']:>8.1f} "
            f"{r['decode_npu_s']:>6.1f}  {r['policy']} (shards {r['shards']}), {up}  [{LABEL}]")


HEADER = (f"{'shape':<25} {'size':>9} {'pack':>4} {'RAM':>6} {'job':<4} {'job s':>8} {'enc s':>6} {'denoise s':>8} "
          f"{'VAE s':>6}  auto's choice  [{LABEL}: every figure]")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--board-ram", default="8,16", help="board RAM in GB: 8, 16, 32 or a comma list (default 8,16)")
    ap.add_argument("--json", default=str(OUT), help=f"where the rows go (default {OUT.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    try:
        rams = [int(v) for v in args.board_ram.split(",")]
        if any(r not in BOARD_RAMS_GB for r in rams):
            raise ValueError
    except ValueError:
        print(f"bench/job_shapes.py: --board-ram {args.board_ram}: choose from {BOARD_RAMS_GB}", file=sys.stderr)
        return 2
    rows = table(rams)
    print(HEADER)
    for r in rows:
        print(format_row(r))
    print(f"sources: {SOURCES}  [{LABEL}]")
    from models.base.durable import atomic_write
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, (json.dumps({"label": LABEL, "sources": SOURCES, "rows": rows}, indent=1) + "\n").encode())
    print(f"json: {out}  [{LABEL}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
