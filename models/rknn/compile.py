"""Compile a pack's branch ONNX graphs to PACK/rknn/*.rknn with rknn-toolkit2 in worker subprocesses (resumable).

One path for both pack kinds: a DiT pack's branches are named bNN_kind, a VAE pack's models carry a `name` (trunk,
tile); everything else (manifest entries, logs, CPU-op report, up-to-date check) is the same."""
from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from models.base.durable import atomic_write
from models.records.manifest import MANIFEST, Manifest, file_sha256, read_manifest, write_manifest
from models.rknn.buildlog import parse_build_log
from models.rknn.client import ToolkitError, ToolkitWorker

log = logging.getLogger(__name__)

RKNN_DIR = "rknn"
LOG_DIR = "rknn/logs"
TARGETS = ("rk3588", "rk3576", "rk3568", "rk3566", "rk3562")     # rknn-toolkit2 NPU platforms this tool accepts


class CompileError(ValueError):
    """Bad compile request (no pack, unknown target, refused toolkit)."""


def entry_name(branch: dict) -> str:
    """A manifest branch's file stem: its `name` (VAE packs) or bNN_kind (DiT packs)."""
    return str(branch["name"]) if branch.get("name") else f"b{int(branch['block']):02d}_{branch['kind']}"


def units(branches: list) -> list:
    """(entry, the branch it belongs to, file stem) of every graph to compile: each branch, then a sharded pack's
    shard parts (bNN_kind.sI: their own ONNX, sha256 and `rknn` entry, models/packs/sharded.py)."""
    out = []
    for b in branches:
        out.append((b, b, entry_name(b)))
        out += [(p, b, f"{entry_name(b)}.s{int(p['index'])}") for p in (b.get("shards") or {}).get("parts") or ()]
    return out


@dataclass
class BranchResult:
    block: Optional[int]
    kind: str
    status: str                      # "built" | "skipped" | "failed"
    entry: dict = field(default_factory=dict)     # the manifest "rknn" entry (built or skipped)
    error: str = ""
    name: str = ""

    @classmethod
    def of(cls, branch: dict, status: str, entry: Optional[dict] = None, name: str = "") -> "BranchResult":
        block = branch.get("block")
        return cls(None if block is None else int(block), str(branch["kind"]), status, dict(entry or {}),
                   name=name or entry_name(branch))


def _read_manifest(pack: Path) -> dict:
    m, rec = read_manifest(pack, Manifest, CompileError, what="pack")
    if not rec.branches:
        raise CompileError(f"{pack / MANIFEST}: manifest field 'branches' is missing or empty")
    return m


def up_to_date(pack: Path, branch: dict, toolkit: str, target: str, quant: str = None) -> bool:
    """A compiled file exists, matches its recorded sha256, and was built from this ONNX by this toolkit for target
    (a W8A8 branch: with this quantization fingerprint)."""
    e = branch.get("rknn")
    if not isinstance(e, dict) or e.get("quant") != quant:
        return False
    if e.get("onnx_sha256") != branch.get("sha256") or e.get("toolkit") != toolkit or e.get("target") != target:
        return False
    f = pack / str(e.get("file", ""))
    return f.is_file() and f.stat().st_size == e.get("bytes") and file_sha256(f) == e.get("sha256")


class _WorkerSlot:
    """One pool thread's worker; a fresh process after `per_worker` branches (1 = a process per branch) or a death."""

    def __init__(self, venv, per_worker: int):
        self.venv, self.per_worker = venv, per_worker
        self.worker: Optional[ToolkitWorker] = None
        self.used = 0

    def get(self) -> ToolkitWorker:
        if self.worker is not None and (not self.worker.alive or (self.per_worker and self.used >= self.per_worker)):
            self.close()
        if self.worker is None:
            self.worker, self.used = ToolkitWorker(self.venv), 0
        self.used += 1
        return self.worker

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def _commit(tmp: Path, out: Path) -> None:
    """The compiler wrote `tmp` by its own path: it goes into place through the one durable write (copied into an
    exclusive temporary, fsynced, renamed), so a power cut never leaves a torn .rknn under its final name."""
    with open(tmp, "rb") as src:
        atomic_write(out, lambda f: shutil.copyfileobj(src, f, 1 << 20))
    tmp.unlink()


def build_branch(slot: _WorkerSlot, pack: Path, branch: dict, target: str, toolkit: str,
                 unit: Optional[tuple] = None, manifest: Optional[dict] = None) -> BranchResult:
    """Compile one branch (or `unit`: a shard part of it, its stem, see `units`); the .rknn is renamed into place
    only when the build log is clean of REGTASK errors."""
    if unit is not None:
        branch, owner, name = unit
        res = BranchResult.of(owner, "failed", name=name)
    else:
        owner = branch
        res = BranchResult.of(branch, "failed")
    name = res.name
    onnx_path = pack / branch["onnx"]
    out_rel = f"{RKNN_DIR}/{name}.rknn"
    log_rel = f"{LOG_DIR}/{name}.log"
    out, tmp, log_path = pack / out_rel, pack / (out_rel + ".tmp"), pack / log_rel
    log_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    work = pack / RKNN_DIR / f".{name}.dataset"
    try:
        quant = _quant_fields(pack, manifest, owner, work, None if branch is owner else branch)
        w = slot.get()
        reply = w.request("build", onnx=str(onnx_path), out=str(tmp), target=target, log=str(log_path),
                          **{k: v for k, v in quant.items() if k == "quant"})
    except ToolkitError as e:
        tmp.unlink(missing_ok=True)
        code = e.args[1] if len(e.args) > 1 else None
        res.error = str(e.args[0]) + (" — a segmentation fault in the compiler" if code in (-11, 139) else "")
        slot.close()
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wall = time.perf_counter() - t0
    parsed = parse_build_log(log_path.read_text(errors="replace") if log_path.exists() else "")
    if parsed.regtask_errors:
        tmp.unlink(missing_ok=True)
        res.error = (f"{parsed.regtask_errors} REGTASK errors in the build log (the compiler returned success but "
                     f"the register commands are wrong), e.g. {parsed.regtask_samples[0]!r}; see {log_rel}")
        return res
    _commit(tmp, out)
    # VmHWM of the worker, reset before this build (not ru_maxrss: after fork + exec it still counts the parent's size)
    rss_kb = int(reply.get("peak_rss_kb", 0))
    if slot.per_worker == 1:
        slot.close()
    res.status = "built"
    res.entry = {
        "file": out_rel, "sha256": file_sha256(out), "bytes": out.stat().st_size, "onnx_sha256": branch["sha256"],
        "target": target, "toolkit": toolkit, "compiler": parsed.compiler_version,
        "build_s": round(reply["build_s"], 3), "load_s": round(reply["load_s"], 3),
        "export_s": round(reply["export_s"], 3), "wall_s": round(wall, 3), "peak_rss_mb": round(rss_kb / 1024, 1),
        "layers": len(parsed.layers), "npu_layers": sum(x.target == "NPU" for x in parsed.layers),
        "cpu_ops": parsed.cpu_op_names(), "log": log_rel,
        # what a context of it needs on the board beyond the file: the compiler's planned activation memory
        "internal_bytes": parsed.internal_bytes, "weight_mem_bytes": parsed.weight_bytes,
    }
    if quant:
        res.entry.update(quant=quant["fingerprint"], int8_tensors=reply.get("int8_tensors"))
    if parsed.cpu_ops:
        log.warning("%s: %d operator(s) on the CPU: %s", name, len(parsed.cpu_ops), ", ".join(parsed.cpu_op_names()))
    return res


def _quant_fields(pack: Path, manifest: Optional[dict], branch: dict, work: Path, part: Optional[dict] = None) -> dict:
    """{"quant": request, "fingerprint"} of a W8A8 branch or of `part`, a shard of it (models/rknn/quant.py), {} for
    a float one."""
    if manifest is None or "block" not in branch:
        return {}
    from models.rknn.quant import quant_fingerprint, quant_request
    req = quant_request(pack, manifest, branch, work, part=part)
    return {} if req is None else {"quant": req, "fingerprint": quant_fingerprint(manifest, branch, part)}


def _fingerprint(manifest: dict, unit: tuple):
    """The quantization fingerprint a W8A8 unit's (a branch's or a shard's, see `units`) .rknn must carry to be up
    to date (None for a float one)."""
    from models.records.manifest import branch_int8, quant_info
    entry, owner, _ = unit
    if "block" not in owner or quant_info(manifest) is None or not branch_int8(entry):
        return None
    from models.rknn.quant import quant_fingerprint
    return quant_fingerprint(manifest, owner, None if entry is owner else entry)


def toolkit_version(venv=None) -> str:
    with ToolkitWorker(venv) as w:
        return w.toolkit_version


def check_regressions(pack: Path, branches: list, toolkit: str) -> None:
    """Refuse a toolkit version known to break on a pattern one of these graphs contains (graph_checks)."""
    from models.rknn.graph_checks import KNOWN_REGRESSIONS, regression_for
    if toolkit not in KNOWN_REGRESSIONS:
        return
    import onnx
    for b in branches:
        msg = regression_for(toolkit, onnx.load(str(pack / b["onnx"]), load_external_data=False))
        if msg:
            raise CompileError(f"{b['onnx']}: refusing to compile with rknn-toolkit2 {toolkit}: {msg}")


def compile_pack(pack_dir, target: str = "rk3588", jobs: int = 1, venv=None, blocks: Optional[list] = None,
                 per_worker: int = 1, force: bool = False, progress=None) -> dict:
    """Compile the pack's branches (all, or those of `blocks`) into PACK/rknn; -> a report dict.

    `jobs` worker processes run in parallel; each serves `per_worker` branches before it is replaced (1: a fresh
    process per branch, so memory is returned to the system after every build; 0: no limit). Up-to-date outputs are
    skipped unless `force`. The manifest is rewritten (write-then-rename) after every branch, so an interrupted
    compile resumes where it stopped. `progress(branches done, branches to build)` is called after each build.
    """
    pack = Path(pack_dir).absolute()
    manifest, work = _compile_work(pack, target, jobs, blocks)
    try:
        toolkit = toolkit_version(venv)
    except ToolkitError as e:
        raise CompileError(str(e.args[0])) from None
    check_regressions(pack, [b for b, _, _ in work], toolkit)
    (pack / LOG_DIR).mkdir(parents=True, exist_ok=True)
    run = _CompileRun(pack, manifest, target, toolkit, venv, per_worker, progress)
    run.queue = [u for u in work if force or not up_to_date(pack, u[0], toolkit, target, _fingerprint(manifest, u))]
    for u in work:
        if u not in run.queue:
            run.results[u[2]] = BranchResult.of(u[1], "skipped", u[0]["rknn"], name=u[2])
    log.info("compile %s for %s with rknn-toolkit2 %s: %d branch(es) to build, %d up to date, %d job(s)",
             pack, target, toolkit, len(run.queue), len(work) - len(run.queue), jobs)
    t0 = time.perf_counter()
    run.build_all(jobs)
    wall = time.perf_counter() - t0
    ordered = [run.results[name] for _, _, name in work]
    manifest["rknn"] = _rknn_section(manifest, ordered, target, toolkit)
    write_manifest(pack, manifest)
    return {
        "pack": str(pack), "target": target, "toolkit": toolkit, "compiler": manifest["rknn"]["compiler"],
        "jobs": jobs, "wall_s": round(wall, 2),
        "built": sum(r.status == "built" for r in ordered), "skipped": sum(r.status == "skipped" for r in ordered),
        "failed": sum(r.status == "failed" for r in ordered),
        "branches": [{"name": r.name, "block": r.block, "kind": r.kind, "status": r.status, "error": r.error,
                      **{k: r.entry.get(k) for k in ("bytes", "build_s", "peak_rss_mb", "cpu_ops", "file",
                                                      "internal_bytes", "weight_mem_bytes")}}
                     for r in ordered],
    }


def _compile_work(pack: Path, target: str, jobs, blocks: Optional[list]) -> tuple:
    """The request checked: (the pack's manifest, the units to compile: (entry, its branch, stem), see `units`)."""
    if target not in TARGETS:
        raise CompileError(f"target {target!r}: choose one of {list(TARGETS)}")
    if not isinstance(jobs, int) or jobs < 1:
        raise CompileError(f"jobs {jobs!r} must be a positive integer")
    manifest = _read_manifest(pack)
    if blocks is not None and any("block" not in b for b in manifest["branches"]):
        raise CompileError(f"{pack}: blocks select DiT branches; this pack's models have no blocks")
    todo = [b for b in manifest["branches"] if blocks is None or int(b["block"]) in set(blocks)]
    work = units(todo)                                   # (entry, its branch, stem): branches and shard parts
    for b, _, _ in work:
        if not (pack / b["onnx"]).is_file():
            raise CompileError(f"{pack}: branch file {b['onnx']} is missing")
    return manifest, work


class _CompileRun:
    """The builds of one compile_pack: a worker slot per pool thread, the results by stem, and the manifest
    rewritten after every build."""

    def __init__(self, pack: Path, manifest: dict, target: str, toolkit: str, venv, per_worker: int, progress):
        self.pack, self.manifest, self.target, self.toolkit = pack, manifest, target, toolkit
        self.venv, self.per_worker, self.progress = venv, per_worker, progress
        self.queue: list = []
        self.results: dict = {}
        self.lock = threading.Lock()
        self.local = threading.local()
        self.slots: list = []

    def build_all(self, jobs: int) -> None:
        try:
            with ThreadPoolExecutor(max_workers=jobs) as ex:
                list(ex.map(self.build_one, self.queue))
        finally:
            for s in self.slots:
                s.close()

    def _slot(self) -> _WorkerSlot:
        if not hasattr(self.local, "slot"):
            self.local.slot = _WorkerSlot(self.venv, self.per_worker)
            with self.lock:
                self.slots.append(self.local.slot)
        return self.local.slot

    def build_one(self, u: tuple) -> BranchResult:
        b = u[0]
        r = build_branch(self._slot(), self.pack, b, self.target, self.toolkit, unit=u, manifest=self.manifest)
        with self.lock:
            self.results[r.name] = r
            if r.status == "built":
                b["rknn"] = r.entry
            else:
                b.pop("rknn", None)
            write_manifest(self.pack, self.manifest)
            done = sum(x.status != "skipped" for x in self.results.values())
        if self.progress is not None:
            self.progress(done, len(self.queue))
        if r.status == "built":
            log.info("%s: built in %.1f s, %.1f MB, peak RSS %.0f MB", r.name, r.entry["build_s"],
                     r.entry["bytes"] / 1e6, r.entry["peak_rss_mb"])
        else:
            log.error("%s: FAILED: %s", r.name, r.error)
        return r


def _rknn_section(manifest: dict, ordered: list, target: str, toolkit: str) -> dict:
    """The manifest's "rknn" summary once the builds are done."""
    built = [r.entry for r in ordered if r.status in ("built", "skipped")]
    return {
        "target": target, "toolkit": toolkit,
        "compiler": next((e.get("compiler") for e in built if e.get("compiler")), ""),
        "compiled": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "branches": sum(isinstance(b.get("rknn"), dict) for b in manifest["branches"]),
        "bytes": sum(b["rknn"]["bytes"] for b, _, _ in units(manifest["branches"])
                     if isinstance(b.get("rknn"), dict)),
    }


def describe(report: dict) -> str:
    """The report as a table for people."""
    rows = [f"{'branch':<10} {'status':<8} {'build s':>8} {'MB':>8} {'RSS MB':>8} {'int. MiB':>9}  CPU ops / error"]
    for b in report["branches"]:
        extra = b["error"] or (", ".join(b["cpu_ops"]) if b["cpu_ops"] else "-")
        rows.append(f"{b['name']:<10} {b['status']:<8} {b['build_s'] or 0:>8.2f} {(b['bytes'] or 0) / 1e6:>8.2f} "
                    f"{b['peak_rss_mb'] or 0:>8.0f} {(b.get('internal_bytes') or 0) / 2**20:>9.1f}  {extra}")
    total = sum(b["bytes"] or 0 for b in report["branches"])
    rows.append(f"{report['built']} built, {report['skipped']} up to date, {report['failed']} failed; "
                f"{total / 1e6:.1f} MB; {report['wall_s']:.1f} s wall; rknn-toolkit2 {report['toolkit']}, "
                f"librknnc {report['compiler']}")
    return "\n".join(rows)


__all__ = ["compile_pack", "describe", "CompileError", "up_to_date"]
