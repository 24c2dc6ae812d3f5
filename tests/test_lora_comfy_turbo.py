"""The Turbo-form LoRA, a LoKr and a LoHa on a real (synthetic small) DiT against ComfyUI's own pictures: each through
LoraLoaderModelOnly at cfg 1, 8 steps (the Turbo LoRA's settings), run time through a rank-16 LoRA-ready FP32 pack
and baked into a pack.

tests/data/lora/comfy_small_turbo.npz (bench/lora_comfy_reference.py --case none --case turbo --case lokr --case loha
--cfg 1 --steps 8 --record, see tests/data/lora/README.md) holds ComfyUI's final latents and this project's
conditioning; this test makes the DiT again from the recorded key list, the same synthetic LoRAs, and samples as the
scheduler does (DiTRunner.set_lora, the pipeline's Euler sampler)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from models.lora import LoraUse, TargetTable, plan_loras
from models.sampling.noise import comfy_noise
from tests.pipeline_harness import reference_runner

REC = np.load(Path(__file__).parent / "data" / "lora" / "comfy_small_turbo.npz")
JOB = json.loads(str(REC["job"]))
CASES = ("turbo", "lokr", "loha")
CONTEXT_ROWS = 512


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from models.dit.config import expected_dit_shapes
    from models.dit.synth import dit_entries
    from models.lora.synth import write_lora
    from models.packs.pack import build_pack
    from models.base.safetensors_io import write_safetensors
    d = tmp_path_factory.mktemp("small_turbo")
    write_safetensors(d / "anima-small.safetensors", dit_entries(JOB["dit_shapes"], 0, prefix="net."))
    for case in CASES:
        (name, _, _, _), = JOB["cases"][case]
        layout, seed, rank, alpha, groups = JOB["loras"][name]
        write_lora((JOB["dit_shapes"], None), seed, d / name, layout, rank, alpha, tuple(groups))
    pack = build_pack(d / "anima-small.safetensors", d / "pack", tuple(JOB["size"]), "fp32", lora_rank=16)
    # one thread: `make test` runs two workers on two cores, where ONNX Runtime's default (a spinning thread per
    # core) costs ~1.5x the CPU of one thread for the same numbers
    runner = reference_runner(pack, threads=1)
    yield runner, d, TargetTable(expected_dit_shapes(runner.cfg))
    runner.close()


def _uses(d, case) -> list:
    return [LoraUse(str(d / name), sm, 0.0, name) for name, _, sm, _ in JOB["cases"][case]]


def _sample(runner, case) -> np.ndarray:
    """The case's job as the scheduler samples it (models.sampling.denoise.model_call): at cfg 1 the conditional pass
    alone, as ComfyUI runs it (no unconditional pass at cfg 1)."""
    from models.sampling.denoise import model_call
    from models.sampling.sampler import Sampler
    ctx = {}
    for which in ("cond", "uncond"):
        rows = REC[f"{which}/{case}"]
        ctx[which] = np.zeros((CONTEXT_ROWS, rows.shape[1]), np.float32)       # [512, 1024] f32
        ctx[which][:rows.shape[0]] = rows
    w, h = JOB["size"]
    s = Sampler(steps=JOB["steps"], cfg=JOB["cfg"], scheduler=JOB["scheduler"], spectrum=None)
    assert s.passes == 1
    return s.sample(lambda x, sigma: model_call(runner, s, x, sigma, ctx["cond"], ctx["uncond"]),
                    latent=comfy_noise(JOB["seed"], (16, h // 8, w // 8))).latent.astype(np.float64).ravel()


def _cos(a, b) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_turbo_lokr_loha_at_run_time_equal_comfyui(small):
    runner, d, table = small
    assert (JOB["cfg"], JOB["steps"]) == (1.0, 8)
    none = REC["comfyui/none"].astype(np.float64).ravel()
    for case in CASES:
        runner.set_lora(plan_loras(_uses(d, case), table))
        got, want = _sample(runner, case), REC[f"comfyui/{case}"].astype(np.float64).ravel()
        assert _cos(got, want) >= 0.99999, f"{case}: cosine {_cos(got, want):.9f} with ComfyUI's"
        assert _cos(got, none) < 0.999, case                  # the comparison can fail: no LoRA lands far off


def test_a_baked_loha_equals_comfyui(small, tmp_path):
    from models.packs.pack import build_pack
    _, d, _ = small
    pack = build_pack(d / "anima-small.safetensors", tmp_path / "baked", tuple(JOB["size"]), "fp32",
                      loras=_uses(d, "loha"))
    baked = reference_runner(pack, threads=1)
    try:
        got = _sample(baked, "loha")
    finally:
        baked.close()
    assert _cos(got, REC["comfyui/loha"].astype(np.float64).ravel()) >= 0.99999
