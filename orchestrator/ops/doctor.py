"""`orchestrator doctor`: is this machine and this run folder ready for a job? One line per check,
`ok|warn|fail NAME: what (and the fix)`, the last line `doctor ok=N warn=N fail=N`; exit 0 when nothing fails.

Everything read from /proc and /sys goes through models.runtime.probes (tests point its paths at fake trees). A check that
does not apply (the NPU on a PC, or with a CPU bundle) says so on an ok line. `--full` also hashes every pack file.
"""
from __future__ import annotations

import platform
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from models.runtime import probes

OK, WARN, FAIL = "ok", "warn", "fail"
LIBRKNNRT = "librknnrt.so"
# rknn-toolkit2's repository ships the board runtime library at this path (github.com/airockchip/rknn-toolkit2)
LIBRKNNRT_SOURCE = "rknpu2/runtime/Linux/librknn_api/aarch64/librknnrt.so"
# DRAM left to scale on load (dmc_ondemand) costs the NPU its memory bandwidth between bursts; performance pins it
DRAM_DEVFREQ = "dmc"
FAST_GOVERNORS = ("performance",)
# what a job needs besides the packs' own files (stages' interpreters, ONNX Runtime arenas): ESTIMATED, not measured
STAGE_OVERHEAD_MB = 600.0


@dataclass(frozen=True)
class Check:
    status: str
    name: str
    text: str

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.text}"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 1e6 else f"{n / 1e3:,.1f} kB"


class Doctor:
    """The checks of one run folder; `run()` -> the list of Check, in order."""

    def __init__(self, rf, full: bool = False):
        self.rf, self.full = rf, full
        self.cfg = None
        self.checks: list[Check] = []
        self.arm = platform.machine() in ("aarch64", "arm64")

    def add(self, status: str, name: str, text: str) -> None:
        self.checks.append(Check(status, name, text))

    # -- the run folder and its config ----------------------------------------------------------------------------

    def check_config(self) -> None:
        from stages.config import ConfigError, load_config
        path = self.rf.pipeline_toml
        if not path.is_file():
            self.add(FAIL, "config", f"{path} does not exist: orchestrator --run {self.rf.root} init --bundle BUNDLE")
            return
        try:
            self.cfg = load_config(path)
        except ConfigError as e:
            self.add(FAIL, "config", f"{e}")
            return
        self.add(OK, "config", f"{path} is valid (executor backend {self.cfg.backend})")

    def check_run_folder(self) -> None:
        root = self.rf.root
        try:
            self.rf.check()
            with tempfile.NamedTemporaryFile(dir=root, prefix=".doctor-"):
                pass
        except (ValueError, OSError) as e:
            self.add(FAIL, "run-folder", f"{root}: {e}")
            return
        need = 64.0
        if self.cfg is not None:
            need = float(self.cfg.settings("orchestrator").min_free_mb)
        free = shutil.disk_usage(root).free / 2**20
        if free < need:
            self.add(FAIL, "disk", f"{free:,.0f} MiB free in {root}, a job needs {need:,.0f} (min_free_mb): free "
                                   "some space (orchestrator prune --keep 10)")
        else:
            self.add(OK, "run-folder", f"{root} is private (0700) and writable, {free:,.0f} MiB free")

    def check_uploads(self) -> None:
        """The upload folders' size against stage.http.max_uploads_mb (a new upload past it is refused)."""
        from orchestrator.engine.upload_space import uploads_size
        files, size = uploads_size(self.rf.root)
        quota = self.cfg.settings("http").max_uploads_mb if self.cfg is not None else 0
        text = f"{files} file(s), {_mb(size)} in {self.rf.root}/input, temp, output"
        if quota and size >= 0.9 * quota * 2**20:
            self.add(WARN, "uploads", f"{text}: near stage.http.max_uploads_mb = {quota} (a new upload past it is "
                                      "refused): orchestrator prune --older-than 7d")
        else:
            self.add(OK, "uploads", text + (f" (stage.http.max_uploads_mb = {quota})" if quota else ""))

    # -- packs -----------------------------------------------------------------------------------------------------

    def check_packs(self) -> None:
        """Every pack the config names loads (with --full: every file's sha256), and every DiT size has a VAE pack."""
        if self.cfg is None:
            return
        from models.packs.pack import PackError, load_pack
        from models.text.encoder_pack import EncoderPackError, load_encoder_pack
        from models.vae.pack import load_vae_pack
        how = "every file's sha256" if self.full else "files present (--full: hashes)"
        dit_sizes, vae_sizes = [], []
        for d in self.cfg.packs:
            try:
                p = load_pack(d, check=self.full)
                self._present(d, p.manifest)
            except PackError as e:
                self.add(FAIL, "dit-pack", f"{e}")
                continue
            dit_sizes.append((p.geometry.width, p.geometry.height))
            self.add(OK, "dit-pack", f"{d}: {p.geometry.width}x{p.geometry.height}, {p.dtype}; {how}")
            baked = p.manifest.get("lora", {}).get("baked", [])
            if baked:
                from models.setup.bundle import baked_label
                self.add(OK, "lora", f"{d}: baked LoRA {baked_label(baked)} (no run-time cost)")
        vae = self.cfg.stage_settings("vae")
        if vae.get("backend", "torch") != "torch":
            packs = vae.get("vae_pack") or []
            for d in [packs] if isinstance(packs, str) else packs:
                d = Path(self.cfg.path).parent / str(d)
                try:
                    p = load_vae_pack(d, check=self.full)
                    self._present(d, p.manifest)
                except PackError as e:
                    self.add(FAIL, "vae-pack", f"{e}")
                    continue
                vae_sizes.append((p.width, p.height))
                self.add(OK, "vae-pack", f"{d}: {p.width}x{p.height}; {how}")
            missing = [s for s in dit_sizes if s not in vae_sizes]
            if missing:
                self.add(FAIL, "sizes", "no VAE pack for " + ", ".join(f"{w}x{h}" for w, h in missing) + ": a job of "
                         "that size would be refused at submit; add the VAE pack of each size (the bundle has them)")
            else:
                self.add(OK, "sizes", "every DiT size has its VAE pack: " +
                         ", ".join(f"{w}x{h}" for w, h in dit_sizes))
        enc = self.cfg.stage_settings("encoder")
        if enc.get("backend") == "onnx" and enc.get("pack"):
            d = Path(self.cfg.path).parent / str(enc["pack"])
            try:
                load_encoder_pack(d, check=self.full)
                self.add(OK, "encoder-pack", f"{d}; {how}")
            except EncoderPackError as e:
                self.add(FAIL, "encoder-pack", f"{e}")

    def check_size_memory(self) -> None:
        """Each DiT size's largest branch call (its contexts and the arena's growth, MODELLED by the board model with
        the official widths) against what the board leaves for contexts: this board's MemAvailable when the executor
        runs on its NPU, else the modelled `board_ram_gb` board (8 GB)."""
        if self.cfg is None:
            return
        from models.board.auto import budget
        from models.board.cost import BoardModel, CostModelError
        from models.packs.memory_fit import size_fit
        from models.packs.pack import PackError, load_pack
        ex = self.cfg.stage_settings("executor")
        avail = None
        if self.cfg.backend == "rknn" and probes.is_rk3588():
            avail = probes.meminfo_kb().get("MemAvailable")
            avail = None if avail is None else avail / 1024
        for d in self.cfg.packs:
            try:
                g = load_pack(d, check=False).geometry
                model = BoardModel.for_pack(d, "full", ex.get("board_cost"))
            except (PackError, CostModelError, OSError) as e:
                self.add(WARN, "size-memory", f"{d}: cannot model its memory: {e}")
                continue
            mib, basis = budget(model, ex, avail)
            fit = size_fit(model, (g.width, g.height), mib, basis)
            status = OK if fit.fits else WARN if avail is not None else FAIL
            self.add(status, f"memory-{g.width}x{g.height}", fit.line())

    def _present(self, d, manifest) -> None:
        """Without --full the loaders read the manifest only: every file it vouches for must at least be there."""
        from models.packs.pack import PackError, missing_files
        if self.full:
            return
        gone = missing_files(d, manifest)
        if gone:
            raise PackError(f"{d}: {len(gone)} file(s) missing or cut short, e.g. {gone[0]}; copy the bundle again")

    # -- the machine -----------------------------------------------------------------------------------------------

    def _npu_used(self) -> bool:
        if self.cfg is None:
            return False
        return self.cfg.backend == "rknn" or self.cfg.stage_settings("vae").get("backend") == "rknn"

    def check_machine(self) -> None:
        compat = probes.soc_compatible()
        if probes.is_rk3588():
            self.add(OK, "machine", f"{', '.join(compat)} ({platform.machine()})")
        elif self._npu_used():
            self.add(FAIL, "machine", f"{platform.machine()}, not an RK3588 ({', '.join(compat or ['no device tree'])})"
                                      ": the rknn backend needs the board; use a --target none bundle elsewhere")
        else:
            self.add(OK, "machine", f"{platform.machine()} (not an RK3588): the NPU checks do not apply (CPU backend)")

    def check_board_ram(self) -> None:
        """Which board RAM the board model prices with (estimate, keep_up auto): configured, read here, or assumed."""
        if self.cfg is None:
            return
        from orchestrator.engine.estimate import BoardSettings
        board = BoardSettings.of_config(self.cfg)
        self.add(OK, "board-ram", f"{board.board_ram_gb} GB board ({board.ram_basis}): what the estimate and keep_up "
                                  "auto price")

    def check_npu(self) -> None:
        if not self._npu_used():
            self.add(OK, "npu", "does not apply: no stage runs on the NPU (backend "
                                f"{self.cfg.backend if self.cfg else '?'})")
            return
        drv = probes.npu_driver_version()
        if drv:
            self.add(OK, "npu-driver", f"RKNPU driver {drv}")
        else:
            self.add(WARN, "npu-driver", f"cannot read {probes.RKNPU_VERSION} (needs debugfs and root: sudo "
                                         "orchestrator doctor); the driver version is unchecked")
        lib = probes.find_library(LIBRKNNRT)
        if lib:
            self.add(OK, "librknnrt", lib)
        else:
            self.add(FAIL, "librknnrt", f"{LIBRKNNRT} is in none of {', '.join(probes.LIB_DIRS)}: copy it from "
                                        f"rknn-toolkit2's {LIBRKNNRT_SOURCE} (the release that compiled the packs) "
                                        "to /usr/lib (docs/board.md)")
        self._check_runtime()

    def _check_runtime(self) -> None:
        from models.records.manifest import ManifestError, toolkit_release
        from models.runtime.backends.base import BackendError
        from models.runtime.backends.rknn import lite_module, runtime_mismatch
        want = None
        for d in self.cfg.packs:
            try:
                want = toolkit_release(d)
            except ManifestError:
                continue
            if want:
                break
        try:
            api = lite_module()
        except BackendError as e:
            self.add(FAIL, "rknn-runtime", f"{e}")
            return
        if not want:
            self.add(FAIL, "rknn-runtime", "the DiT packs record no rknn-toolkit2 version: they are not compiled "
                                           "(anima-models bundle --target rk3588)")
            return
        problem = runtime_mismatch(want, api)
        label = " (the labelled STAND-IN, not the NPU)" if getattr(api, "IS_STANDIN", False) else ""
        if problem:
            self.add(FAIL, "rknn-runtime", f"the packs were compiled with rknn-toolkit2 {want}, but {problem}")
        else:
            self.add(OK, "rknn-runtime", f"rknn-toolkit-lite2 {want}{label}, the release that compiled the packs")

    def check_governors(self) -> None:
        devs = probes.devfreq_governors()
        cpus = probes.cpufreq_governors()
        if not devs and not cpus:
            self.add(OK, "governors", "does not apply: no devfreq or cpufreq here")
            return
        dmc = devs.get(DRAM_DEVFREQ)
        if dmc is None:
            self.add(OK, "dram-governor", f"does not apply: no {probes.DEVFREQ}/{DRAM_DEVFREQ}")
        elif dmc in FAST_GOVERNORS:
            self.add(OK, "dram-governor", f"{DRAM_DEVFREQ}: {dmc}")
        else:
            self.add(WARN, "dram-governor", f"{DRAM_DEVFREQ}: {dmc} (DRAM runs slow between bursts): echo performance "
                                            f"| sudo tee {probes.DEVFREQ}/{DRAM_DEVFREQ}/governor")
        npu = {k: v for k, v in devs.items() if k.endswith(".npu")}
        for k, v in npu.items():
            if v in FAST_GOVERNORS:
                self.add(OK, "npu-governor", f"{k}: {v}")
            else:
                self.add(WARN, "npu-governor", f"{k}: {v}: echo performance | sudo tee {probes.DEVFREQ}/{k}/governor")
        slow = {k: v for k, v in cpus.items() if v not in FAST_GOVERNORS + ("schedutil", "ondemand")}
        if slow:
            self.add(WARN, "cpu-governor", ", ".join(f"{k}: {v}" for k, v in slow.items()) + ": host ops run slow; "
                     "echo schedutil | sudo tee /sys/devices/system/cpu/cpufreq/policy*/scaling_governor")
        elif cpus:
            self.add(OK, "cpu-governor", ", ".join(f"{k}: {v}" for k, v in cpus.items()))

    def _need_mb(self) -> float | None:
        """ESTIMATED memory a job needs at its peak: the encoder pack's files (it runs alone, before the denoise), or
        the DiT host weights plus the largest branch model (the denoise), plus STAGE_OVERHEAD_MB."""
        if self.cfg is None or not self.cfg.packs:
            return None
        from models.records.manifest import ManifestError, peak_model_bytes
        peaks = []
        for d in self.cfg.packs:
            try:
                peaks.append(peak_model_bytes(d))
            except (OSError, ManifestError):
                continue
        enc = self.cfg.stage_settings("encoder")
        if enc.get("pack"):
            d = Path(self.cfg.path).parent / str(enc["pack"])
            peaks.append(sum(f.stat().st_size for f in d.glob("*") if f.is_file()))
        return max(peaks, default=0) / 2**20 + STAGE_OVERHEAD_MB

    def check_memory(self) -> None:
        mi = probes.meminfo_kb()
        if "MemAvailable" not in mi:
            self.add(WARN, "memory", f"cannot read MemAvailable from {probes.MEMINFO}")
            return
        avail = mi["MemAvailable"] / 1024
        need = self._need_mb()
        swap = mi.get("SwapTotal", 0) / 1024
        if need is not None and avail < need:
            fix = ("" if swap else "; add zram swap: sudo apt install zram-tools, PERCENT=50 in /etc/default/zramswap, "
                   "sudo systemctl restart zramswap")
            self.add(WARN, "memory", f"MemAvailable {avail:,.0f} MiB, a job needs about {need:,.0f} MiB (ESTIMATED "
                                     f"from the pack sizes): stop other programs{fix}")
        else:
            est = f", a job needs about {need:,.0f} MiB (ESTIMATED from the pack sizes)" if need else ""
            self.add(OK, "memory", f"MemAvailable {avail:,.0f} MiB{est}")
        if swap:
            self.add(OK, "swap", f"{swap:,.0f} MiB of swap")
        elif self.arm:
            self.add(WARN, "swap", "no swap: a job that outgrows the RAM is killed; add zram (sudo apt install "
                                   "zram-tools, docs/board.md)")
        else:
            self.add(OK, "swap", "no swap (a PC: the board wants zram, docs/board.md)")

    # -- supervisord and the ports ---------------------------------------------------------------------------------

    def check_supervisord(self) -> None:
        from orchestrator.engine.supervisor import Supervisor, SupervisorError
        conf = self.rf.supervisord_conf
        try:
            sup = Supervisor(self.rf.supervisor_sock, timeout_s=2.0)
            state = sup.ping()
            self.add(OK, "supervisord", f"{state} on {self.rf.supervisor_sock}")
            self._check_always_on(sup)
            return
        except SupervisorError:
            self.add(WARN, "supervisord", f"not running for {self.rf.root}: start it with orchestrator --run {self.rf.root} "
                                                 f"start (supervisord -c {conf}, waited for)")
        port = 8188
        host = "127.0.0.1"
        if self.cfg is not None:
            http = self.cfg.settings("http")
            port, host = int(http.port), str(http.host)
        if port == 0:
            return
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                self.add(OK, "http-port", f"{host}:{port} is free for the HTTP front")
            except OSError as e:
                self.add(WARN, "http-port", f"{host}:{port} is taken ({e.strerror}): another program listens there; "
                                            "set [stage.http] port in pipeline.toml")

    def _check_always_on(self, sup) -> None:
        """The programs that stay up (scheduler, executor, the job daemon, the HTTP front): one that has stopped
        for good fails, named with supervisord's reason, its log's last line and the setting to look at."""
        from orchestrator.engine.runfolder import ALWAYS_ON_STAGES
        fixes = {"http": "the front's address is [stage.http] host and port in pipeline.toml (port = 0: any free one)"}
        infos = sup.all_info()
        for name in ALWAYS_ON_STAGES + ("orchestrator", "http"):
            info = infos.get(name)
            if info is None or info.state not in ("EXITED", "FATAL", "BACKOFF", "STOPPED"):
                continue
            log = self.rf.logs / f"{name}.log"
            lines = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
            why = "; ".join(x for x in (info.spawnerr, info.description, *lines) if x)
            fix = fixes.get(name, f"see {log}")
            self.add(FAIL, f"program-{name}", f"{name} is {info.state} ({why[:300]}): {fix}; then supervisorctl -c "
                                              f"{self.rf.supervisord_conf} start {name}")

    def run(self) -> list[Check]:
        for check in (self.check_config, self.check_run_folder, self.check_uploads, self.check_machine,
                      self.check_board_ram, self.check_npu,
                      self.check_governors, self.check_memory, self.check_packs, self.check_size_memory,
                      self.check_supervisord):
            try:
                check()
            except Exception as e:  # noqa: BLE001 - one broken check is its own line, never the doctor's end
                self.add(FAIL, check.__name__.removeprefix("check_"), f"the check itself failed: {e!r}")
        return self.checks


def summary(checks: list[Check]) -> str:
    n = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL)}
    return f"doctor ok={n[OK]} warn={n[WARN]} fail={n[FAIL]}"


def doctor(rf, full: bool = False, out=None) -> int:
    """Print every check and the summary line to `out` (stdout); -> 0 when nothing failed, else 1."""
    import sys
    out = out or sys.stdout
    checks = Doctor(rf, full).run()
    for c in checks:
        print(c.line(), file=out)
    print(summary(checks), file=out)
    return 1 if any(c.status == FAIL for c in checks) else 0


__all__ = ["Doctor", "doctor", "summary", "Check"]
