"""Records ComfyUI's LatentComposite and LatentBlend on Anima-shaped latents for tests/data/comfy_latent_mix.npz (CI
has no ComfyUI). Run from a ComfyUI checkout with its own venv:

    cd COMFYUI && PYTHONPATH=. VENV/bin/python ANIMA/bench/comfy_latent_mix_cases.py \
        ANIMA/tests/data/comfy_latent_mix.npz

The latents are [B, 16, 1, h, w] as ComfyUI holds Anima's (the Wan 2.1 VAE's video shape), drawn from a fixed seed:
`to` (a batch of 2), `frm` and `frm2` (one image of the same size), `small` (one image of 3 rows: ComfyUI indexes
rows, not columns, of this shape). Each case stores the node's
inputs by name and its output as `CASE/out`; `cases` lists (name, node, inputs, values) as JSON."""
import json
import sys

OUT = sys.argv[1]
sys.argv = sys.argv[:1] + ["--cpu"]
import comfy.cli_args  # noqa: E402 - ComfyUI's own modules, from its checkout

comfy.cli_args.args.cpu = True
import numpy as np  # noqa: E402
import torch  # noqa: E402
import nodes  # noqa: E402

# (case, node, (input latents), values): composites at x, y, feather (pixels), blends at a factor
CASES = [("plain", "LatentComposite", ("to", "frm"), dict(x=0, y=0, feather=0)),
         ("down", "LatentComposite", ("to", "frm"), dict(x=24, y=0, feather=0)),
         ("feather", "LatentComposite", ("to", "frm"), dict(x=16, y=0, feather=24)),
         ("y8", "LatentComposite", ("to", "frm"), dict(x=8, y=8, feather=16)),
         ("unaligned", "LatentComposite", ("to", "frm"), dict(x=13, y=5, feather=9)),
         ("small", "LatentComposite", ("to", "small"), dict(x=8, y=0, feather=16)),
         ("small_edge", "LatentComposite", ("to", "small"), dict(x=40, y=0, feather=24)),
         ("onto_image", "LatentComposite", ("frm", "frm2"), dict(x=32, y=0, feather=32)),
         ("blend", "LatentBlend", ("frm", "frm2"), dict(blend_factor=0.3)),
         ("blend_end", "LatentBlend", ("frm2", "frm"), dict(blend_factor=0.0))]


def main(out: str) -> None:
    g = torch.Generator().manual_seed(2026)
    lat = {"to": torch.randn(2, 16, 1, 8, 6, generator=g), "frm": torch.randn(1, 16, 1, 8, 6, generator=g),
           "frm2": torch.randn(1, 16, 1, 8, 6, generator=g), "small": torch.randn(1, 16, 1, 3, 6, generator=g)}
    rec = {k: v.numpy() for k, v in lat.items()}
    for name, node, (a, b), values in CASES:
        if node == "LatentComposite":
            res = nodes.LatentComposite().composite({"samples": lat[a]}, {"samples": lat[b]}, **values)
        else:
            res = nodes.LatentBlend().blend({"samples": lat[a]}, {"samples": lat[b]}, **values)
        rec[f"{name}/out"] = res[0]["samples"].numpy()
    rec["cases"] = np.array(json.dumps([[n, node, list(ins), v] for n, node, ins, v in CASES]))
    rec["source"] = np.array("ComfyUI nodes.py LatentComposite.composite / LatentBlend.blend (version "
                             f"{getattr(__import__('comfyui_version'), '__version__', '?')}), "
                             "bench/comfy_latent_mix_cases.py")
    np.savez_compressed(out, **rec)


if __name__ == "__main__":
    main(OUT)
