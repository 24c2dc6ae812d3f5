"""The sampling settings a pack or bundle records for the model it holds (manifest.json and bundle.json `sampling`),
which a job takes when it sets none (prompt.json, `generate`, the page, A1111's txt2img; a ComfyUI graph always sets
its own). Which model a pack holds is said when packing (`--sampling turbo|base`, or `--sampling-json`), never
guessed from the weights. Sources: docs/model-facts.md, "Recommended sampling settings".

    anima-models pack anima-turbo.safetensors --out packs/turbo-1024 --resolution 1024x1024 --sampling turbo
    anima-models bundle --models MODELS --resolution 1024x1024 --target rk3588 --out bundle --sampling base
"""
from __future__ import annotations

import json

from models.records.manifest import ManifestError, sampling_info

# ComfyUI's "Text to Image (Anima)" template: KSampler 30 steps, cfg 4, er_sde, simple
BASE = {"steps": 30, "cfg": 4.0, "sampler": "er_sde", "scheduler": "simple"}
# Anima Turbo's model card: CFG 1 and 8-12 steps (8: its fewest); the card names no sampler or scheduler, so the
# template's
TURBO = {"steps": 8, "cfg": 1.0, "sampler": "er_sde", "scheduler": "simple"}
PRESETS = {"base": BASE, "turbo": TURBO}


def parse_sampling(preset: str | None = None, text: str | None = None) -> dict | None:
    """`--sampling NAME` or `--sampling-json '{"steps": ..., "cfg": ..., "sampler": ..., "scheduler": ...}'` -> the
    record a manifest keeps (checked as a manifest reader checks it), None for neither; ValueError naming the option."""
    if preset is not None and text is not None:
        raise ValueError("--sampling and --sampling-json: give one of them")
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"--sampling {preset!r:.80}: choose one of {', '.join(PRESETS)}")
        return dict(PRESETS[preset])
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--sampling-json: not JSON ({e})") from None
    try:
        return sampling_info({"sampling": data})
    except ManifestError as e:
        raise ValueError(f"--sampling-json: {str(e).replace('manifest field ', 'field ')}") from None


def add_sampling_arguments(p) -> None:
    """The two options of `pack` and `bundle`."""
    p.add_argument("--sampling", choices=sorted(PRESETS), default=None,
                   help="record the recommended sampling settings of the model packed (turbo: cfg 1, 8 steps; base: "
                        "the ComfyUI template's 30 steps, cfg 4, er_sde, simple); jobs that set none take them "
                        "(default: none recorded, prompt.json's defaults)")
    p.add_argument("--sampling-json", default=None, metavar="JSON",
                   help='record these instead: {"steps": N, "cfg": X, "sampler": NAME, "scheduler": NAME}')


def record_sampling(pack_dir, sampling: dict | None) -> bool:
    """Make a built pack's manifest record `sampling` (None: record none), as `pack --sampling` would have: a bundle
    keeps a complete pack and changes only this. True when the manifest was rewritten."""
    from models.records.manifest import manifest_json, write_manifest
    m = manifest_json(pack_dir)
    if sampling_info(m) == sampling:
        return False
    if sampling is None:
        m.pop("sampling", None)
    else:
        m["sampling"] = dict(sampling)
    write_manifest(pack_dir, m)
    return True
