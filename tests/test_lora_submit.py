"""A job's LoRAs at submit (orchestrator/engine/loras.py through the daemon's SUBMIT handler, no stages): every malformed or
unfitting file is refused naming its field in prompt.json and what is wrong, nothing is queued, and the daemon answers
the next request; a good one is queued with its LoRAs."""
from __future__ import annotations


import numpy as np
import pytest

from models.lora.choice import LoraChoice
from models.lora.synth import write_lora
from models.base.safetensors_io import TensorEntry, write_safetensors
from protocol import messages as m
from protocol.prompt import PromptError, PromptFile
from tests.inproc import daemon_with_loras


def _write(path, tensors: dict):
    write_safetensors(path, [TensorEntry(k, "F32", tuple(np.shape(v)), np.asarray(v, np.float32))
                             for k, v in tensors.items()])


def _write_loras(loras) -> None:
    """LoRAs good and bad: a kohya file, a text-encoder-only one, a cut one, one of the wrong width, an SDXL one, one
    with a module the DiT has not, a LoHa missing its second pair."""
    write_lora("tiny", 41, loras / "good.safetensors", "kohya", rank=8, alpha=4.0, groups=("blocks", "adapter", "te"))
    write_lora("tiny", 42, loras / "te_only.safetensors", "comfy", rank=4, groups=("adapter", "te"))
    (loras / "cut.safetensors").write_bytes((loras / "good.safetensors").read_bytes()[:2000])
    q, sd = "lora_unet_blocks_0_self_attn_q_proj", "lora_unet_down_blocks_1_attentions_0_proj_in"
    _write(loras / "shape.safetensors", {f"{q}.lora_up.weight": np.ones((512, 4)),
                                         f"{q}.lora_down.weight": np.ones((4, 512))})           # tiny's q is 256 wide
    _write(loras / "sdxl.safetensors", {f"{sd}.lora_up.weight": np.ones((8, 2)),
                                        f"{sd}.lora_down.weight": np.ones((2, 8))})
    _write(loras / "unknown.safetensors", {"lora_unet_blocks_0_mlp_layer9.lora_up.weight": np.ones((1024, 2)),
                                           "lora_unet_blocks_0_mlp_layer9.lora_down.weight": np.ones((2, 256)),
                                           "lora_unet_blocks_0_mlp_layer1.lora_up.weight": np.ones((1024, 2)),
                                           "lora_unet_blocks_0_mlp_layer1.lora_down.weight": np.ones((2, 256))})
    _write(loras / "loha.safetensors", {"lora_unet_blocks_0_mlp_layer1.hada_w1_a": np.ones((1024, 2)),
                                        "lora_unet_blocks_0_mlp_layer1.hada_w1_b": np.ones((2, 256))})


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, pipeline_assets):
    """A daemon over a copy of the tiny models folder with LoRAs good and bad under loras/ (the plain 128x128 pack)."""
    with daemon_with_loras(tmp_path_factory.mktemp("lora_submit"), pipeline_assets, _write_loras) as got:
        yield got


def _submit(d, root, loras) -> m.Message:
    prompt = {"prompt": "1girl", "seed": 1, "steps": 2, "loras": loras}
    return d.handle(m.Submit(prompt=PromptFile.from_data(prompt), base_dir=str(root)))


def test_malformed_and_unfitting_loras_are_refused_naming_the_field(daemon):
    d, root = daemon
    pack = str(d.packs[(128, 128)].dir)
    cases = [
        ([{"name": "cut.safetensors"}], "loras[0]", "truncated"),
        ([{"name": "good.safetensors"}, {"name": "shape.safetensors"}], "loras[1]", "a LoRA for another size of model"),
        ([{"name": "sdxl.safetensors"}], "loras[0]", "looks like a LoRA for Stable Diffusion"),
        ([{"name": "unknown.safetensors"}], "loras[0]", "match no layer of Anima: 'lora_unet_blocks_0_mlp_layer9'"),
        ([{"name": "loha.safetensors"}], "loras[0]", "LoHa"),
        ([{"name": "../loras/good.safetensors"}], "loras[0].name", "outside loras/"),
        ([{"name": "missing"}], "loras[0].name", "there are: cut.safetensors, good.safetensors"),
        ([{"name": "good.safetensors"}], "loras", f"model pack {pack} (128x128): the LoRAs update"),
    ]
    for loras, field, words in cases:
        reply = _submit(d, root, loras)
        assert isinstance(reply, m.Error) and reply.code == "bad_request", (loras, reply)
        assert reply.field == field and words in reply.message, (loras, reply.message)
        assert f"field '{field}'" in reply.message
    assert d.store.pending() == []                                   # nothing was queued
    with pytest.raises(PromptError) as e:                           # a strength out of range: the record's own check
        PromptFile.from_data({"prompt": "1girl", "loras": [{"name": "good.safetensors", "clip_strength": -101}]})
    assert e.value.field == "loras[0].clip_strength" and "[-100.0, 100.0]" in str(e.value)
    plain = _submit(d, root, [{"name": "good.safetensors"}]).message
    assert "--lora-rank R" in plain and "--lora FILE:STRENGTH" in plain          # the plain pack's two ways out


def test_loras_within_the_packs_rank_are_checked_and_queued(daemon):
    d, root = daemon
    choices = (LoraChoice(name="good", strength=0.5), LoraChoice(name="te_only.safetensors"))
    uses, report = d.loras.check(choices, (128, 128), lora_rank=12)                 # as for a rank-12 pack
    assert [u.path for u in uses] == [str(d.cfg.models_dir / "loras" / n) for n in ("good.safetensors",
                                                                                      "te_only.safetensors")]
    assert set(report[0]["layers"]) == {"branch", "adapter", "te"} and set(report[1]["layers"]) == {"adapter", "te"}
    with pytest.raises(ValueError, match="stacked LoRA rank 16 exceeds the pack's LoRA rank 12"):
        d.loras.check((LoraChoice(name="good"),) * 2, (128, 128), lora_rank=12)
    # a LoRA that touches no NPU branch goes to a plain pack: the encoder applies it
    reply = _submit(d, root, [{"name": "te_only.safetensors", "strength": 0.7}])
    assert isinstance(reply, m.Submitted), reply
    job = d.store.get(reply.job)
    assert list(job.spec["loras"]) == [{"name": "te_only.safetensors", "strength": 0.7, "clip_strength": None}]
    assert d.handle(m.Info()).loras == ("cut.safetensors", "good.safetensors", "loha.safetensors", "sdxl.safetensors",
                                        "shape.safetensors", "te_only.safetensors", "unknown.safetensors")


def test_a_dit_lora_on_an_int8_pack_is_refused_naming_both(daemon):
    """A W8A8 pack's INT8 layers were calibrated on the checkpoint's own activations: a LoRA changing DiT layers is
    refused naming the pack's INT8 layers and the LoRA; an encoder-only LoRA goes through."""
    import dataclasses
    from orchestrator.engine.loras import LoraRefused
    d, _ = daemon
    size = (128, 128)
    plain = d.loras.packs[size]
    d.loras.packs[size] = dataclasses.replace(plain, int8=("fc1", "qkv", "q"))
    try:
        with pytest.raises(LoraRefused) as e:
            d.loras.check((LoraChoice(name="good"),), size, lora_rank=12)
        assert e.value.field == "loras[0]"
        assert "INT8 (W8A8 fc1, qkv, q" in e.value.detail and "LoRA good" in e.value.detail
        uses, _ = d.loras.check((LoraChoice(name="te_only.safetensors"),), size, lora_rank=0)
        assert len(uses) == 1
    finally:
        d.loras.packs[size] = plain
    uses, _ = d.loras.check((LoraChoice(name="good"),), size, lora_rank=12)     # the FP16 pack takes it
    assert len(uses) == 1
