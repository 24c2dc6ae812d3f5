"""A1111's infotext: the PNG's `parameters` chunk (A1111, Civitai and most image browsers read it), one of the PNG
formats the ways in hand the engine (orchestrator.http.png_formats). A job's LoRAs are in it as A1111 writes them: its
`<lora:NAME:S>` tags after the prompt and `Lora hashes` (models.lora.choice's short hashes)."""
from __future__ import annotations

import json

from models.lora.a1111 import lora_stem, lora_tag
from orchestrator.http.a1111_names import sampler_label, scheduler_label


A1111_NEGATIVE = "Negative prompt:"


def a1111_parameters(prompt: str, negative: str, settings: dict) -> str:
    """A1111's generation text: the prompt, "Negative prompt: " and the negative prompt, then one line of
    `Key: value` pairs. A1111 reads it back (docs/prompts.md) line by line: the last line holds the pairs, and the
    first line that, stripped, begins with "Negative prompt:" starts the negative prompt. So in both texts such a
    line is written with a lower-case first letter (the one change: a prompt of "\nNegative prompt: ..." lines no
    longer moves A1111's split), and a value holding a comma, colon or newline is JSON-quoted, as A1111 quotes."""
    def text(t: str) -> str:
        return "\n".join("n" + ln.strip()[1:] if ln.strip().startswith(A1111_NEGATIVE) else ln for ln in t.split("\n"))

    def value(v) -> str:
        v = str(v)
        return json.dumps(v, ensure_ascii=False) if any(c in v for c in ",:\n") else v
    pairs = ", ".join(f"{k}: {value(v)}" for k, v in settings.items())
    return f"{text(prompt)}\n{A1111_NEGATIVE} {text(negative)}\n{pairs}"


# A1111's hires upscaler names for the latent methods it has (area and bislerp it has not: named as ComfyUI names them)
A1111_LATENT_UPSCALERS = {"bilinear": "Latent", "bicubic": "Latent (bicubic)", "nearest-exact": "Latent (nearest-exact)"}
# and for the pixel path: A1111's plain upscalers (modules/upscaler.py: UpscalerLanczos, UpscalerNearest)
A1111_PIXEL_UPSCALERS = {"lanczos": "Lanczos", "nearest-exact": "Nearest"}


def _hires_labels(spec) -> dict:
    """A1111's infotext of a hires fix: Denoising strength, Hires upscale or Hires resize, Hires steps, upscaler;
    then what the second pass has of its own, as A1111 names it where it differs from the first pass's (Hires
    sampler, Hires schedule type, Hires prompt, Hires negative prompt; Forge's Hires CFG Scale; this project's Hires
    seed)."""
    h = spec.hires
    if h is None:
        return {}
    # a second pass on the first latent as it is: A1111's upscale 1 with its "None" upscaler
    size = {"Hires upscale": h.scale if h.upscaled else 1.0} if h.width is None else \
        {"Hires resize": f"{h.width}x{h.height}"}
    names = A1111_PIXEL_UPSCALERS if h.space == "pixel" else A1111_LATENT_UPSCALERS
    if not h.upscaled:
        names = {h.method: "None"}
    own = {"Hires sampler": (h.sampler, spec.sampler, sampler_label),
           "Hires schedule type": (h.scheduler, spec.scheduler, scheduler_label),
           "Hires CFG Scale": (h.cfg, spec.cfg, None), "Hires prompt": (h.prompt, spec.prompt, None),
           "Hires negative prompt": (h.negative_prompt, spec.negative_prompt, None),
           "Hires seed": (h.seed, spec.seed, None)}
    return {"Denoising strength": h.denoise, **size, **({"Hires steps": h.steps} if h.steps else {}),
            "Hires upscaler": names.get(h.method, h.method),
            **{k: (label(v) if label else v) for k, (v, first, label) in own.items() if v is not None and v != first}}


def parameters_chunk(image) -> dict[str, str]:
    """The `parameters` chunk of one image (orchestrator.engine.png_text.ImageText)."""
    spec, pack = image.spec, image.pack
    tags = "".join(" " + lora_tag(c.name, c.strength, c.te_strength) for c in spec.loras)
    hashes = ", ".join(f"{lora_stem(c.name)}: {image.lora_hashes[c.name]}" for c in spec.loras
                       if c.name in image.lora_hashes)
    params = a1111_parameters(spec.prompt + tags, spec.negative_prompt, {
        "Steps": spec.steps, "Sampler": sampler_label(spec.sampler), "Schedule type": scheduler_label(spec.scheduler),
        "CFG scale": spec.cfg, "Seed": spec.seed, "Size": f"{image.width}x{image.height}", "Model": pack.source_name,
        "Model hash": pack.source_sha256[:10], **({"Lora hashes": hashes} if hashes else {}),
        **({"Denoising strength": spec.denoise} if spec.init_image is not None else {}),
        **({"Batch size": spec.batch, "Batch pos": image.batch_pos} if spec.batch > 1 else {}),
        **_hires_labels(spec), "Spectrum": "on" if spec.spectrum.enabled else "off"})
    return {"parameters": params}
