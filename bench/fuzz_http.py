"""Fuzz the HTTP front of a running tiny pipeline (tests/pipeline_harness.py: supervisord and the real programs) with
the shapes issue 30 found: ComfyUI graphs that loop (a node feeding itself, loaders feeding each other, a LoraLoader
whose clip is its own output), deep chains of loaders, wide fan-out, dangling links, mutated graphs; and hostile LoRA
files through every way in (a graph's LoraLoader, the page's prompt.json `loras`, A1111's `<lora:...>` tags): huge
header lengths and headers, many keys, trailing bytes (an 8 GB sparse file), NaN/Inf weights, absurd ranks (sparse
files at rank 2^20), bad dtypes, cut files, link loops, links out, names too long; and (issue 45, bench/fuzz_inputs.py)
init images thin, huge, bombs and of odd modes under every resize_mode, and the schedule's bounds (a tiny denoise,
steps past the limits, hires denoise/steps) through prompt.json, the graph and A1111.

    .venv/bin/python bench/fuzz_http.py --requests 10000            # a fresh state in bench/out/fuzz_http.json
    .venv/bin/python bench/fuzz_http.py --only inputs --max-s 3600 --resume bench/fuzz_state.json   # adds to it

Cases are distinct and numbered per kind (bench/fuzz_cases.py): --resume continues the kinds' sequences where the
state left them, adding the cases, outcomes, failures and peaks of this run, until each kind has --target (100,000).
Every request must be answered (a hang is no answer within --timeout s), never with a 5xx, and no program of the
pipeline may die or be restarted (its supervisord pid changes) or pass --max-rss-mb of peak memory (VmHWM), looked at
every 15 s (bench/fuzz_run.py). Jobs a request queues are cancelled at once: by design (bench/fuzz_live.FUZZ_TOML)
none gets past encoding (an A1111 call waits for its job's failure; the front looks every 0.05 s, HTTP_POLL_S), and
each is seen to end cleanly (its job.json once the queue settled: bench/fuzz_run.check_ends). Exit status 1 on any
hang, 5xx, traceback in an answer, job's bad end, stage death or memory peak in the state (this run or an earlier
one) not marked fixed: a failure fixed since stays in the state's history, marked with the commit and its regression
test (bench/fuzz_cases.py says how the cases around it are counted):

    .venv/bin/python bench/fuzz_http.py --resume bench/fuzz_state.json --mark-fixed 2 over_memory b867376 \
        tests/test_image_budget.py
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # bench.*, tests.* when run as a script

from bench.fuzz_cases import FAILURES, TARGET, FuzzState  # noqa: E402
from bench.fuzz_inputs import InputRequests, input_images, upload  # noqa: E402
from bench.fuzz_live import FUZZ_TOML, settle_jobs  # noqa: E402
from bench.fuzz_run import MAX_RSS_MB, WORKERS, check_ends, fuzz, report  # noqa: E402
from models.lora.synth import lora_entries, write_lora  # noqa: E402
from models.base.safetensors_io import TensorEntry, write_safetensors  # noqa: E402
from tests.fuzzing import json_variant  # noqa: E402
from tests.comfy_graphs import standard_graph  # noqa: E402

LORA_PACK = (128, 96)                                            # the LoRA-ready pack's size (rank LORA_RANK)
LORA_RANK = 8
# the front looks at followed jobs every 0.05 s (its least poll_s; the harness's 0.2): an A1111 call answers when
# the front sees its job ended, and the fuzz's jobs end within ~0.1 s of their start, so that wait was most of an
# accepted A1111 case's time. What the answers are checked for is the same.
HTTP_POLL_S = 0.05
FAMILIES = ("graphs", "loras", "inputs")                         # --only: graph shapes, LoRA files, images/bounds
SHAPES = ("self_link", "loader_cycle", "clip_self", "long_cycle", "deep_chain", "fan_out", "dangling", "bad_slot",
          "mutated", "plain")                                    # the graphs family's kinds, comfy_<shape>
KIND_FAMILY = {**{"comfy_" + s: "graphs" for s in SHAPES}, "comfy_lora": "loras", "page_lora": "loras",
               "a1111_lora": "loras", **{k: "inputs" for k in InputRequests.KINDS}}


# ---- hostile LoRA files ----------------------------------------------------------------------------------------------
def _header_file(path: Path, tensors: dict, data_bytes: int | None = None, prefix: bytes | None = None) -> None:
    """A safetensors header declaring `tensors` {name: (dtype, shape, nbytes)}, the data a hole (a sparse file of the
    declared size, or `data_bytes`): what a 4 KB file can claim."""
    header, off = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(prefix if prefix is not None else struct.pack("<Q", len(blob)))
        f.write(blob)
    os.truncate(path, 8 + len(blob) + (off if data_bytes is None else data_bytes))


def _non_finite(path: Path, groups: tuple, value: float) -> None:
    entries = lora_entries("tiny", 9, "kohya", rank=4, alpha=2.0, groups=groups, dtype="F32")
    e = next(e for e in entries if e.name.endswith(".lora_up.weight"))
    bad = np.array(e.data(), np.float32)
    bad.flat[::7] = value
    entries[entries.index(e)] = TensorEntry(e.name, e.dtype, e.shape, bad)
    write_safetensors(path, entries)


def hostile_loras(loras: Path, outside: Path) -> dict:
    """Write the files under `loras`; -> {name: refused at submit (True) or only when the job applies it}."""
    loras.mkdir(parents=True, exist_ok=True)
    q = "lora_unet_blocks_0_self_attn_q_proj"
    host = "lora_unet_final_layer_linear"
    write_lora("tiny", 1, loras / "ok.safetensors", "kohya", rank=4, alpha=2.0, groups=("host", "adapter", "te"))
    write_lora("tiny", 2, loras / "branch.safetensors", "comfy", rank=4, groups=("blocks",))
    _non_finite(loras / "nan_branch.safetensors", ("blocks",), np.nan)
    _non_finite(loras / "inf_host.safetensors", ("host",), np.inf)
    _non_finite(loras / "nan_te.safetensors", ("te",), np.nan)
    r = 2**20
    _header_file(loras / "rank_host.safetensors", {f"{host}.lora_up.weight": ("F16", (64, r), 64 * r * 2),
                                                   f"{host}.lora_down.weight": ("F16", (r, 256), r * 256 * 2)})
    _header_file(loras / "rank_branch.safetensors", {f"{q}.lora_up.weight": ("F16", (256, r), 256 * r * 2),
                                                     f"{q}.lora_down.weight": ("F16", (r, 256), r * 256 * 2)})
    _header_file(loras / "dtype_i32.safetensors", {f"{q}.lora_up.weight": ("I32", (256, 4), 4096),
                                                   f"{q}.lora_down.weight": ("I32", (4, 256), 4096)})
    _header_file(loras / "dtype_f8.safetensors", {f"{q}.lora_up.weight": ("F8_E4M3", (256, 4), 1024),
                                                  f"{q}.lora_down.weight": ("F8_E4M3", (4, 256), 1024)})
    _header_file(loras / "dtype_odd.safetensors", {f"{q}.lora_up.weight": ("Q4_K", (256, 4), 512),
                                                   f"{q}.lora_down.weight": ("Q4_K", (4, 256), 512)})
    _header_file(loras / "many_keys.safetensors", {f"k{i}.alpha": ("F32", (), 4) for i in range(20_000)})
    _header_file(loras / "header_len.safetensors", {}, 0, prefix=struct.pack("<Q", 2**62))
    big = {"__metadata__": {"ss_tag_frequency": "x" * (12 * 2**20)}}
    (loras / "header_12mb.safetensors").write_bytes(struct.pack("<Q", len(json.dumps(big))) + json.dumps(big).encode())
    deep = b"[" * 200_000 + b"]" * 200_000
    (loras / "header_deep.safetensors").write_bytes(struct.pack("<Q", len(deep)) + deep)
    shutil.copyfile(loras / "ok.safetensors", loras / "trailing.safetensors")
    os.truncate(loras / "trailing.safetensors", 8 * 2**30)                 # 8 GB, a hole after the last tensor
    good = (loras / "ok.safetensors").read_bytes()
    (loras / "cut.safetensors").write_bytes(good[:len(good) // 2])
    outside.write_bytes(good)
    (loras / "out.safetensors").symlink_to(outside)
    (loras / "loop.safetensors").symlink_to(loras / "loop.safetensors")
    return {"ok.safetensors": False, "branch.safetensors": False, "nan_branch.safetensors": False,
            "inf_host.safetensors": False, "nan_te.safetensors": False, **{n: True for n in (
                "rank_host.safetensors", "rank_branch.safetensors", "dtype_i32.safetensors", "dtype_f8.safetensors",
                "dtype_odd.safetensors", "many_keys.safetensors", "header_len.safetensors",
                "header_12mb.safetensors", "header_deep.safetensors", "trailing.safetensors", "cut.safetensors",
                "out.safetensors", "loop.safetensors", "a" * 250, "b/" * 120 + "c.safetensors", "../ok.safetensors",
                "/etc/passwd", "missing.safetensors")}}


# ---- requests --------------------------------------------------------------------------------------------------------
class Requests:
    """Generators of (kind, method, path, JSON text) against one pipeline's names; `makers()` gives one per kind, each
    drawing from the Random a case brings (bench/fuzz_cases.py)."""

    def __init__(self, names: dict, loras: dict):
        self.rng, self.names, self.loras = random.Random(0), names, loras
        self.refused = [n for n, r in loras.items() if r]

    def _graph(self, height: int = 128) -> dict:
        return standard_graph(seed=1, steps=1, height=height, names=self.names)   # fixed: cases differ elsewhere

    def _loader(self, g: dict, node: str, name: str, model_from: str, clip: bool) -> None:
        s = self.rng.choice([0.8, -1.0, 0.0, 100.0, 1e9, -101])
        inputs = {"lora_name": name, "strength_model": s, "model": [model_from, 0]}
        if clip:
            inputs.update(strength_clip=self.rng.choice([1.0, 0.0, float("inf") if self.rng.random() < .1 else 2]),
                          clip=["11", 0])
        g[node] = {"inputs": inputs, "class_type": "LoraLoader" if clip else "LoraLoaderModelOnly"}

    def comfy_shape(self, shape: str) -> tuple:
        rng, g = self.rng, self._graph()
        if shape == "self_link":
            g["15"]["inputs"]["model"] = ["15", 0]
        elif shape in ("loader_cycle", "long_cycle"):
            n = 2 if shape == "loader_cycle" else rng.randrange(3, 400)
            for i in range(n):
                self._loader(g, str(100 + i), "ok.safetensors", str(100 + (i + 1) % n), clip=False)
            g["15"]["inputs"]["model"] = ["100", 0]
        elif shape == "clip_self":
            self._loader(g, "20", "ok.safetensors", "12", clip=True)
            g["20"]["inputs"]["clip"] = ["20", 1]
            g["6"]["inputs"]["clip"] = ["20", 1]
        elif shape == "deep_chain":
            n = rng.choice([10, 100, 1000, 5000, 20000])
            prev = "12"
            for i in range(n):
                self._loader(g, str(100 + i), "ok.safetensors", prev, clip=False)
                prev = str(100 + i)
            g["15"]["inputs"]["model"] = [prev, 0]
        elif shape == "fan_out":
            for i in range(rng.choice([10, 500, 5000])):
                g[str(100 + i)] = {"inputs": {"text": "x", "clip": ["11", 0]}, "class_type": "CLIPTextEncode"}
        elif shape == "dangling":
            g["3"]["inputs"]["positive"] = [rng.choice(["999", "", "3", "x" * 300]), 0]
        elif shape == "bad_slot":
            g["3"]["inputs"]["model"] = ["15", rng.choice([1, -1, 2**70, "0", None, 0.5])]
        elif shape == "mutated":
            node = rng.choice(sorted(g))
            return "comfy_" + shape, "POST", "prompt", self._with_node(g, node, rng)
        return "comfy_" + shape, "POST", "prompt", json.dumps({"prompt": g})

    def _with_node(self, g: dict, node: str, rng: random.Random) -> str:
        """The graph as JSON with one node's inputs replaced by a mutated JSON object."""
        rest = {k: v for k, v in g.items() if k != node}
        mutated = '{"inputs": ' + json_variant(g[node]["inputs"], rng) + ', "class_type": ' + \
            json.dumps(g[node]["class_type"]) + "}"
        return '{"prompt": ' + json.dumps(rest)[:-1] + ", " + json.dumps(node) + ": " + mutated + "}}"

    def comfy_lora(self) -> tuple:
        g = self._graph(height=self.rng.choice([128, LORA_PACK[1]]))
        names = list(self.loras)
        self._loader(g, "20", self.rng.choice(names), "12", clip=True)
        last = "20"
        if self.rng.random() < 0.5:
            self._loader(g, "21", self.rng.choice(names), "20", clip=False)
            last = "21"
        g["15"]["inputs"]["model"] = [last, 0]
        for node in ("6", "7"):
            g[node]["inputs"]["clip"] = ["20", 1]
        return "comfy_lora", "POST", "prompt", json.dumps({"prompt": g})

    def page_lora(self) -> tuple:
        rng = self.rng
        loras = [{"name": rng.choice(list(self.loras)), "strength": rng.choice([0.7, 1.0, -2.0])}
                 for _ in range(rng.randrange(1, 4))]
        body = {"prompt": "fuzz", "seed": 1, "steps": 1, "height": rng.choice([128, LORA_PACK[1]]),
                "loras": loras}
        if rng.random() < 0.3:                                  # an odd entry: fields the schema must refuse
            rest = {k: v for k, v in body.items() if k != "loras"}
            return "page_lora_odd", "POST", "anima/jobs", \
                json.dumps(rest)[:-1] + ', "loras": [' + json_variant(loras[0], rng) + "]}"
        return "page_lora", "POST", "anima/jobs", json.dumps(body)

    def a1111_lora(self) -> tuple:
        name = self.rng.choice(self.refused).removesuffix(".safetensors")    # refused at submit: no job to wait for
        body = {"prompt": f"1girl <lora:{name}:{self.rng.choice([0.8, 1, -1])}>", "steps": 1, "width": 128,
                "height": 128, "seed": 1}
        return "a1111_lora", "POST", "sdapi/v1/txt2img", json.dumps(body)

    def makers(self) -> dict:
        """{kind: f(rng) -> (method, path, text)} of the graph and LoRA families (KIND_FAMILY)."""
        def maker(f, *args):
            def make(rng: random.Random) -> tuple:
                self.rng = rng
                return f(*args)[1:]
            return make
        out = {"comfy_" + shape: maker(self.comfy_shape, shape) for shape in SHAPES}
        out.update(comfy_lora=maker(self.comfy_lora), page_lora=maker(self.page_lora),
                   a1111_lora=maker(self.a1111_lora))
        return out


# ---- the run ---------------------------------------------------------------------------------------------------------
def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(n: int, seed: int, timeout_s: float, out: Path, keep: bool, families=FAMILIES,
        max_rss_mb: int = MAX_RSS_MB, max_s: float | None = None, daemon_timeout_s: float | None = None,
        workers: int = WORKERS, resume: bool = False, target: int = TARGET) -> bool:
    from models.setup.models_dir import resolve_models
    from models.packs.pack import build_pack
    from tests.pipeline_harness import Pipeline, tiny_assets
    signal.signal(signal.SIGTERM, _interrupt)      # the cases so far reported and saved, then the pipeline stopped
    signal.signal(signal.SIGINT, _interrupt)
    state = FuzzState.load(out if resume else None, seed, target)
    # keys before the first table header land in the harness's last table, [stage.http]
    extra = (f"request_timeout_s = {daemon_timeout_s}\n" if daemon_timeout_s else "") + FUZZ_TOML
    cache = Path(tempfile.mkdtemp(prefix="anima-fuzz-http-"))
    try:
        models, pack = tiny_assets(cache)
        loras = hostile_loras(models / "loras", cache / "outside.safetensors")
        lora_pack = build_pack(resolve_models(models, {}, need=("dit",)).dit, cache / "pack-lora", LORA_PACK, "fp16",
                               lora_rank=LORA_RANK)
        with Pipeline.start(models, pack, threads=1, extra_toml=extra, keep=keep, packs=(lora_pack,),
                            http_poll_s=HTTP_POLL_S) as pipe:
            url = pipe.http_url()
            secrets = tuple({str(models / "loras"), str((models / "loras").resolve()), str(cache / "outside")})
            makers, jobs = _makers(url, loras, timeout_s, families), {}
            r = fuzz(pipe, url, state, makers, n, timeout_s, secrets, workers, max_s, max_rss_mb,
                     save=lambda: state.save(out), jobs=jobs)
            settle_jobs(pipe)
            ends = check_ends(pipe.rf.jobs, jobs, state)
            state.save(out)
            return report(state, r, out, max_rss_mb, ends)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _makers(url: str, loras: dict, timeout_s: float, families) -> dict:
    info = requests.get(url + "object_info", timeout=60).json()
    names = {k: info[node]["input"]["required"][f"{k}_name"][0][0]
             for k, node in (("unet", "UNETLoader"), ("clip", "CLIPLoader"), ("vae", "VAELoader"))}
    gen = Requests(names, loras)
    makers = gen.makers()
    if "inputs" in families:
        images = input_images()
        inputs = InputRequests(gen._graph, images, upload(url, images, timeout_s))
        makers.update({k: getattr(inputs, k) for k in InputRequests.KINDS})
    return {k: f for k, f in makers.items() if KIND_FAMILY[k] in families}


def mark_fixed(path: Path | None, seed: int, run: str, what: str, commit: str, test: str) -> int:
    """--mark-fixed: the state's failures marked (bench/fuzz_cases.FuzzState.mark_fixed), the summary printed."""
    if path is None or not path.exists() or not run.isdigit() or what not in FAILURES:
        print(f"--mark-fixed needs --resume STATE.json (an existing one), a run number and one of {FAILURES}",
              file=sys.stderr)
        return 2
    state = FuzzState.load(path, seed)
    try:
        n = state.mark_fixed(int(run), what, commit, test)
    except ValueError as e:
        print(f"--mark-fixed: {e}", file=sys.stderr)
        return 2
    state.save(path)
    print(f"{n} {what} failure(s) of run {run} marked fixed by {commit} ({test}): {path}")
    for line in state.summary():
        print(line)
    print("ok" if state.ok() else "FAILED")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000, help="distinct cases to send in this run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds without an answer that make a hang")
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "out" / "fuzz_http.json",
                        help="where the state is written (a fresh one, unless --resume)")
    parser.add_argument("--resume", type=Path, default=None, metavar="STATE.json",
                        help="continue the state in this file (created when missing) and save it there")
    parser.add_argument("--target", type=int, default=TARGET, help="distinct cases per kind to reach over all runs")
    parser.add_argument("--workers", type=int, default=WORKERS, help="requests in flight")
    parser.add_argument("--keep", action="store_true", help="keep the pipeline's run folder (logs)")
    parser.add_argument("--only", nargs="+", choices=FAMILIES, default=list(FAMILIES),
                        help="request families: graph shapes, LoRA files, init images and schedule bounds")
    parser.add_argument("--max-rss-mb", type=int, default=MAX_RSS_MB, help="a program's allowed peak RSS (MB)")
    parser.add_argument("--max-s", type=float, default=None,
                        help="stop sending after this many seconds (the summary counts the cases sent)")
    parser.add_argument("--mark-fixed", nargs=4, metavar=("RUN", "WHAT", "COMMIT", "TEST"), default=None,
                        help="mark the --resume state's failures WHAT of run RUN fixed by COMMIT (its regression test "
                             "TEST), save it and exit: they stay in its history and no longer fail it")
    parser.add_argument("--daemon-timeout", type=float, default=None,
                        help="the front's [stage.http] request_timeout_s (default its own, 5 s): on a starved machine "
                             "a silent daemon is a 503 after it")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.timeout <= 0 or (args.max_s is not None and args.max_s <= 0) \
            or (args.daemon_timeout is not None and not 0.1 <= args.daemon_timeout <= 120) \
            or not 1 <= args.workers <= 64 or args.target < 1:
        parser.error("--requests and --target must be >= 1, --timeout and --max-s > 0, --daemon-timeout in "
                     "[0.1, 120], --workers in [1, 64]")
    out = args.resume or args.json
    if args.mark_fixed:
        return mark_fixed(args.resume, args.seed, *args.mark_fixed)
    return 0 if run(args.requests, args.seed, args.timeout, out, args.keep, tuple(args.only), args.max_rss_mb,
                    args.max_s, args.daemon_timeout, args.workers, args.resume is not None, args.target) else 1


if __name__ == "__main__":
    sys.exit(main())
