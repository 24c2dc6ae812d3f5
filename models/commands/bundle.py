"""`anima-models bundle`: everything a board runs, from a ComfyUI-style models folder, in one folder to copy.

    anima-models bundle --models MODELS --resolution 1024x1024,896x1152,1152x896 --target rk3588 --out BUNDLE
    anima-models bundle --models MODELS --resolution 1024x1024 --target rk3588 --out BUNDLE --sampling turbo --shards 3

Per size an FP16 DiT pack and a VAE pack, compiled for the target with rknn-toolkit2 (their ONNX graphs then removed:
the board reads only the .rknn files), the text encoder for ONNX Runtime with its tokenizers, and bundle.json (paths,
sizes, hashes, the toolkit release the board's runtime must match; models/setup/bundle.py). `--shards N`: every DiT pack
also as N shard graphs per branch, compiled too (as `anima-models pack --shards`; what `--policy auto` prices). `--target none`: a CPU bundle
(ONNX Runtime everywhere). Run it again after an interruption: complete parts are kept.
"""
from __future__ import annotations

import shlex

from models.setup.models_dir import add_model_arguments
from models.dit.partition import MAX_LORA_RANK, parse_resolution


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--resolution", action="append", required=True, metavar="WxH",
                   help="image WIDTHxHEIGHT (multiples of 8); more sizes as a comma list or repeated (the first "
                        "is the default)")
    p.add_argument("--target", required=True, choices=("rk3588", "none"),
                   help="rk3588: compiled for the NPU with rknn-toolkit2; none: ONNX Runtime on a CPU")
    p.add_argument("--out", required=True, metavar="BUNDLE", help="bundle folder to write (or complete)")
    p.add_argument("--toolkit-venv", default=None, help="rknn-toolkit2 environment (default $ANIMA_RKNN_VENV, else "
                   "a checkout's .venv-rknn, else .venv-rknn beside this environment); create it with `make rknn-venv`")
    p.add_argument("--jobs", type=int, default=1, help="models compiled in parallel (each a process, ~0.5-2 GB RSS)")
    p.add_argument("--per-worker", type=int, default=1, help="models one compiler process builds before it is "
                   "replaced (1: bounded memory; 0: no limit, saves the toolkit's import)")
    p.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help=f"LoRA-ready DiT packs: LoRAs up to a stacked rank R are chosen per job (0..{MAX_LORA_RANK}; "
                        "default 0; as `anima-models pack --lora-rank`, docs/lora.md)")
    p.add_argument("--lora", action="append", default=[], metavar="FILE:STRENGTH",
                   help="bake a LoRA into every DiT pack of the bundle (repeatable; strength default 1.0) as "
                        "`anima-models pack --lora` does: no run-time cost; recorded in bundle.json")
    p.add_argument("--shards", type=int, default=1, metavar="N",
                   help="every DiT pack of the bundle also as N shard graphs per branch (1-3), compiled too, run on "
                        "N NPU cores at once by the `shards` policy, as `anima-models pack --shards` (docs/board.md "
                        "section 9; default 1); not with --lora-rank")
    from models.packs.sampling import add_sampling_arguments
    add_sampling_arguments(p)
    p.add_argument("--overwrite", action="store_true", help="replace parts built from other model files, and "
                   "remove the sizes already in the bundle that are not asked for (without it they are kept)")


def run(args) -> int:
    from models.setup.bundle import build_bundle, total_bytes
    from models.commands import UserError
    from models.setup.models_dir import PART_NAMES
    from models.commands.progress import Progress

    from models.lora import parse_lora_arg
    sizes = [parse_resolution(r) for given in args.resolution for r in given.split(",")]
    try:
        loras = [parse_lora_arg(a) for a in args.lora]
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.jobs < 1:
        raise UserError(f"--jobs {args.jobs}: must be 1 or more")
    if not 0 <= args.lora_rank <= MAX_LORA_RANK:
        raise UserError(f"--lora-rank {args.lora_rank}: must be in 0..{MAX_LORA_RANK}")
    if args.per_worker < 0:
        raise UserError(f"--per-worker {args.per_worker}: must be 0 (no limit) or positive")
    from models.packs.sampling import parse_sampling
    try:
        sampling = parse_sampling(args.sampling, args.sampling_json)
    except ValueError as e:
        raise UserError(str(e)) from None
    overrides = {n: getattr(args, n, None) for n in PART_NAMES}
    progress = Progress(2 * len(dict.fromkeys(sizes)) + 1)
    data = build_bundle(args.models, sizes, args.target, args.out, toolkit_venv=args.toolkit_venv, jobs=args.jobs,
                        per_worker=args.per_worker, overwrite=args.overwrite, progress=progress, overrides=overrides,
                        lora_rank=args.lora_rank, loras=loras, sampling=sampling,
                        shards=args.shards)
    from pathlib import Path
    out = Path(args.out).expanduser().absolute()
    toolkit = f", rknn-toolkit2 {data['toolkit']}" if data["toolkit"] else ""
    lora = f", LoRA rank {args.lora_rank}" if args.lora_rank else ""
    from models.setup.bundle import baked_label
    lora += f", baked LoRA {baked_label(data['lora'])}" if data.get("lora") else ""
    lora += f", {data['shards']} shards per branch" if data.get("shards", 1) > 1 else ""
    print(f"bundle {out}: {', '.join(data['sizes'])}, target {data['target']}{toolkit}{lora}, "
          f"{total_bytes(data) / 1e6:.1f} MB")
    q = shlex.quote
    if data["target"] == "none":                 # a CPU bundle runs on this machine: nothing to copy
        import os                                # the user's run folder, else one beside the bundle (not a checkout's)
        run = q(os.environ.get("ANIMA_RUN") or str(out.parent / "run"))
        print(f"use it here:           orchestrator --run {run} init --bundle {q(str(out))} && "
              f"orchestrator --run {run} doctor")
        return 0
    print(f"copy it to the board:  rsync -a --delete {q(str(out))}/ BOARD:anima/bundle/")
    print("then on the board:     orchestrator --run ~/anima/run init --bundle ~/anima/bundle && "
          "orchestrator --run ~/anima/run doctor")
    return 0
