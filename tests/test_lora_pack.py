"""LoRA through a pack: a LoRA-ready FP32 pack with run-time low-rank inputs computes what the checkpoint with the
LoRA merged computes (the torch reference on a merged file), a LoRA-ready pack without a LoRA what a plain pack
computes, a baked pack what the run-time LoRA computes; rank limits, SVD reduction, and the CLI."""
from __future__ import annotations

import numpy as np
import pytest

from models.commands import cli
from models.dit.config import expected_dit_shapes
from models.dit.checkpoint import DiTCheckpoint
from models.runtime.dit_runner import DiTRunner
from models.lora import LoraError, LoraUse, TargetTable, plan_loras
from models.lora.merged_file import write_merged
from models.lora.synth import write_lora
from models.packs.pack import build_pack, load_pack
from models.dit.partition import branch_inputs, BY_KIND
from models.dit.reference import reference_forward
from models.runtime.verify import metrics, random_inputs

RES = (64, 64)                     # 16 image tokens: every structural choice, little time
THREADS = 1                        # every runner here and the forward command: the bitwise comparisons hold at one
                                   # thread count, and a second ONNX Runtime thread only spins on graphs this small


def _cos(a, b) -> float:
    return metrics(a, b)["cos"]


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    kohya, comfy = d / "kohya.safetensors", d / "comfy.safetensors"
    write_lora("tiny", 7, kohya, "kohya", rank=8, alpha=3.0, groups=("blocks", "host", "adapter"))  # alpha != rank
    write_lora("tiny", 8, comfy, "comfy", rank=4, alpha=None, groups=("blocks",))
    return {"kohya": kohya, "comfy": comfy}


@pytest.fixture(scope="module")
def packs(tiny_dit, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_packs")
    return {"plain": build_pack(tiny_dit, d / "plain", RES, "fp32"),
            "ready": build_pack(tiny_dit, d / "ready", RES, "fp32", lora_rank=12)}


@pytest.fixture(scope="module")
def inputs(packs):
    x, ctx = random_inputs(load_pack(packs["plain"]), seed=5)
    return x, 0.7, ctx


@pytest.fixture(scope="module")
def v_plain(packs, inputs):
    return DiTRunner(packs["plain"], threads=THREADS).forward(*inputs)


@pytest.fixture(scope="module")
def ready(packs):
    """One runner over the LoRA-ready pack, its LoRAs set per test (as the scheduler keeps one per pack)."""
    return DiTRunner(packs["ready"], threads=THREADS)


def _plan(uses, ckpt_cfg):
    return plan_loras(uses, TargetTable(expected_dit_shapes(ckpt_cfg)))


def test_a_lora_ready_pack_without_a_lora_is_the_plain_pack(packs, inputs, v_plain, ready):
    pack = load_pack(packs["ready"])
    assert pack.geometry.lora_rank == 12 and pack.manifest["lora"] == {"rank": 12, "baked": []}
    names = [i["name"] for i in pack.branch(0, "self")["inputs"]]
    assert names[:3] == ["xn", "rope_cos", "rope_sin"] and "lora_self_q_b1" in names and len(names) == 3 + 10
    assert [i["shape"] for i in pack.branch(3, "ffn")["inputs"] if i["name"].startswith("lora_ffn_fc2")] == \
        [[1024, 12], [12, 256]]
    ready.set_lora(None)
    assert np.array_equal(v_plain, ready.forward(*inputs))       # the added terms are exact zeros


@pytest.mark.parametrize("which", [("kohya",), ("kohya", "comfy")])   # both layouts; alpha != rank
def test_run_time_lora_equals_the_checkpoint_with_the_lora_merged(tiny_dit, ready, loras, inputs, v_plain, tmp_path,
                                                                  which):
    ckpt = DiTCheckpoint.open(tiny_dit)
    strengths = {"kohya": 0.8, "comfy": -0.6}
    uses = [LoraUse(str(loras[w]), strengths[w]) for w in which]
    plan = _plan(uses, ckpt.config)
    runner = ready
    applied = runner.set_lora(plan)
    assert applied.report()["max_branch_rank"] == sum({"kohya": 8, "comfy": 4}[w] for w in which)
    v = runner.forward(*inputs)
    merged = tmp_path / "merged.safetensors"
    full = plan_loras(uses, TargetTable({k: ckpt.shape(k) for k in ckpt.keys()}))   # adapter layers included
    write_merged(tiny_dit, full, merged)
    v_ref = reference_forward(DiTCheckpoint.open(merged), *inputs)
    assert _cos(v, v_ref) >= 0.99999
    assert _cos(v_plain, v_ref) < 0.9999                         # the LoRA changes the prediction by far more
    if len(which) == 2:
        runner.set_lora(None)                                    # and it comes off again, nothing reloaded
        assert np.array_equal(runner.forward(*inputs), v_plain)


def test_a_baked_pack_computes_what_the_run_time_lora_does(tiny_dit, ready, loras, inputs, tmp_path):
    use = LoraUse(str(loras["kohya"]), 0.8)
    baked = build_pack(tiny_dit, tmp_path / "baked", RES, "fp32", loras=[use])
    m = load_pack(baked).manifest["lora"]
    assert m["rank"] == 0 and m["baked"][0]["strength"] == 0.8 and m["baked"][0]["layers"]["branch"] == 280
    runner = ready
    runner.set_lora(_plan([use], runner.cfg))
    assert _cos(DiTRunner(baked, threads=THREADS).forward(*inputs), runner.forward(*inputs)) >= 0.999999


def test_rank_limits(packs, ready, loras, inputs):
    both = [LoraUse(str(loras["kohya"])), LoraUse(str(loras["comfy"]))]
    plain = DiTRunner(packs["plain"], threads=THREADS)
    with pytest.raises(LoraError, match="takes no LoRA at run time: build it with `anima-models pack ... --lora-rank"):
        plain.set_lora(_plan(both, plain.cfg))
    three = both + [LoraUse(str(loras["comfy"]), 0.5)]          # 8 + 4 + 4 = 16 > 12
    with pytest.raises(LoraError, match="stacked LoRA rank 16 exceeds the pack's LoRA rank 12 in 280 layers"):
        ready.set_lora(_plan(three, ready.cfg))
    applied = ready.set_lora(_plan(three, ready.cfg), overflow="svd")
    v = ready.forward(*inputs)
    rep = applied.report()["svd_reduced"]
    assert rep["layers"] == 280 and rep["max_rank"] == 16 and 0 < rep["max_relative_error"] < 1
    assert np.isfinite(v).all()


def test_lora_inputs_are_declared_in_the_partition_table():
    for kind, n in (("self", 10), ("cross", 8), ("ffn", 4)):
        spec = BY_KIND[kind]
        lora = [i for i in spec.inputs if i.lora]
        assert len(lora) == n and all(i.lifetime == "branch" for i in lora)
        from models.dit.partition import Geometry
        assert not any(i.lora for i in branch_inputs(spec, Geometry.from_resolution(64, 64)))
        assert len(branch_inputs(spec, Geometry.from_resolution(64, 64, lora_rank=4))) == len(spec.inputs) - \
            (kind == "cross")                                    # the long-context mask stays out


def test_forward_and_pack_commands_take_loras(tiny_dit, packs, ready, loras, inputs, tmp_path, capsys):
    x, sigma, ctx = inputs
    np.savez(tmp_path / "in.npz", x=x, sigma=np.float32(sigma), context=ctx)
    out = tmp_path / "out.npz"
    assert cli.main(["forward", str(packs["ready"]), "--inputs", str(tmp_path / "in.npz"), "--output", str(out),
                     "--lora", f"{loras['kohya']}:0.8", "--threads", str(THREADS)]) == 0
    text = capsys.readouterr().out
    assert "LoRA kohya.safetensors x 0.8: {'branch': 280, 'host': 174}" in text
    assert "not part of a DiT forward: {'adapter': 60}" in text
    ready.set_lora(_plan([LoraUse(str(loras["kohya"]), 0.8)], ready.cfg))
    assert np.array_equal(np.load(out)["v"], ready.forward(*inputs))
    assert cli.main(["forward", str(packs["plain"]), "--inputs", str(tmp_path / "in.npz"), "--output", str(out),
                     "--lora", str(loras["kohya"])]) == 2
    assert "takes no LoRA at run time" in capsys.readouterr().err
    assert cli.main(["pack", str(tiny_dit), "--out", str(tmp_path / "p"), "--resolution", "64x64", "--dtype", "fp32",
                     "--lora-rank", "4", "--lora", f"{loras['comfy']}:0.5"]) == 0
    assert "LoRA rank 4, baked LoRA comfy.safetensors x 0.5" in capsys.readouterr().out
