"""`anima-models compile PACK --target rk3588`: a DiT pack's branch ONNX (or a VAE pack's trunk and tile) -> RKNN with
rknn-toolkit2 (worker subprocesses)."""
from __future__ import annotations

import json
import logging

from models.base.durable import atomic_write

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("pack", help="pack folder (made by `anima-models pack` or `anima-models pack-vae`)")
    p.add_argument("--target", default="rk3588", help="NPU platform (default rk3588)")
    p.add_argument("--jobs", type=int, default=1, help="branches compiled in parallel (each a process; ~0.5-2 GB "
                   "RSS per full-size branch)")
    p.add_argument("--toolkit-venv", default=None, help="rknn-toolkit2 environment (default $ANIMA_RKNN_VENV, else "
                   "a checkout's .venv-rknn, else .venv-rknn beside this environment); create it with `make rknn-venv`")
    p.add_argument("--blocks", default=None, help="DiT packs: only these blocks, e.g. 0,3,5-7 (default all)")
    p.add_argument("--per-worker", type=int, default=1, help="branches one worker process builds before it is "
                   "replaced (1: a process per branch, bounded memory; 0: no limit, saves the toolkit import)")
    p.add_argument("--force", action="store_true", help="rebuild branches that are up to date")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")


def run(args) -> int:
    from models.dit.partition import parse_blocks
    from models.rknn.compile import _read_manifest, compile_pack, describe
    from pathlib import Path

    if args.per_worker < 0:
        raise ValueError(f"--per-worker {args.per_worker}: must be 0 (no limit) or positive")
    blocks = None
    if args.blocks is not None:
        config = _read_manifest(Path(args.pack)).get("config") or {}
        if "blocks" not in config:
            raise ValueError(f"--blocks: {args.pack} is not a DiT pack (a VAE pack compiles its trunk and tile whole)")
        n = int(config["blocks"])
        blocks = parse_blocks(args.blocks, n)
    report = compile_pack(args.pack, target=args.target, jobs=args.jobs, venv=args.toolkit_venv, blocks=blocks,
                          per_worker=args.per_worker, force=args.force)
    print(describe(report))
    if args.json:
        atomic_write(args.json, json.dumps(report, indent=1) + "\n")
    return 1 if report["failed"] else 0
