"""Records what ComfyUI computes for bench/comfy_workflows.py's mixes before the first KSampler (start-composite,
start-blend) for tests/test_start_mix_comfy.py (CI has no ComfyUI):

    .venv/bin/python bench/comfy_start_mix_record.py --comfyui http://127.0.0.1:8192 --models MODELS \\
        --out tests/data/samplers/comfy_small_start_mix.npz

ComfyUI running as bench/comfy_reference.py says (CPU, float32, the synthetic small bundle with ComfyUI's own
tokenizers). Each graph is sent with SaveLatent nodes added on its two VAEEncodes ("21", "23"), its
LatentComposite / LatentBlend ("24") and its KSampler ("8"); nothing else changes. Stored per graph NAME, in model
space ((z - mean) / std of the Wan 2.1 VAE, this project's latent space), each [B, 16, h, w]: `NAME/init` and
`NAME/other` (the two uploads' VAEEncode), `NAME/start` (the mix the KSampler takes), `NAME/final` (its output);
`graph/NAME` the graph as sent (without the SaveLatents); `job` the seed, size and files as JSON."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.comfy_reference import ComfyClient  # noqa: E402
from bench.comfy_workflows import WORKFLOWS, input_images  # noqa: E402
from models.setup.models_dir import add_model_arguments, paths_from_args  # noqa: E402
from models.base.safetensors_io import SafeTensorsFile  # noqa: E402
from models.vae.latent import LATENT_MEAN, LATENT_STD  # noqa: E402

GRAPHS = ("start-composite", "start-blend")
SAVED = {"init": "21", "other": "23", "start": "24", "final": "8"}      # what a SaveLatent is added on


def model_space(raw: bytes, tmp: Path) -> np.ndarray:
    """A SaveLatent file ('latent_tensor' [B, 16, 1, h, w] in VAE space) -> [B, 16, h, w] in model space."""
    tmp.write_bytes(raw)
    st = SafeTensorsFile(tmp)
    shape = st.shape("latent_tensor")
    z = st.get("latent_tensor").reshape(shape[0], 16, *shape[-2:])
    mean = np.asarray(LATENT_MEAN, np.float32)[None, :, None, None]
    std = np.asarray(LATENT_STD, np.float32)[None, :, None, None]
    return ((z - mean) / std).astype(np.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/comfy_start_mix_record.py", description=__doc__.split("\n")[0])
    p.add_argument("--comfyui", required=True, help="URL of a running ComfyUI on loopback")
    add_model_arguments(p)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--size", default="256x256")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    width, height = (int(v) for v in a.size.lower().split("x"))
    client = ComfyClient(a.comfyui, a.timeout)
    client.check()
    paths = paths_from_args(a)
    files = {"dit": paths.dit.name, "text_encoder": paths.text_encoder.name, "vae": paths.vae.name}
    for name, data in input_images(width, height).items():
        client.upload(name, data)
    rec = {"job": np.array(json.dumps({"seed": a.seed, "size": [width, height], "files": files}))}
    with tempfile.TemporaryDirectory() as tmp:
        for name in GRAPHS:
            graph = WORKFLOWS[name][1](files, a.seed, width, height)
            rec[f"graph/{name}"] = np.array(json.dumps(graph))
            saving = {**graph, **{f"9{k}": {"class_type": "SaveLatent",
                                            "inputs": {"samples": [node, 0], "filename_prefix": f"latents/{key}"}}
                                  for k, (key, node) in enumerate(SAVED.items())}}
            out = client.run(saving)
            for k, key in enumerate(SAVED):
                rec[f"{name}/{key}"] = model_space(client.view(out[f"9{k}"]["latents"][0]), Path(tmp) / "l")
            print(f"{name}: " + ", ".join(f"{key} {list(rec[f'{name}/{key}'].shape)}" for key in SAVED), flush=True)
    np.savez_compressed(a.out, **rec)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
