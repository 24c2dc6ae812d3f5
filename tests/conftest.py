"""Shared pytest fixtures: synthetic checkpoints and packs built once per run (both xdist workers share them)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _hash_memo_in_session(tmp_path_factory):
    """The sha256 memo (models/records/manifest.py) of the suite's processes and the stages they start in the session's own
    folder, not the user's cache folder."""
    import os
    from models.records.manifest import MEMO_ENV
    old = os.environ.get(MEMO_ENV)
    os.environ[MEMO_ENV] = str(tmp_path_factory.mktemp("hash_memo") / "sha256-memo.json")
    yield
    if old is None:
        os.environ.pop(MEMO_ENV, None)
    else:
        os.environ[MEMO_ENV] = old


@pytest.fixture(scope="session", autouse=True)
def _bytecode_cache_for_started_processes():
    """Where PYTHONDONTWRITEBYTECODE is set (as on the machine the suite's timings come from), every Python process a
    test starts (supervisord's stages, a daemon restarted after a kill, the CLI) compiled the project's modules from
    source at each start: ~0.2 CPU-s of a stage's or the daemon's start, most of a stand-in stage's. Those processes
    write and reuse the ordinary __pycache__ beside the sources (ignored by git; a .pyc is written atomically and
    checked against its source's mtime and size). Not PYTHONPYCACHEPREFIX: under a prefix every process would compile
    the standard library and the venv's packages again, whose .pyc files are already beside them."""
    import os
    old = os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    yield
    if old is not None:
        os.environ["PYTHONDONTWRITEBYTECODE"] = old


def run_shared(tmp_path_factory, name: str) -> Path:
    """The folder `name` of this run that every xdist worker sees (the parent of the workers' base folders; without
    xdist the session's own base folder): the session fixtures below build their assets there once per run, not once
    per worker, each under a lock (tests.pipeline_harness.locked) that the other worker waits on."""
    import os
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder = base / name
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory) -> Path:
    """A complete synthetic tiny models folder (ComfyUI layout, seed 0), written once per run (~4 s; run_shared);
    the pipelines of pipeline_assets run on it too. Treat as read-only (copy it to add LoRAs)."""
    from models.setup.models_dir import write_bundle
    out = run_shared(tmp_path_factory, "tiny_assets") / "models"
    write_bundle("tiny", 0, out)              # its own lock: the other worker waits, then finds it complete
    files = _listing(out)
    yield out
    assert _listing(out) == files, f"a test changed the shared tiny models folder {out} (copy it to change it)"


def _listing(folder: Path) -> dict:
    """{relative path: (size, mtime_ns)} of every file and folder under `folder`, but write_bundle's lock file (each
    idempotent call opens it for writing)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.name != ".anima-bundle.lock"}


@pytest.fixture(scope="session")
def tiny_dit(tiny_bundle) -> Path:
    """The tiny synthetic DiT + adapter (seed 0, prefix `net.`): the session bundle's DiT file (write_bundle writes it
    with models.dit.synth.write_dit, as `anima-models synth dit --preset tiny --seed 0 --prefix net.` does)."""
    from models.setup.models_dir import resolve_models
    return resolve_models(tiny_bundle, {}, need=("dit",)).dit


@pytest.fixture(scope="session")
def tiny_vae_files(tmp_path_factory) -> dict:
    """The tiny synthetic VAE (seed 0) in both key layouts ("orig": Wan's, "diff": diffusers') and diffusers'
    AutoencoderKLQwenImage with the same weights ("ref", its key names from diffusers' own Wan converter), for the
    decoder's and the encoder's tests. Treat as read-only."""
    pytest.importorskip("diffusers")
    import torch
    from diffusers import AutoencoderKLQwenImage
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    from models.base.safetensors_io import SafeTensorsFile
    from models.vae.synth import VAE_PRESETS, write_vae
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("vae")
    orig, diff = d / "tiny-orig.safetensors", d / "tiny-diff.safetensors"
    write_vae("tiny", 0, orig, "original")
    write_vae("tiny", 0, diff, "diffusers")
    st = SafeTensorsFile(orig)
    sd = convert_wan_vae_to_diffusers({k: torch.from_numpy(st.get(k)) for k in st.keys()})
    tiny = VAE_PRESETS["tiny"]
    ref = AutoencoderKLQwenImage(base_dim=tiny.base_dim, z_dim=tiny.z_dim).eval()
    ref.load_state_dict(sd, strict=True)
    return {"orig": orig, "diff": diff, "ref": ref}


@pytest.fixture(scope="session")
def rknn_venv() -> Path:
    """The rknn-toolkit2 environment (.venv-rknn), created by scripts/rknn_venv.sh when missing (~2 min, idempotent)."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    venv = root / ".venv-rknn"
    if not (venv / ".rknn-installed").is_file():
        subprocess.run(["bash", str(root / "scripts" / "rknn_venv.sh"), str(venv)], check=True)
    return venv


@pytest.fixture(scope="session")
def rknn_pack(tmp_path_factory, tiny_dit, rknn_venv):
    """The tiny pack at 128x128 (64 image tokens, FP16) with blocks 0 and 27 compiled by the real rknn-toolkit2
    (6 branches in one worker: a second would cost its own toolkit import, seconds of CPU; the sharded compiles in
    test_rknn_compile, test_quant and test_bundle run two jobs), once per run (run_shared: the worker that comes
    second reads the first one's report); -> (pack folder, compile report). Treat as read-only (copy it to change
    it)."""
    import json
    from models.base.durable import atomic_write
    from models.packs.pack import build_pack
    from models.rknn.compile import compile_pack
    from tests.pipeline_harness import locked
    shared = run_shared(tmp_path_factory, "rknn")
    pack, saved = shared / "pack128", shared / "compile-report.json"
    with locked(shared / ".rknn.lock"):
        if not saved.exists():
            build_pack(tiny_dit, pack, (128, 128), "fp16")
            report = compile_pack(pack, target="rk3588", jobs=1, venv=rknn_venv, blocks=[0, 27], per_worker=0)
            atomic_write(saved, json.dumps(report))
    return pack, json.loads(saved.read_text())


@pytest.fixture(scope="session")
def pipeline_assets(tiny_bundle) -> tuple:
    """(models folder, 128x128 FP16 pack) of tests.pipeline_harness.tiny_assets on the session's tiny bundle, the
    pack built once per run (beside tiny_bundle: run_shared) for the modules that run a pipeline on it; treat as
    read-only (more packs may be added beside it with tiny_assets(pack.parent, ...), which locks)."""
    from tests.pipeline_harness import tiny_assets
    return tiny_assets(tiny_bundle.parent)


@pytest.fixture(scope="session")
def board_stages(pipeline_assets) -> str:
    """The [stage.encoder]/[stage.vae] tables of the board's ONNX encoder and VAE for pipeline_assets' models
    (tests.pipeline_harness.board_stage_toml; the packs built once per run beside them, ~8 s)."""
    from tests.pipeline_harness import board_stage_toml
    models, pack = pipeline_assets
    return board_stage_toml(models, pack.parent)


@pytest.fixture(scope="session")
def default_pipeline(pipeline_assets):
    """One running pipeline with the default config (tests.pipeline_harness.Pipeline.start on pipeline_assets, one
    thread) for every module that needs nothing else (end-to-end jobs, the HTTP front, the soak): started once per
    test worker instead of once per module. A test that kills or restarts a program leaves it to supervisord and
    the orchestrator to bring back, as in a real run; every user checks changes against its own before/after, never
    against a fresh pipeline's counters. Stopped clean at the end: no process outlives supervisord, no segment left."""
    from tests.pipeline_harness import Pipeline
    models, pack = pipeline_assets
    p = Pipeline.start(models, pack, threads=1)
    try:
        p.http_url()
        yield p
    finally:
        p.stop_clean()


@pytest.fixture(scope="session")
def board_pipeline(pipeline_assets, board_stages):
    """One running pipeline with the board's stage set (encoder and VAE on ONNX Runtime: board_stages) and otherwise
    the default config, for the modules whose subject is not the torch stages (the soak's always-on stages, the HTTP
    front with third-party clients): a tiny job costs ~2 CPU-s there against ~9 with torch + transformers starting
    per job. Shared and stopped as default_pipeline is."""
    from tests.pipeline_harness import Pipeline
    models, pack = pipeline_assets
    p = Pipeline.start(models, pack, threads=1, extra_toml=board_stages)
    try:
        p.http_url()
        yield p
    finally:
        p.stop_clean()


@pytest.fixture
def inproc_daemon(tmp_path):
    """A run folder (tmp_path/run) on a 64x64 manifest-only pack with its job daemon in this process
    (tests.inproc.InprocClient): `cli.main(argv, connect=client.connect)` runs the job commands against the
    daemon's own queue and checks, no pipeline started (so no job runs)."""
    with open_inproc_daemon(tmp_path) as client:
        yield client


@contextlib.contextmanager
def open_inproc_daemon(tmp_path, pack_hook=None):
    """inproc_daemon's run folder and client; `pack_hook(pack_dir)` changes the pack before the daemon reads it."""
    import sys
    from tests.inproc import InprocClient
    from orchestrator.engine.runfolder import init_run
    from tests.doubles_harness import fake_pack
    rf = init_run(tmp_path / "run", python=sys.executable)
    pack = fake_pack(tmp_path / "pack")
    if pack_hook is not None:
        pack_hook(pack)
    rf.pipeline_toml.write_text(f'run_dir = "."\npack_dir = "{pack}"\nthreads = 1\n')
    client = InprocClient.open(rf)
    try:
        yield client
    finally:
        client.shut()


# The modules that take longest (each module's wall time in a `make test` run on 2 workers, longest first), run
# first: `make test` hands whole modules to two workers (pytest-xdist --dist loadfile --no-loadscope-reorder: without
# that flag xdist reorders the modules by their number of tests, and a long module started last leaves the other
# worker idle at the end). Modules not listed (under 8 s) keep their order after these.
LONGEST_FIRST = ("test_board_check.py", "test_chaos.py", "test_e2e_pipeline.py", "test_hardening_pipeline.py",
                 "test_samplers_comfy_model.py", "test_quant.py", "test_lora_pipeline.py", "test_http_doubles.py",
                 "test_cookbook.py", "test_demo.py", "test_cli_commands.py", "test_img2img_pipeline.py",
                 "test_hires_flow.py", "test_stage_processes.py", "test_orchestrator_flow.py", "test_bundle.py",
                 "test_orchestrator_hardening.py",
                 "test_http_page.py", "test_batch_flow.py", "test_shards.py", "test_long_context.py",
                 "test_rknn_backend.py", "test_rknn_compile.py", "test_http_settings.py", "test_lifecycle.py",
                 "test_policies_pipeline.py", "test_daily_use.py", "test_img2img_flow.py",
                 "test_lora_comfy_model.py", "test_vae_rknn.py", "test_http_front.py", "test_lora_pack.py",
                 "test_forward_verify.py", "test_soak.py", "test_step_cache.py", "test_board_sim.py",
                 "test_remote_executor.py", "test_board_calibrate.py", "test_remote_stage.py", "test_remote_e2e.py",
                 "test_pack.py", "test_stage_hardening.py", "test_board_model.py", "test_vae_pack.py",
                 "test_lora_rknn.py", "test_start_checks.py", "test_samplers_comfy_toy.py", "test_wheel_install.py",
                 "test_img2img_sampling.py", "test_supervisor_ctl.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))      # stable: a module's tests stay together
