"""Text encoder, torch vs ONNX Runtime, side by side at full size (synthetic Qwen3-0.6B-Base + the official LLM-adapter
shapes); and the size of the board venv vs the host venv.

    nice -n 10 .venv/bin/python bench/bench_encoder_backends.py [--threads 2] [--cache ~/.cache/anima-npu]
        [--venvs .venv .venv-board] [--json bench/out/encoder_backends.json]

Not a test. Files as in bench/bench_text.py (written once into --cache), the encoder pack exported once from them
(`anima-models export-encoder`). Each backend runs in its own process, one after the other: runtime import, load
(tokenizers + Qwen3 + adapter), the first encode of a prompt pair, a warm single encode, peak RSS (ru_maxrss of that
process). Then: same token ids, cosine and max |Δ| of the contexts (the mark: cos >= 0.99999). Sizes are `du -sm`.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_text import NEGATIVE, PROMPT, ensure_files  # noqa: E402

PROMPTS = [PROMPT, NEGATIVE, "", "(masterpiece:1.3), 1girl, " * 20]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args) -> int:
    """One backend in this process; writes {timings, ids} JSON and the contexts (npz) to --out."""
    import numpy as np
    files = json.loads(args.files)
    t0 = time.perf_counter()
    if args.worker == "export":
        from models.text.encoder_pack import build_encoder_pack
        build_encoder_pack(files["te"], files["adapter"], files["tok"] + "/qwen", files["tok"] + "/t5", args.out,
                           overwrite=True)
        print(json.dumps({"export_s": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}))
        return 0
    if args.worker == "torch":
        import torch  # noqa: F401
        import transformers  # noqa: F401
    else:
        import onnxruntime  # noqa: F401
    import_s = time.perf_counter() - t0
    from models.text.conditioning import TextEncoder
    t1 = time.perf_counter()
    if args.worker == "torch":
        enc = TextEncoder.from_files(files["te"], files["adapter"], files["tok"] + "/qwen", files["tok"] + "/t5",
                                     threads=args.threads)
        check_s = 0.0
    else:
        from models.text.encoder_pack import load_encoder_pack
        load_encoder_pack(files["pack"], check=True)             # every file's sha256, as the stage does
        check_s = time.perf_counter() - t1
        enc = TextEncoder.from_pack(files["pack"], threads=args.threads, check=False)
    load_s = time.perf_counter() - t1
    rss_load = peak_rss_mb()
    t2 = time.perf_counter()
    enc.encode_pair(PROMPT, NEGATIVE)
    pair_s = time.perf_counter() - t2
    t3 = time.perf_counter()
    enc.encode(PROMPT)
    warm_s = time.perf_counter() - t3
    ctx = {f"p{i}": enc.encode(p) for i, p in enumerate(PROMPTS)}
    ids = {f"p{i}": [enc.tokenize(p).qwen_ids, enc.tokenize(p).t5_ids] for i, p in enumerate(PROMPTS)}
    np.savez(args.out + ".npz", **ctx)
    print(json.dumps({"import_s": import_s, "load_s": load_s, "hash_check_s": check_s, "encode_pair_first_s": pair_s,
                      "encode_one_warm_s": warm_s,
                      "peak_rss_after_load_mb": rss_load, "peak_rss_mb": peak_rss_mb(), "ids": ids}))
    return 0


def child(kind: str, files: dict, threads: int, out: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--files", json.dumps(files), "--threads", str(threads),
           "--out", out]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{r.stderr[-4000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = time.perf_counter() - t0
    return res


def du_mb(path: str):
    p = Path(path)
    if not p.exists():
        return None
    return int(subprocess.run(["du", "-sm", "-L" if p.is_symlink() else "-P", str(p.resolve())], capture_output=True,
                              text=True, check=True).stdout.split()[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/anima-npu"))
    ap.add_argument("--venvs", nargs="*", default=[".venv", ".venv-board"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--fresh-export", action="store_true", help="export the encoder pack again (to time it)")
    ap.add_argument("--worker", choices=("torch", "onnx", "export"), help=argparse.SUPPRESS)
    ap.add_argument("--files", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    import numpy as np
    cache = Path(args.cache)
    files = {k: str(v) for k, v in ensure_files(cache, args.seed).items() if not k.endswith("_s")}
    files["pack"] = str(cache / f"encoder-pack-full-synth-{args.seed}")
    from models.text.encoder_pack import EncoderPackError, load_encoder_pack
    try:
        if args.fresh_export:
            raise EncoderPackError("asked for a fresh export")
        load_encoder_pack(files["pack"], check=False)
        export = {"export_s": None, "peak_rss_mb": None, "note": "exported earlier"}
    except EncoderPackError:
        export = child("export", files, args.threads, files["pack"])
    m = load_encoder_pack(files["pack"], check=False).manifest
    pack_mb = sum(f["bytes"] for f in m["files"]) / 1e6
    out = Path("bench/out")
    out.mkdir(parents=True, exist_ok=True)
    res = {b: child(b, files, args.threads, str(out / f"encoder_{b}")) for b in ("torch", "onnx")}
    ctx = {b: np.load(str(out / f"encoder_{b}.npz")) for b in res}
    cmp = []
    for i, p in enumerate(PROMPTS):
        a, b = ctx["torch"][f"p{i}"].astype(np.float64), ctx["onnx"][f"p{i}"].astype(np.float64)
        cmp.append({"prompt": p[:40], "same_ids": res["torch"]["ids"][f"p{i}"] == res["onnx"]["ids"][f"p{i}"],
                    "t5_tokens": len(res["torch"]["ids"][f"p{i}"][1]),
                    "cos": float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)),
                    "max_abs": float(np.abs(a - b).max()), "max_ref": float(np.abs(a).max())})
    for r in res.values():
        r.pop("ids")
    venvs = {v: du_mb(v) for v in args.venvs}

    print(f"\ntext encoder, full size (Qwen3 28 layers + adapter 6 blocks, FP32), {args.threads} threads, "
          "measured here")
    rows = [("runtime import s", "import_s"), ("load s", "load_s"), ("  of which sha256 check s", "hash_check_s"),
            ("first encode (pair) s", "encode_pair_first_s"),
            ("warm encode (one) s", "encode_one_warm_s"), ("peak RSS after load MB", "peak_rss_after_load_mb"),
            ("peak RSS MB", "peak_rss_mb"), ("process wall s", "process_wall_s")]
    print(f"{'':<26}{'torch':>12}{'onnxruntime':>14}{'onnx/torch':>12}")
    for label, k in rows:
        t, o = res["torch"][k], res["onnx"][k]
        ratio = f"{o / t:>12.2f}" if t else f"{'-':>12}"
        print(f"{label:<26}{t:>12.2f}{o:>14.2f}{ratio}")
    print(f"encoder pack: {pack_mb:.0f} MB on disk; export {export['export_s'] or 0:.1f} s, peak RSS "
          f"{export['peak_rss_mb'] or 0:.0f} MB {export.get('note', '')}")
    for c in cmp:
        print(f"  {c['prompt']!r:<44} ids equal {c['same_ids']}  T5 {c['t5_tokens']:>3}  cos {c['cos']:.9f}  "
              f"max|d| {c['max_abs']:.2e} (max {c['max_ref']:.2f})")
    ok = all(c["same_ids"] and c["cos"] >= 0.99999 for c in cmp)
    print(f"conditioning equal (ids and cos >= 0.99999): {ok}")
    print("venv sizes (du -sm): " + ", ".join(f"{k} {v} MB" if v is not None else f"{k} absent"
                                               for k, v in venvs.items()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"threads": args.threads, "backends": res, "export": export,
                                               "pack_mb": pack_mb, "compare": cmp, "ok": ok, "venv_mb": venvs},
                                              indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
