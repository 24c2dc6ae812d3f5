"""`anima-models export-encoder`: the text encoder (Qwen3 + LLM adapter) as an encoder pack for ONNX Runtime (FP32),
with the tokenizers as tokenizer.json and a manifest of hashes: what the board's encoder runs without torch.

    anima-models export-encoder --models MODELS --out packs/encoder
    anima-models export-encoder --text-encoder TE.safetensors --dit DIT.safetensors --qwen-tokenizer DIR \\
        --t5-tokenizer DIR --out packs/encoder [--overwrite]

Then `[stage.encoder] backend = "onnx"` and `pack = "packs/encoder"` in the pipeline config.
"""
from __future__ import annotations

from models.setup.models_dir import add_model_arguments, paths_from_args

PARTS = ("dit", "text_encoder", "qwen_tokenizer", "t5_tokenizer")


def add_arguments(p) -> None:
    add_model_arguments(p, parts=PARTS)
    p.add_argument("--out", required=True, metavar="DIR", help="encoder pack folder to write (built next to it, "
                                                               "then renamed into place)")
    p.add_argument("--overwrite", action="store_true", help="replace an encoder pack of other source files")


def run(args) -> int:
    from models.text.encoder_pack import build_encoder_pack, load_encoder_pack
    paths = paths_from_args(args, need=PARTS)
    out = build_encoder_pack(paths.text_encoder, paths.dit, paths.qwen_tokenizer, paths.t5_tokenizer, args.out,
                             overwrite=args.overwrite)
    pack = load_encoder_pack(out)
    m = pack.manifest
    size = sum(f["bytes"] for f in m["files"]) / 1e6
    print(f"encoder pack {out}: Qwen3 {m['qwen3']['layers']} layers (hidden {pack.source_dim}) + adapter "
          f"{m['adapter']['blocks']} blocks (context {pack.context_dim}), FP32 ONNX opset {m['opset']}, {size:.1f} MB; "
          f"tokenizers checked on {m['tokenizers']['check']['prompts']} prompts (T5: {m['tokenizers']['check']['t5']})")
    return 0
