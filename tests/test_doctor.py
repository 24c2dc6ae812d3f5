"""`orchestrator doctor` on fake /proc and /sys trees (models.runtime.probes' paths pointed at tmp folders): each check's ok,
warn and fail line with its fix, the summary line and the exit code."""
from __future__ import annotations

import io
import os
import shutil

import pytest

from models.runtime import probes
from orchestrator.terminal import cli
from orchestrator.ops.doctor import doctor
from orchestrator.engine.runfolder import RunFolder

SIZE = (64, 64)


@pytest.fixture(scope="module")
def bundle(tiny_bundle):
    """A --target none bundle at 64x64 of the session's tiny models: the run's one build of it
    (tests.pipeline_harness.cpu_bundle; tests/test_daily_use.py runs its VAE pack). Read-only: tests copy it to
    change it."""
    from tests.pipeline_harness import cpu_bundle
    return cpu_bundle(tiny_bundle, tiny_bundle.parent, SIZE)[0]


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """An empty fake machine: no device tree, devfreq, cpufreq, runtime library or debugfs; a PC's meminfo."""
    root = tmp_path / "fake"
    for name, rel in (("DEVICE_TREE_COMPATIBLE", "proc/device-tree/compatible"), ("DEVFREQ", "sys/class/devfreq"),
                      ("CPUFREQ", "sys/cpufreq"), ("MEMINFO", "proc/meminfo"),
                      ("RKNPU_VERSION", "sys/kernel/debug/rknpu/version")):
        monkeypatch.setattr(probes, name, str(root / rel))
    monkeypatch.setattr(probes, "LIB_DIRS", (str(root / "usr/lib"),))
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    put(root, "proc/meminfo", "MemTotal: 16000000 kB\nMemAvailable: 12000000 kB\nSwapTotal: 0 kB\nSwapFree: 0 kB\n")
    return root


def put(root, rel, text) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def run_doctor(rf, full=False) -> tuple:
    out = io.StringIO()
    rc = doctor(rf, full=full, out=out)
    lines = out.getvalue().splitlines()
    return rc, {ln.split(":")[0].split(" ", 1)[1]: ln for ln in lines[:-1]}, lines[-1]


def init(tmp_path, bundle, name="run") -> RunFolder:
    assert cli.main(["--run", str(tmp_path / name), "init", "--bundle", str(bundle)]) == 0
    return RunFolder.resolve(tmp_path / name)


def test_a_cpu_bundle_on_a_pc_is_ready(tree, tmp_path, bundle):
    rc, lines, last = run_doctor(init(tmp_path, bundle))
    assert rc == 0 and last.startswith("doctor ok=") and last.endswith(" fail=0"), (lines, last)
    assert lines["machine"].startswith("ok machine: x86_64 (not an RK3588): the NPU checks do not apply")
    assert lines["npu"].startswith("ok npu: does not apply")
    assert lines["governors"] == "ok governors: does not apply: no devfreq or cpufreq here"
    assert lines["sizes"] == "ok sizes: every DiT size has its VAE pack: 64x64"
    assert lines["memory"].startswith("ok memory: MemAvailable 11,719 MiB, a job needs about ")
    assert "ESTIMATED" in lines["memory"]
    assert lines["supervisord"].startswith("warn supervisord: not running") and "supervisord -c" in \
        lines["supervisord"]
    assert lines["config"].startswith("ok config:") and lines["run-folder"].startswith("ok run-folder:")


def test_doctor_shows_the_uploads_size_against_their_quota(tree, tmp_path, bundle):
    """Issue 45 item 6: the upload folders' size, a warning near stage.http.max_uploads_mb."""
    rf = init(tmp_path, bundle)
    put(rf.root, "input/page/a.png", "x" * 600_000)
    put(rf.root, "temp/a1111/b.png", "y" * 400_000)
    rc, lines, _ = run_doctor(rf)
    assert lines["uploads"] == (f"ok uploads: 2 file(s), 1 MB in {rf.root}/input, temp, output "
                                "(stage.http.max_uploads_mb = 2048)"), lines
    text = rf.pipeline_toml.read_text().replace("# max_uploads_mb = 2048", "max_uploads_mb = 1")
    rf.pipeline_toml.write_text(text)
    rc, lines, last = run_doctor(rf)
    assert lines["uploads"].startswith("warn uploads: 2 file(s), 1 MB in ") and "max_uploads_mb = 1 " in \
        lines["uploads"] and "orchestrator prune --older-than" in lines["uploads"], lines["uploads"]
    assert last.endswith(" fail=0")


def test_board_governors_memory_and_swap(tree, tmp_path, bundle, monkeypatch):
    rf = init(tmp_path, bundle)
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    put(tree, "proc/device-tree/compatible", "radxa,rock-5b\x00rockchip,rk3588\x00")
    put(tree, "sys/class/devfreq/dmc/governor", "dmc_ondemand\n")
    put(tree, "sys/class/devfreq/fdab0000.npu/governor", "rknpu_ondemand\n")
    put(tree, "sys/cpufreq/policy0/scaling_governor", "powersave\n")
    put(tree, "proc/meminfo", "MemAvailable: 200000 kB\nSwapTotal: 0 kB\nSwapFree: 0 kB\n")
    rc, lines, last = run_doctor(rf)
    assert lines["machine"] == "ok machine: radxa,rock-5b, rockchip,rk3588 (aarch64)"
    assert lines["dram-governor"] == ("warn dram-governor: dmc: dmc_ondemand (DRAM runs slow between bursts): echo "
                                      f"performance | sudo tee {tree}/sys/class/devfreq/dmc/governor")
    assert lines["npu-governor"].startswith("warn npu-governor: fdab0000.npu: rknpu_ondemand: echo performance")
    assert lines["cpu-governor"].startswith("warn cpu-governor: policy0: powersave: host ops run slow")
    assert lines["memory"].startswith("warn memory: MemAvailable 195 MiB, a job needs about")
    assert "zram-tools" in lines["memory"] and "zram-tools" in lines["swap"]
    assert lines["swap"].startswith("warn swap: no swap")
    assert rc == 0 and last.endswith(" fail=0")                       # warnings do not fail
    put(tree, "sys/class/devfreq/dmc/governor", "performance\n")
    put(tree, "sys/class/devfreq/fdab0000.npu/governor", "performance\n")
    put(tree, "sys/cpufreq/policy0/scaling_governor", "schedutil\n")
    put(tree, "proc/meminfo", "MemAvailable: 7000000 kB\nSwapTotal: 4000000 kB\nSwapFree: 4000000 kB\n")
    rc, lines, last = run_doctor(rf)
    assert lines["dram-governor"] == "ok dram-governor: dmc: performance"
    assert lines["npu-governor"] == "ok npu-governor: fdab0000.npu: performance"
    assert lines["cpu-governor"] == "ok cpu-governor: policy0: schedutil"
    assert lines["memory"].startswith("ok memory: MemAvailable 6,836 MiB")
    assert lines["swap"] == "ok swap: 3,906 MiB of swap"
    assert rc == 0 and " warn=1 " in last                             # supervisord is down


def test_npu_checks_on_a_machine_without_the_runtime(tree, tmp_path, bundle, monkeypatch):
    """A config whose executor runs on the NPU, on a machine that is not an RK3588 and has no runtime."""
    monkeypatch.delenv("ANIMA_RKNN_STANDIN", raising=False)
    rf = init(tmp_path, bundle)
    text = rf.pipeline_toml.read_text().replace('backend = "onnx"     # the executor', 'backend = "rknn"  # the')
    rf.pipeline_toml.write_text(text)
    rc, lines, last = run_doctor(rf)
    assert rc == 1 and not last.endswith(" fail=0")
    assert lines["machine"].startswith("fail machine: x86_64, not an RK3588 (no device tree)")
    # a PC is no board: its own RAM (16 GB here) is not read, the 8 GB board is assumed
    assert lines["board-ram"].startswith("ok board-ram: 8 GB board (assumed: board_ram_gb not set and not on the "
                                         "RK3588 board)"), lines["board-ram"]
    assert lines["npu-driver"].startswith("warn npu-driver: cannot read") and "sudo" in lines["npu-driver"]
    assert lines["librknnrt"].startswith("fail librknnrt: librknnrt.so is in none of")
    assert "rknpu2/runtime/Linux/librknn_api/aarch64/librknnrt.so" in lines["librknnrt"]
    assert lines["rknn-runtime"].startswith("fail rknn-runtime: rknn backend: cannot import rknnlite.api")
    put(tree, "usr/lib/librknnrt.so", "")
    put(tree, "proc/device-tree/compatible", "rockchip,rk3588\x00")
    put(tree, "sys/kernel/debug/rknpu/version", "RKNPU driver: v0.9.8\n")
    monkeypatch.setenv("ANIMA_RKNN_STANDIN", "1")
    rc, lines, last = run_doctor(rf)
    assert lines["machine"].startswith("ok machine: rockchip,rk3588")
    # on the board its MemTotal (16,000,000 kB = 15.26 GiB: the 16 GB board) is read and used
    assert lines["board-ram"].startswith("ok board-ram: 16 GB board (read: MemTotal 15.26 GiB)"), lines["board-ram"]
    assert lines["librknnrt"] == f"ok librknnrt: {tree}/usr/lib/librknnrt.so"
    assert lines["npu-driver"] == "ok npu-driver: RKNPU driver 0.9.8"
    # the CPU bundle's packs were never compiled: the runtime has nothing to match
    assert lines["rknn-runtime"].startswith("fail rknn-runtime: the DiT packs record no rknn-toolkit2 version")
    assert rc == 1


def test_pack_problems_and_sizes(tree, tmp_path, bundle):
    b = tmp_path / "b"
    shutil.copytree(bundle, b, copy_function=os.link)
    rf = init(tmp_path, b)
    assert run_doctor(rf)[0] == 0
    host = b / "dit-64x64" / "host.safetensors"
    data = bytearray(host.read_bytes())
    data[-1] ^= 1
    host.unlink()
    host.write_bytes(bytes(data))                       # same size: only --full sees it
    assert run_doctor(rf)[0] == 0
    rc, lines, _ = run_doctor(rf, full=True)
    assert rc == 1 and lines["dit-pack"].startswith("fail dit-pack: ") and "host.safetensors (sha256 differs" in \
        lines["dit-pack"]
    shutil.rmtree(b / "vae-64x64")
    rc, lines, last = run_doctor(rf)
    assert rc == 1 and lines["vae-pack"].startswith("fail vae-pack: ") and "no such VAE pack folder" in \
        lines["vae-pack"]
    assert lines["sizes"].startswith("fail sizes: no VAE pack for 64x64: a job of that size would be refused")
    for f in (b / "encoder").glob("*.onnx"):
        f.unlink()
    rc, lines, _ = run_doctor(rf)
    assert lines["encoder-pack"].startswith("fail encoder-pack: ")


def test_config_and_run_folder_failures(tree, tmp_path, bundle, capsys):
    rf = init(tmp_path, bundle)
    rf.pipeline_toml.write_text(rf.pipeline_toml.read_text() + "\n[stage.executor]\npolicy = 3\n")
    rc, lines, last = run_doctor(rf)
    assert rc == 1 and lines["config"].startswith("fail config: ") and "pipeline.toml" in lines["config"]
    os.chmod(rf.root, 0o755)
    rc, lines, _ = run_doctor(rf)
    assert lines["run-folder"].startswith("fail run-folder: ") and "must be 0700" in lines["run-folder"]
    os.chmod(rf.root, 0o700)
    empty = RunFolder.resolve(tmp_path / "none")
    rc, lines, _ = run_doctor(empty)
    assert rc == 1 and "does not exist: orchestrator --run" in lines["config"] and "init --bundle" in \
        lines["config"]
    capsys.readouterr()
    assert cli.main(["--run", str(rf.root), "doctor"]) == 1          # the command's exit status is the doctor's
    assert capsys.readouterr().out.splitlines()[-1].startswith("doctor ok=")


def test_a_program_that_stopped_for_good_fails_naming_why(tree, tmp_path, bundle, monkeypatch):
    """Reported: with ComfyUI on the front's port, doctor said fail=0 while the front had EXITED. supervisord's own
    states are read (a stand-in for its XML-RPC answer here): a stopped always-on program fails with its reason,
    its log's last line and the setting to look at."""
    from orchestrator.engine import supervisor
    rf = init(tmp_path, bundle)
    rf.logs.mkdir(exist_ok=True)
    (rf.logs / "http.log").write_text("starting\nOSError: [Errno 98] address already in use: 127.0.0.1:8188\n")

    def proc(name, state):
        return supervisor.ProcInfo(name, state, 0 if state != "RUNNING" else 42, 1, "Exited too quickly", "", 0.0)

    class FakeSupervisor:
        def __init__(self, *a, **kw):
            pass

        def ping(self):
            return "RUNNING"

        def all_info(self):
            return {n: proc(n, "FATAL" if n == "http" else "RUNNING")
                    for n in ("scheduler", "executor", "orchestrator", "http")}
    monkeypatch.setattr(supervisor, "Supervisor", FakeSupervisor)
    rc, lines, last = run_doctor(rf)
    assert rc != 0 and last.endswith(" fail=1"), (lines, last)
    line = lines["program-http"]
    assert line.startswith("fail program-http: http is FATAL (Exited too quickly; ") and "address already in use" in line
    assert "[stage.http] host and port in pipeline.toml" in line and "start http" in line
    assert "program-scheduler" not in lines
