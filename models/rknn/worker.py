"""rknn-toolkit2 worker: runs under .venv-rknn/bin/python and serves JSON-line requests (build, simulate) on stdin.

    .venv-rknn/bin/python models/rknn/worker.py            # then one JSON request per line on stdin

Standalone on purpose: imports only the standard library, numpy and (lazily) rknn-toolkit2, never the project's
modules (their dependencies are pinned differently in the main environment). Replies go to the original stdout as
one JSON line each; everything the toolkit prints (Python logging and the C compiler's own lines) goes to the log file
named by the request, or to /dev/null, by redirecting file descriptors 1 and 2.

Requests ({"op": ...}):
  hello                                     -> toolkit version, python, pid
  build    onnx, out, target, log            -> load_onnx + build(no quantization) + export_rknn to `out`
           [, quant: {dataset: [[npy per input]], int8: [tensor names], int8_inputs: [input names]}]
                                             -> W8A8 hybrid quantization instead: those MatMuls INT8, the rest FP16
  sim_load onnx, target, log [, slot]        -> load_onnx + build + init_runtime() in the simulator (kept alive)
  sim_infer inputs [npy paths, graph order], out_dir, log [, data_format: ["nchw", ...] per input] [, slot]
                                             -> outputs as npy files (float32, as the simulator returns)
  sim_release [slot]                         -> drop the simulator context
`slot` names one of several simulator contexts the worker keeps side by side (default ""), so one process (one
toolkit import, seconds of CPU) serves every model of a check; each slot's outputs are those of a context alone.
  quit
Every reply has "ok"; a failed one has "error" (a message, not a traceback) and the phase that failed.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

REPLY_FD = None            # dup of the original stdout: the only place replies are written


def _peak_rss_reset() -> None:
    """Reset VmHWM (Linux >= 4.0: writing 5 to clear_refs) so the next reading is this request's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss_kb() -> int:
    """Peak resident set size (VmHWM) in KiB since the last reset; 0 when /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class _LogTo:
    """Point fds 1 and 2 at a file (or /dev/null) for the duration of one request."""

    def __init__(self, path):
        self.path = path or os.devnull

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(self.fd, 1)
        os.dup2(self.fd, 2)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
        os.close(self.fd)


def toolkit_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("rknn-toolkit2")
    except PackageNotFoundError:
        return "unknown"


def _float16_all_but(cfg_path: str, int8: list, int8_inputs, graph_inputs=()) -> dict:
    """Edit the toolkit's hybrid quantization config (YAML it wrote: `custom_quantize_layers: {}` then
    `quantize_parameters:` with one 4-space-indented `name:` per tensor) so every tensor but the INT8 MatMuls'
    outputs and their inputs' runs float16 (graph inputs are not layers: left as the quantizer set them);
    -> {tensor: "int8" | "float16" | "input"}. Plain text: the toolkit's environment
    has no YAML library, and the lines it writes are this regular."""
    with open(cfg_path) as f:
        lines = f.read().splitlines()
    if not lines or not lines[0].startswith("custom_quantize_layers:") or "quantize_parameters:" not in lines:
        raise RuntimeError(f"{cfg_path}: not the hybrid quantization config rknn-toolkit2 2.5.0 writes")
    start = lines.index("quantize_parameters:")
    names = [ln[4:-1].strip("'\"") for ln in lines[start + 1:] if ln.startswith("    ") and not ln.startswith("     ")
             and ln.endswith(":")]
    out = {n: "int8" if any(n in (o, o + "_mm") for o in int8)
           or any(n == i or n.startswith(i + "_") for i in int8_inputs)
           else "input" if n in graph_inputs else "float16" for n in names}
    missing = [o for o in int8 if out.get(o + "_mm") != "int8" and out.get(o) != "int8"]
    if missing:
        raise RuntimeError(f"the quantizer's config has no tensor for INT8 MatMul(s) {missing}")
    head = ["custom_quantize_layers:"] + [f"    {n}: float16" for n, v in out.items() if v == "float16"]
    with open(cfg_path, "w") as f:
        f.write("\n".join(head + lines[1:]) + "\n")
    return out


class Worker:
    """Holds simulator contexts between requests, one per slot."""

    def __init__(self):
        self.built = None
        self.sims: dict = {}                 # slot -> the RKNN initialised in the simulator

    def _new(self):
        from rknn.api import RKNN            # imported at the first request that needs it (slow: several seconds)
        return RKNN(verbose=True)

    def _load_build(self, rk, req: dict) -> dict:
        """config + load_onnx + build; -> timings and return codes; raises RuntimeError naming the failed phase.
        With req["quant"], the build is the hybrid quantization of `_quant_build` (self.built is the built RKNN)."""
        self.built = rk
        if req.get("quant"):
            return self._quant_build(rk, req)
        t = {}
        t0 = time.perf_counter()
        rc = rk.config(target_platform=req.get("target", "rk3588"))
        if rc not in (None, 0):
            raise RuntimeError(f"config returned {rc}")
        rc = rk.load_onnx(model=req["onnx"])
        t["load_s"] = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"load_onnx returned {rc}")
        t1 = time.perf_counter()
        rc = rk.build(do_quantization=False)
        t["build_s"] = time.perf_counter() - t1
        if rc != 0:
            raise RuntimeError(f"build returned {rc}")
        return t

    def _quant_build(self, rk, req: dict) -> dict:
        """rknn-toolkit2's hybrid quantization: step 1 quantizes everything W8A8 (per-channel weights, per-tensor
        activations) over the dataset and writes its per-tensor config; every tensor but the INT8 MatMuls' own
        (and their inputs') is set to float16 in it; step 2 builds from the edited config."""
        q, t = req["quant"], {}
        t0 = time.perf_counter()
        rc = rk.config(target_platform=req.get("target", "rk3588"), quantized_dtype="w8a8",
                       quantized_method="channel", quantized_algorithm="normal")
        if rc not in (None, 0):
            raise RuntimeError(f"config returned {rc}")
        if rk.load_onnx(model=req["onnx"]) != 0:
            raise RuntimeError("load_onnx failed")
        t["load_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        with open("dataset.txt", "w") as f:                  # the worker's cwd is its own scratch folder
            f.write("".join(" ".join(paths) + "\n" for paths in q["dataset"]))
        if rk.hybrid_quantization_step1(dataset="dataset.txt") != 0:
            raise RuntimeError("hybrid_quantization_step1 failed")
        stem = os.path.splitext(os.path.basename(req["onnx"]))[0]
        params = _float16_all_but(stem + ".quantization.cfg", q["int8"], q.get("int8_inputs", ()),
                                  q.get("graph_inputs", ()))
        keep = [n for n in params if params[n] == "int8"]
        rk.release()
        rk = self.built = self._new()
        if rk.hybrid_quantization_step2(stem + ".model", stem + ".data", stem + ".quantization.cfg") != 0:
            raise RuntimeError("hybrid_quantization_step2 failed")
        t["build_s"] = time.perf_counter() - t1
        t["int8_tensors"], t["float16_tensors"] = len(keep), len(params) - len(keep)
        return t

    def op_hello(self, req: dict) -> dict:
        return {"toolkit": toolkit_version(), "python": sys.version.split()[0], "pid": os.getpid()}

    def op_build(self, req: dict) -> dict:
        _peak_rss_reset()
        rk = self._new()
        try:
            t = self._load_build(rk, req)
            rk = self.built
            t0 = time.perf_counter()
            rc = rk.export_rknn(req["out"])
            t["export_s"] = time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"export_rknn returned {rc}")
        finally:
            (self.built or rk).release()             # the RKNN the build ended with (a hybrid build makes a second)
            self.built = None
        return {**t, "bytes": os.path.getsize(req["out"]), "peak_rss_kb": _peak_rss_kb()}

    def op_sim_load(self, req: dict) -> dict:
        self.op_sim_release(req)
        _peak_rss_reset()
        rk = self._new()
        try:
            t = self._load_build(rk, req)
            rk = self.built
            t0 = time.perf_counter()
            rc = rk.init_runtime()           # no target: the simulator
            t["init_s"] = time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"init_runtime (simulator) returned {rc}")
        except BaseException:
            (self.built or rk).release()
            self.built = None
            raise
        self.sims[req.get("slot", "")] = rk
        return {**t, "peak_rss_kb": _peak_rss_kb()}

    def op_sim_infer(self, req: dict) -> dict:
        import numpy as np
        sim = self.sims.get(req.get("slot", ""))
        if sim is None:
            raise RuntimeError("sim_infer before sim_load")
        xs = [np.load(p) for p in req["inputs"]]
        t0 = time.perf_counter()
        # 4-D inputs: the toolkit assumes NHWC unless told; our graphs are NCHW and say so per input
        fmt = req.get("data_format")
        outs = sim.inference(inputs=xs, data_format=fmt) if fmt else sim.inference(inputs=xs)
        dt = time.perf_counter() - t0
        if outs is None:
            raise RuntimeError("inference returned None (see the log)")
        paths = []
        for i, o in enumerate(outs):
            p = os.path.join(req["out_dir"], f"out{i}.npy")
            np.save(p, np.asarray(o))
            paths.append(p)
        return {"outputs": paths, "infer_s": dt}

    def op_sim_release(self, req: dict) -> dict:
        sim = self.sims.pop(req.get("slot", ""), None)
        if sim is not None:
            sim.release()
        return {}

    def release_all(self) -> None:
        for slot in list(self.sims):
            self.op_sim_release({"slot": slot})


def _reply(obj: dict) -> None:
    os.write(REPLY_FD, (json.dumps(obj) + "\n").encode())


def serve() -> int:
    global REPLY_FD
    REPLY_FD = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)                          # nothing but replies reaches the parent's pipe
    os.close(null)
    w = Worker()
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
            op = req["op"]
        except (ValueError, KeyError, TypeError):
            _reply({"ok": False, "error": f"bad request line: {line[:200]!r}"})
            continue
        if op == "quit":
            _reply({"ok": True})
            break
        fn = getattr(w, "op_" + op, None)
        if fn is None:
            _reply({"ok": False, "error": f"unknown op {op!r}"})
            continue
        with _LogTo(req.get("log")):
            try:
                out = {"ok": True, **fn(req)}
            except Exception as e:      # the toolkit raises plain Exceptions with its log text inside
                print(traceback.format_exc(), file=sys.stderr)
                out = {"ok": False, "error": f"{op}: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"}
        _reply(out)
    w.release_all()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
