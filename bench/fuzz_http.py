"""Fuzz the HTTP front of a running tiny pipeline (tests/pipeline_harness.py: supervisord and the real programs) with
the shapes issue 30 found: ComfyUI graphs that loop (a node feeding itself, loaders feeding each other, a LoraLoader
whose clip is its own output), deep chains of loaders, wide fan-out, dangling links, mutated graphs; and hostile LoRA
files through every way in (a graph's LoraLoader, the page's prompt.json `loras`, A1111's `<lora:...>` tags): huge
header lengths and headers, many keys, trailing bytes (an 8 GB sparse file), NaN/Inf weights, absurd ranks (sparse
files at rank 2^20), bad dtypes, cut files, link loops, links out, names too long; and (issue 45, bench/fuzz_inputs.py)
init images thin, huge, bombs and of odd modes under every resize_mode, and the schedule's bounds (a tiny denoise,
steps past the limits, hires denoise/steps) through prompt.json, the graph and A1111.

    .venv/bin/python bench/fuzz_http.py --requests 10000            # table on stdout, JSON in bench/out/
    .venv/bin/python bench/fuzz_http.py --only inputs --requests 100000 # images and schedule bounds alone

Every request must be answered (a hang is no answer within --timeout s), never with a 5xx, and no program of the
pipeline may die or be restarted (its supervisord pid changes) or pass --max-rss-mb of peak memory (VmHWM). Jobs a
request queues are cancelled at once: by design (bench/fuzz_live.FUZZ_TOML) none gets past encoding. Exit status 1 on
any hang, 5xx, traceback in an answer, stage death or memory peak.
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
import time
from collections import Counter
from pathlib import Path

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # bench.*, tests.* when run as a script

from bench.fuzz_inputs import InputRequests, input_images, upload  # noqa: E402
from bench.fuzz_live import FUZZ_TOML, settle_jobs  # noqa: E402
from models.lora.synth import lora_entries, write_lora  # noqa: E402
from models.safetensors_io import TensorEntry, write_safetensors  # noqa: E402
from tests.fuzzing import json_variant  # noqa: E402
from tests.comfy_graphs import standard_graph  # noqa: E402

PROGRAMS = ("orchestrator", "scheduler", "executor", "http")     # always on: a pid change is a death
LORA_PACK = (128, 96)                                            # the LoRA-ready pack's size (rank LORA_RANK)
LORA_RANK = 8
PROBE_EVERY = 200
FAMILIES = ("graphs", "loras", "inputs")                         # --only: graph shapes, LoRA files, images/bounds
FUZZ_ENCODER = "/nonexistent/fuzz/"                              # FUZZ_TOML's text encoder: every job fails there
MAX_RSS_MB = 1000                                                # a program's peak RSS above this fails the run
MAX_EXAMPLES = 8                                                 # first problems kept per kind in the JSON


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
    """Seeded generators of (kind, method, path, JSON text) against one pipeline's names."""

    def __init__(self, rng: random.Random, names: dict, loras: dict):
        self.rng, self.names, self.loras = rng, names, loras
        self.refused = [n for n, r in loras.items() if r]

    def _graph(self, height: int = 128) -> dict:
        return standard_graph(seed=self.rng.randrange(2**32), steps=1, height=height, names=self.names)

    def _loader(self, g: dict, node: str, name: str, model_from: str, clip: bool) -> None:
        s = self.rng.choice([0.8, -1.0, 0.0, 100.0, 1e9, -101])
        inputs = {"lora_name": name, "strength_model": s, "model": [model_from, 0]}
        if clip:
            inputs.update(strength_clip=self.rng.choice([1.0, 0.0, float("inf") if self.rng.random() < .1 else 2]),
                          clip=["11", 0])
        g[node] = {"inputs": inputs, "class_type": "LoraLoader" if clip else "LoraLoaderModelOnly"}

    def comfy_shape(self) -> tuple:
        rng, g = self.rng, self._graph()
        shape = rng.choice(["self_link", "loader_cycle", "clip_self", "long_cycle", "deep_chain", "fan_out",
                            "dangling", "bad_slot", "mutated", "plain"])
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
        body = {"prompt": "fuzz", "seed": rng.randrange(2**32), "steps": 1, "height": rng.choice([128, LORA_PACK[1]]),
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

    def next(self, families=FAMILIES, inputs: InputRequests | None = None) -> tuple:
        pool = [(self.comfy_shape, 4, "graphs"), (self.comfy_lora, 3, "loras"), (self.page_lora, 2, "loras"),
                (self.a1111_lora, 1, "loras")]
        if inputs is not None:
            pool.append((inputs.next, 5, "inputs"))
        pool = [(f, w) for f, w, fam in pool if fam in families]
        return self.rng.choices([f for f, _ in pool], weights=[w for _, w in pool])[0]()


# ---- the run ---------------------------------------------------------------------------------------------------------
class Tally:
    def __init__(self):
        self.by_kind: dict = {}
        self.deaths: list = []
        self.failed_probes = 0
        self.probes = 0
        self.examples: dict = {"5xx": [], "hang": [], "down": [], "leak": [], "traceback": []}
        self.wall_s = 0.0
        self.sent = 0                       # requests sent (fewer than asked when --max-s ran out)
        self.interrupted = False            # stopped by SIGINT/SIGTERM
        self.leaks = 0                      # answers that show the server's loras/ folder or a link's target
        self.peak_rss_mb: dict = {}         # program -> its largest VmHWM seen (MB)
        self.start_rss_mb: dict = {}        # the same before the first request

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        self.by_kind.setdefault(kind, Counter())[outcome] += 1
        for what in ("5xx", "hang", "down", "traceback"):
            if outcome.startswith(what) and len(self.examples[what]) < MAX_EXAMPLES:
                self.examples[what].append(f"{kind}: {detail[:400]}")

    def total(self, outcome_prefix: str) -> int:
        return sum(n for c in self.by_kind.values() for o, n in c.items() if o.startswith(outcome_prefix))


def _pids(pipe) -> dict:
    out = {}
    for name in PROGRAMS:
        info = pipe.sup.info(name)
        out[name] = (info.state, info.pid)
    return out


def _send(url: str, req: tuple, timeout_s: float, tally: Tally, secrets: tuple) -> None:
    kind, method, path, text = req
    try:
        r = requests.request(method, url + path, data=text.encode("utf-8", "surrogatepass"), timeout=timeout_s,
                             headers={"Content-Type": "application/json"})
    except requests.Timeout:
        tally.add(kind, "hang", text[:200])
        return
    except requests.ConnectionError as e:
        tally.add(kind, "down", str(e))
        return
    outcome = str(r.status_code)
    if r.status_code == 500 and FUZZ_ENCODER in r.text and '"JobFailed"' in r.text:
        outcome = "ran"                   # A1111's call waits for its job, which the harness's encoder fails by design
    elif r.status_code >= 500:
        outcome = f"5xx {r.status_code}"
    tally.add(kind, outcome, f"{r.text} <- {text[:300]}" if r.status_code >= 500 else r.text)
    if "Traceback (most recent call last)" in r.text:
        tally.add(kind, "traceback", r.text)
    if any(x in r.text for x in secrets):
        tally.leaks += 1
        if len(tally.examples["leak"]) < MAX_EXAMPLES:
            tally.examples["leak"].append(f"{kind}: {r.text[:400]}")
    if r.status_code == 200:                              # a queued job: cancelled at once (it would never render)
        body = r.json() if r.headers.get("Content-Type", "").startswith("application/json") else {}
        job = body.get("prompt_id") or body.get("job")
        if job:
            try:
                requests.post(url + f"anima/jobs/{job}/cancel", timeout=timeout_s)
            except requests.RequestException as e:
                tally.add("cancel", "down", str(e))


def _peak_rss(pipe, tally: Tally) -> None:
    """Each program's peak resident memory so far (/proc/PID/status VmHWM), the largest kept."""
    for name in PROGRAMS:
        try:
            text = Path(f"/proc/{pipe.sup.info(name).pid}/status").read_text()
        except OSError:
            continue
        kb = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("VmHWM:")), 0)
        tally.peak_rss_mb[name] = max(tally.peak_rss_mb.get(name, 0), kb // 1024)


def _probe(url: str, timeout_s: float, tally: Tally) -> None:
    tally.probes += 1
    try:
        ok = requests.get(url + "system_stats", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        ok = False
    tally.failed_probes += not ok


def _check(pipe, url: str, timeout_s: float, tally: Tally, start: dict, sent: int) -> dict:
    """A probe, the programs' peak memory, and their pids against `start` (a change is a death); -> the pids now."""
    _probe(url, timeout_s, tally)
    _peak_rss(pipe, tally)
    now = _pids(pipe)
    for name in PROGRAMS:
        if now[name] != start[name]:
            tally.deaths.append(f"{name}: {start[name]} -> {now[name]} after request {sent}")
    return now


def fuzz(pipe, url: str, n: int, seed: int, timeout_s: float, loras: dict, secrets: tuple,
         families=FAMILIES, max_s: float | None = None) -> Tally:
    """`n` requests of `families` against the front (fewer when `max_s` seconds pass first: tally.sent says how
    many); pids and peak memory of the programs looked at with every probe; `secrets`: paths no answer may show."""
    info = requests.get(url + "object_info", timeout=60).json()
    names = {k: info[node]["input"]["required"][f"{k}_name"][0][0]
             for k, node in (("unet", "UNETLoader"), ("clip", "CLIPLoader"), ("vae", "VAELoader"))}
    gen, tally = Requests(random.Random(seed), names, loras), Tally()
    inputs = None
    if "inputs" in families:
        images = input_images()
        inputs = InputRequests(random.Random(seed + 1), gen._graph, images, upload(url, images, timeout_s))
    start = _pids(pipe)
    _peak_rss(pipe, tally)
    tally.start_rss_mb = dict(tally.peak_rss_mb)
    t0 = time.monotonic()
    try:
        for i in range(n):
            _send(url, gen.next(families, inputs), timeout_s, tally, secrets)
            tally.sent = i + 1
            last = i + 1 == n or (max_s is not None and time.monotonic() - t0 > max_s)
            if (i + 1) % PROBE_EVERY == 0 or last:
                start = _check(pipe, url, timeout_s, tally, start, i + 1)
            if (i + 1) % 1000 == 0:
                print(f"  {i + 1} requests, {time.monotonic() - t0:.0f} s, 5xx={tally.total('5xx')} "
                      f"hangs={tally.total('hang')} deaths={len(tally.deaths)}", flush=True)
            if last:
                break
    except KeyboardInterrupt:                   # SIGINT/SIGTERM: the requests so far are reported
        tally.interrupted = True
        print(f"interrupted after {tally.sent} requests", flush=True)
    tally.wall_s = time.monotonic() - t0
    return tally


def report(tally: Tally, out: Path, max_rss_mb: int = MAX_RSS_MB) -> bool:
    outcomes = sorted({o for c in tally.by_kind.values() for o in c})
    print(f"{'kind':<22}" + "".join(f"{o:>9}" for o in outcomes) + f"{'total':>8}")
    for kind in sorted(tally.by_kind):
        c = tally.by_kind[kind]
        print(f"{kind:<22}" + "".join(f"{c.get(o, 0):>9}" for o in outcomes) + f"{sum(c.values()):>8}")
    hangs, fives, down = tally.total("hang"), tally.total("5xx"), tally.total("down")
    heavy = {k: v for k, v in tally.peak_rss_mb.items() if v > max_rss_mb}
    ok = hangs == 0 and fives == 0 and down == 0 and not tally.deaths and tally.failed_probes == 0 and not tally.leaks \
        and not heavy and tally.total("traceback") == 0 and not tally.interrupted
    start = tally.start_rss_mb
    print("peak RSS MB (measured, VmHWM; at start -> end): " + ", ".join(
        f"{k} {start.get(k, '?')} -> {v}" for k, v in sorted(tally.peak_rss_mb.items())) + f"; bound {max_rss_mb}")
    n = tally.sent
    print(f"requests={n} hangs={hangs} 5xx={fives} down={down} stage_deaths={len(tally.deaths)} leaks={tally.leaks} "
          f"probes={tally.probes - tally.failed_probes}/{tally.probes} wall_s={tally.wall_s:.0f} "
          f"{'ok' if ok else 'FAILED'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"requests": n, "interrupted": tally.interrupted, "hangs": hangs, "5xx": fives, "down": down, "leaks": tally.leaks,
                               "stage_deaths": tally.deaths, "probes": tally.probes,
                               "failed_probes": tally.failed_probes, "wall_s": tally.wall_s,
                               "peak_rss_mb": tally.peak_rss_mb, "start_rss_mb": tally.start_rss_mb,
                               "by_kind": {k: dict(c) for k, c in tally.by_kind.items()},
                               "examples": tally.examples}, indent=1))
    print(f"json: {out}")
    return ok


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(n: int, seed: int, timeout_s: float, out: Path, keep: bool, families=FAMILIES,
        max_rss_mb: int = MAX_RSS_MB, max_s: float | None = None, daemon_timeout_s: float | None = None) -> bool:
    from models.models_dir import resolve_models
    from models.packs.pack import build_pack
    from tests.pipeline_harness import Pipeline, tiny_assets
    signal.signal(signal.SIGTERM, _interrupt)      # the requests so far reported, then the pipeline stopped
    signal.signal(signal.SIGINT, _interrupt)
    # keys before the first table header land in the harness's last table, [stage.http]
    extra = (f"request_timeout_s = {daemon_timeout_s}\n" if daemon_timeout_s else "") + FUZZ_TOML
    cache = Path(tempfile.mkdtemp(prefix="anima-fuzz-http-"))
    try:
        models, pack = tiny_assets(cache)
        loras = hostile_loras(models / "loras", cache / "outside.safetensors")
        lora_pack = build_pack(resolve_models(models, {}, need=("dit",)).dit, cache / "pack-lora", LORA_PACK, "fp16",
                               lora_rank=LORA_RANK)
        with Pipeline.start(models, pack, threads=1, extra_toml=extra, keep=keep, packs=(lora_pack,)) as pipe:
            secrets = tuple({str(models / "loras"), str((models / "loras").resolve()), str(cache / "outside")})
            tally = fuzz(pipe, pipe.http_url(), n, seed, timeout_s, loras, secrets, families, max_s)
            settle_jobs(pipe)
            return report(tally, out, max_rss_mb)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds without an answer that make a hang")
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "out" / "fuzz_http.json")
    parser.add_argument("--keep", action="store_true", help="keep the pipeline's run folder (logs)")
    parser.add_argument("--only", nargs="+", choices=FAMILIES, default=list(FAMILIES),
                        help="request families: graph shapes, LoRA files, init images and schedule bounds")
    parser.add_argument("--max-rss-mb", type=int, default=MAX_RSS_MB, help="a program's allowed peak RSS (MB)")
    parser.add_argument("--max-s", type=float, default=None,
                        help="stop sending after this many seconds (the summary says how many requests were sent)")
    parser.add_argument("--daemon-timeout", type=float, default=None,
                        help="the front's [stage.http] request_timeout_s (default its own, 5 s): on a starved machine "
                             "a silent daemon is a 503 after it")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.timeout <= 0 or (args.max_s is not None and args.max_s <= 0) \
            or (args.daemon_timeout is not None and not 0.1 <= args.daemon_timeout <= 120):
        parser.error("--requests must be >= 1, --timeout and --max-s > 0, --daemon-timeout in [0.1, 120]")
    return 0 if run(args.requests, args.seed, args.timeout, args.json, args.keep, tuple(args.only),
                    args.max_rss_mb, args.max_s, args.daemon_timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
