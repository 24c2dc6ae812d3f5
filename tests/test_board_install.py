"""The board's install: what a board stage imports never pulls torch/transformers/onnx; the extras fit the machines;
the rknn backend refuses a pack compiled by another toolkit release and says what to install.
(`make board-check` runs the whole job from a venv without torch; `make py310-check` runs these on Python 3.10.)"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
HOST_ONLY = ("torch", "transformers", "onnx", "sentencepiece", "diffusers", "safetensors")
# What the board's stage processes import (python -m stages.X, orchestrator serve/CLI) with their settings on the
# board: encoder on ONNX Runtime, executor on rknn, VAE on a VAE pack. The VAE stage is in the list when its pack
# backends are in the tree; without them it imports torch at start by design.
VAE_PACKS = importlib.util.find_spec("models.vae.pack_decoder") is not None
BOARD_MODULES = ("stages.scheduler", "stages.executor", "stages.encoder", "models.runtime.backends.rknn", "stages.config",
                 "orchestrator.terminal.cli", "orchestrator.engine.daemon", "orchestrator.engine.plan.run", "orchestrator.engine.prompt_spec",
                 "models.text.conditioning", "models.text.compute_onnx", "models.text.encoder_pack"
                 ) + (("stages.vae",) if VAE_PACKS else ())

BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: a board stage imported it")
sys.meta_path.insert(0, Block())
"""


def _run_blocked(code: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKER.format(blocked=HOST_ONLY) + textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def test_board_modules_import_without_host_packages(tmp_path):
    r = _run_blocked(f"""
        import importlib, sys
        for name in {BOARD_MODULES!r}:
            importlib.import_module(name)
        print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
        """, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]"


def test_blocker_has_teeth(tmp_path):
    r = _run_blocked("import models.text.compute_torch\n", tmp_path)
    assert r.returncode != 0 and "torch is blocked" in r.stderr


def test_onnx_encoder_stage_runs_without_host_packages(tiny_bundle, tmp_path):
    """The encoder stage's logic with backend "onnx" loads and encodes with torch & co. blocked."""
    from models.setup.models_dir import resolve_models
    from models.text.encoder_pack import build_encoder_pack
    p = resolve_models(tiny_bundle)
    pack = build_encoder_pack(p.text_encoder, p.dit, p.qwen_tokenizer, p.t5_tokenizer, tmp_path / "encpack")
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text(f'threads = 1\n[stage.encoder]\nbackend = "onnx"\npack = "{pack}"\n')
    r = _run_blocked(f"""
        import sys
        from stages.config import load_config
        from stages.encoder import EncoderLogic
        logic = EncoderLogic(load_config({str(cfg)!r}))
        ctx = logic.encoder.encode("1girl, (blue eyes:1.2)")
        assert ctx.shape == (512, logic.encoder.context_dim) and abs(ctx).sum() > 0
        print(logic.info()["backend"], sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
        """, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "onnx []"


# ---- packaging ------------------------------------------------------------------------------------------------------
def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, 1)[0].strip().lower()


def test_extras_fit_the_machines():
    proj = _pyproject()["project"]
    core = {_name(r): r for r in proj["dependencies"]}
    extras = proj["optional-dependencies"]
    assert not set(core) & set(HOST_ONLY), "a host-only package is a core dependency"
    assert {"onnxruntime", "tokenizers", "numpy", "pyzmq", "msgpack", "supervisor", "psutil", "setproctitle",
            "pillow", "aiohttp", "matplotlib"} <= set(core)
    assert "python_version < '3.11'" in core["tomli"].replace('"', "'")
    host = {_name(r): r for r in extras["host"]}
    assert host["torch"] == "torch==2.13.0" and host["transformers"] == "transformers>=5.0"
    assert {"onnx", "safetensors", "sentencepiece", "protobuf"} <= set(host)
    assert "anima-npu[host]" in extras["dev"]
    assert {"pytest", "hypothesis", "diffusers", "playwright", "webuiapi", "comfy-api-simplified",
            "websocket-client"} <= {_name(r) for r in extras["dev"]}
    (lite,) = extras["board"]
    assert lite.replace('"', "'") == f"rknn-toolkit-lite2=={_toolkit_pin()}; platform_machine == 'aarch64'"


def _toolkit_pin() -> str:
    """The rknn-toolkit2 release that compiles the packs (scripts/rknn_venv.sh)."""
    m = re.search(r'RKNN_VERSION="\$\{RKNN_VERSION:-([0-9.]+)\}"', (ROOT / "scripts" / "rknn_venv.sh").read_text())
    assert m, "scripts/rknn_venv.sh: RKNN_VERSION default not found"
    return m.group(1)


def test_lite_pin_equals_the_compiler_release():
    from models.runtime.backends.standin import rknnlite as rknnlite_standin
    assert rknnlite_standin.LITE_VERSION == _toolkit_pin()


# ---- the rknn backend's toolkit check -------------------------------------------------------------------------------
def test_rknn_backend_checks_the_pack_toolkit(rknn_pack, tmp_path, monkeypatch):
    """The real compiler recorded its release in the manifest; the (labelled) stand-in runtime reports the release it
    imitates: equal -> loads; another release or none -> a clear error naming what to install."""
    from models.runtime.backends.base import BackendError
    from models.runtime.backends import rknn
    from models.runtime.backends.standin import rknnlite as rknnlite_standin
    pack = tmp_path / "pack"
    shutil.copytree(rknn_pack[0], pack)
    manifest = json.loads((pack / "manifest.json").read_text())
    assert rknn._release(manifest["rknn"]["toolkit"]) == _toolkit_pin()
    branch = pack / manifest["branches"][0]["onnx"]
    monkeypatch.setattr(rknn, "_checked_packs", set())

    be = rknn.RknnLiteBackend(lite="standin")
    be.load(branch)                                   # same release: fine
    be.release()
    monkeypatch.setattr(rknn, "_checked_packs", set())
    monkeypatch.setattr(rknnlite_standin, "LITE_VERSION", "2.3.2")
    with pytest.raises(BackendError, match=re.escape(f"pip install 'rknn-toolkit-lite2=={_toolkit_pin()}'")) as e:
        rknn.RknnLiteBackend(lite="standin").load(branch)
    assert "rknn-toolkit-lite2 2.3.2 is installed" in str(e.value) and manifest["rknn"]["toolkit"] in str(e.value)
    monkeypatch.setattr(rknnlite_standin, "LITE_VERSION", None)
    with pytest.raises(BackendError, match="rknn-toolkit-lite2 is not installed"):
        rknn.RknnLiteBackend(lite="standin").load(branch)
    monkeypatch.setattr(rknnlite_standin, "LITE_VERSION", f"{_toolkit_pin()}+local")
    assert rknn.check_toolkit_version(pack, rknnlite_standin) == _toolkit_pin()
    del manifest["rknn"]["toolkit"]
    (pack / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BackendError, match="records no rknn-toolkit2 version"):
        rknn.check_toolkit_version(pack, rknnlite_standin)
