"""Text-encoder benchmark at full size (synthetic Qwen3-0.6B-Base shapes + the official LLM-adapter shapes): load time,
encode time for a prompt pair, peak RSS.

    .venv/bin/python bench/bench_text.py [--threads 2] [--cache ~/.cache/anima-npu] [--json bench/out/text.json]

Not a test. The 1.19 GB text encoder and an adapter-only DiT file (the `net.llm_adapter.*` tensors of the full preset,
all the encoder reads) are synthesized once into --cache; the tokenizers are the tiny trained ones (their size does not
change the model's cost).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import time
from pathlib import Path

log = logging.getLogger("bench_text")
PROMPT = ("masterpiece, best quality, 1girl, solo, (long silver hair:1.2), blue eyes, school uniform, "
          "cherry blossoms, outdoors, looking at viewer, smile, upper body, highly detailed background")
NEGATIVE = "lowres, bad anatomy, worst quality"


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2


def rss_now() -> dict:
    """Current VmRSS / RssAnon / RssFile in GB (Linux): file-backed pages are the mmap'd checkpoint, reclaimable."""
    from models.runtime.probes import status_kb
    return {k: round(v / 1024 ** 2, 2) for k, v in status_kb().items() if k in ("VmRSS", "RssAnon", "RssFile")}


def ensure_files(cache: Path, seed: int) -> dict:
    from models.base.safetensors_io import write_safetensors
    from models.dit.synth import dit_entries
    from models.text.synth import write_te, write_tokenizers
    cache.mkdir(parents=True, exist_ok=True)
    te = cache / f"qwen3-te-full-synth-{seed}.safetensors"
    adapter = cache / f"anima-adapter-only-full-synth-{seed}.safetensors"
    tok = cache / "tokenizers-tiny"
    times = {}
    if not te.exists():
        t0 = time.perf_counter()
        write_te("full", seed, te)
        times["write_te_s"] = time.perf_counter() - t0
    if not adapter.exists():
        t0 = time.perf_counter()
        write_safetensors(adapter, [e for e in dit_entries("full", seed) if e.name.startswith("net.llm_adapter.")])
        times["write_adapter_s"] = time.perf_counter() - t0
    if not (tok / "t5" / "tokenizer.json").exists():
        write_tokenizers("tiny", tok)
    return dict(te=te, adapter=adapter, tok=tok, **times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/anima-npu"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    files = ensure_files(Path(args.cache), args.seed)
    import torch  # noqa: F401  (imported before timing: import cost is not load cost)
    import transformers  # noqa: F401
    from models.text.conditioning import TextEncoder
    rss0 = rss_gb()
    t0 = time.perf_counter()
    enc = TextEncoder.from_files(str(files["te"]), str(files["adapter"]), str(files["tok"] / "qwen"),
                                 str(files["tok"] / "t5"), threads=args.threads)
    load_s = time.perf_counter() - t0
    rss_load = rss_gb()
    now_load = rss_now()
    tp = enc.tokenize(PROMPT)
    t1 = time.perf_counter()
    cond, uncond = enc.encode_pair(PROMPT, NEGATIVE)
    pair_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    enc.encode(PROMPT)
    single_s = time.perf_counter() - t2
    enc.close()
    res = {"threads": args.threads, "load_s": round(load_s, 2), "encode_pair_s": round(pair_s, 2),
           "encode_one_warm_s": round(single_s, 2), "qwen_tokens": len(tp.qwen_ids), "t5_tokens": len(tp.t5_ids),
           "context": list(cond.shape), "peak_rss_gb_before_load": round(rss0, 2),
           "peak_rss_gb_after_load": round(rss_load, 2),
           "rss_gb_after_load": now_load, "peak_rss_gb_end": round(rss_gb(), 2),
           **{k: round(v, 1) for k, v in files.items() if k.endswith("_s")}}
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
