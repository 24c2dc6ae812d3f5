"""LoRA in the text encoder: the LLM adapter's and Qwen3's layers merged per job, on torch (in place, put back) and
on ONNX Runtime (initializers replaced when a session is made), equal to the encoder built from files with the LoRA
merged; a LoRA of the DiT's own layers leaves the encoder alone."""
from __future__ import annotations

import numpy as np
import pytest

from models.lora import LoraUse, TargetTable, plan_loras, plan_text_loras
from models.lora.merged_file import write_merged
from models.lora.synth import write_lora
from models.text import synth as text_synth

PROMPTS = ["1girl, solo, (blue eyes:1.2), long hair", ""]


def _cos(a, b):
    return float((a.astype(np.float64) * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_dit):
    root = tmp_path_factory.mktemp("enc_lora")
    te = root / "te.safetensors"
    text_synth.write_te("tiny", 3, te)
    text_synth.write_tokenizers("tiny", root / "tok")
    kohya, comfy, body = (root / f"{n}.safetensors" for n in ("kohya", "comfy", "body"))
    write_lora("tiny", 21, kohya, "kohya", rank=8, alpha=2.0, groups=("blocks", "adapter", "te"))
    write_lora("tiny", 22, comfy, "comfy", rank=4, alpha=None, groups=("adapter", "te"))
    write_lora("tiny", 23, body, "kohya", rank=4, alpha=4.0, groups=("blocks", "host"))
    return {"te": te, "dit": tiny_dit, "qwen": root / "tok" / "qwen", "t5": root / "tok" / "t5", "root": root,
            "kohya": kohya, "comfy": comfy, "body": body}


@pytest.fixture(scope="module")
def encoders(files):
    from models.text.conditioning import TextEncoder
    from models.text.encoder_pack import build_encoder_pack
    pack = build_encoder_pack(files["te"], files["dit"], files["qwen"], files["t5"], files["root"] / "encpack")
    t = TextEncoder.from_files(str(files["te"]), str(files["dit"]), str(files["qwen"]), str(files["t5"]), threads=2)
    o = TextEncoder.from_pack(str(pack), threads=2)
    yield t, o
    t.close()
    o.close()


def _merged_encoder(files, uses, tmp_path):
    """The torch encoder on files with the LoRAs merged into them (models.lora.merged_file)."""
    from models.dit.checkpoint import DiTCheckpoint
    from models.base.safetensors_io import SafeTensorsFile
    from models.text.conditioning import TextEncoder
    ck = DiTCheckpoint.open(files["dit"])
    te = SafeTensorsFile(files["te"])
    plan = plan_loras(uses, TargetTable({k: ck.shape(k) for k in ck.keys()}, {k: te.shape(k) for k in te.keys()}))
    dit, qwen = tmp_path / "dit+lora.safetensors", tmp_path / "te+lora.safetensors"
    write_merged(files["dit"], plan, dit)
    write_merged(files["te"], plan, qwen)
    return TextEncoder.from_files(str(qwen), str(dit), str(files["qwen"]), str(files["t5"]), threads=2)


def test_encoder_loras_equal_the_files_with_the_lora_merged(files, encoders, tmp_path):
    t, o = encoders
    base = [t.encode(p) for p in PROMPTS]
    uses = [LoraUse(str(files["kohya"]), 0.9, clip_strength=1.4), LoraUse(str(files["comfy"]), -0.5)]
    ref = _merged_encoder(files, uses, tmp_path)
    try:
        want = [ref.encode(p) for p in PROMPTS]
    finally:
        ref.close()
    for enc in (t, o):
        plan = enc.set_lora(plan_text_loras(uses, enc))
        assert {p: len(plan.keys(p)) for p in ("branch", "host", "adapter", "te")} == \
            {"branch": 0, "host": 0, "adapter": 60, "te": 14}
        assert plan.report()[0]["not_applied"] == {"dit": 280}      # the DiT's own layers: the scheduler's
        got = [enc.encode(p) for p in PROMPTS]
        for p, g, w, b in zip(PROMPTS, got, want, base):
            assert _cos(g, w) >= 0.99999, (enc.backend, p)
            assert np.abs(g - w).max() <= 1e-4 * np.abs(w).max(), (enc.backend, p)
            assert _cos(b, w) < 0.9999                               # the LoRA changes the context by far more
    for enc in (t, o):                                              # and comes off again
        enc.set_lora(plan_text_loras((), enc))
        for p, b in zip(PROMPTS, base):
            assert np.allclose(enc.encode(p), b, rtol=0, atol=1e-6 * np.abs(b).max()), enc.backend


def test_a_lora_of_the_dits_own_layers_leaves_the_encoder_alone(files, encoders):
    t, o = encoders
    before = o.compute.qwen, o.compute.adapter
    plan = o.set_lora(plan_text_loras([LoraUse(str(files["body"]))], o))
    assert not plan.targets and plan.report()[0]["not_applied"] == {"dit": 454}
    assert (o.compute.qwen, o.compute.adapter) == before            # no session made again
    o.set_lora(plan_text_loras((), o))


def test_onnx_loras_need_a_pack_that_names_its_weights(files, tmp_path):
    import json
    import shutil
    from models.text.conditioning import TextEncoder
    from models.text.encoder_pack import EncoderPackError, build_encoder_pack
    pack = build_encoder_pack(files["te"], files["dit"], files["qwen"], files["t5"], tmp_path / "old")
    m = json.loads((pack / "manifest.json").read_text())
    for g in m["graphs"].values():
        del g["weights"]                                             # as packs exported before LoRA support
    (pack / "manifest.json").write_text(json.dumps(m))
    enc = TextEncoder.from_pack(str(pack), threads=1)
    try:
        with pytest.raises(EncoderPackError, match="exported before LoRA support"):
            enc.set_lora(plan_text_loras([LoraUse(str(files["comfy"]))], enc))
    finally:
        enc.close()
        shutil.rmtree(pack)
