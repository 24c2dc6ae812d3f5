"""A1111's LoRA tags in a prompt: `<lora:NAME:MULTIPLIER>` (also `<lora:NAME:TE:UNET>`, `te=` / `unet=` by name,
and LyCORIS' `<lyco:...>`), taken out of the text as A1111 does (extra_networks.parse_prompt: the tag is cut out,
what is around it stays; the whitespace the tag stood in goes with it), and written back for the PNG's A1111
parameters.

    split_lora_tags("1girl, <lora:style:0.8>, smile") -> ("1girl, , smile", [LoraTag("style", 0.8, 0.8)])

A1111's multipliers: one number is both the text encoder's and the UNet's (here: clip_strength and strength); two
positional numbers are the text encoder's, then the UNet's; `dyn=` (dynamic rank) has no meaning here and is refused.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from models.lora.file import LoraError

TAG = re.compile(r"<(lora|lyco):([^<>]*)>")
MAX_TAGS = 16


@dataclass(frozen=True)
class LoraTag:
    name: str
    strength: float          # A1111's unet multiplier: the DiT and its LLM adapter
    clip_strength: float     # A1111's te multiplier: the text encoder


def _number(tag: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise LoraError(f"prompt tag {tag}: {text!r} is not a number") from None
    if not math.isfinite(v):
        raise LoraError(f"prompt tag {tag}: {text!r} is not a finite number")
    return v


def split_lora_tags(text: str) -> tuple:
    """(the text without its LoRA tags, [LoraTag] in order); LoraError naming a malformed tag."""
    tags = []
    for m in TAG.finditer(text):
        tag = m.group(0)
        args = [a.strip() for a in m.group(2).split(":")]
        name, rest = args[0], args[1:]
        if not name:
            raise LoraError(f"prompt tag {tag}: no LoRA name (write <lora:NAME:STRENGTH>)")
        pos, named = [], {}
        for a in rest:
            if "=" in a:
                k, _, v = a.partition("=")
                if k.strip() not in ("te", "unet"):
                    raise LoraError(f"prompt tag {tag}: {k.strip()!r} is not a multiplier this server takes "
                                    "(te=, unet=)")
                named[k.strip()] = _number(tag, v.strip())
            else:
                pos.append(_number(tag, a))
        if len(pos) > 2:
            raise LoraError(f"prompt tag {tag}: at most two multipliers (text encoder, UNet), got {len(pos)}")
        te = named.get("te", pos[0] if pos else 1.0)                    # A1111: te first, unet defaults to it
        unet = named.get("unet", pos[1] if len(pos) > 1 else te)
        tags.append(LoraTag(name, unet, te))
    if len(tags) > MAX_TAGS:
        raise LoraError(f"the prompt has {len(tags)} LoRA tags; at most {MAX_TAGS}")
    return _cut(TAG.split(text)[::3]), tags


def _ws(text: str, end: bool) -> int:
    """The length of the whitespace run at the text's end (or start)."""
    return len(text) - len(text.rstrip() if end else text.lstrip())


def _cut(pieces: list) -> str:
    """The text between the tags, joined without the whitespace a tag stood in: a tag that opens or closes the text
    takes the whitespace between it and that edge; one between two runs of whitespace takes one of them (the one
    without a line break, when only one has it). Nothing else changes: `1girl <lora:s:0.8>` is `1girl` (the prompt
    --lora s:0.8 takes with `1girl`; a trailing space is one more Qwen token), `a, <lora:s:1>, b` stays `a, , b`."""
    out = pieces[0]
    for k, seg in enumerate(pieces[1:], start=2):
        left, right = _ws(out, True), _ws(seg, False)
        if not out.strip():                                 # the tag opened the text
            out, seg = "", seg[right:]
        elif k == len(pieces) and not seg.strip():          # the tag closed it
            out, seg = out[:len(out) - left], ""
        elif left and right:
            if "\n" in out[len(out) - left:] and "\n" not in seg[:right]:
                seg = seg[right:]
            else:
                out = out[:len(out) - left]
        out += seg
    return out


def lora_stem(name: str) -> str:
    """A1111's name of a LoRA: the file's stem (`sub/style.safetensors` -> `style`)."""
    base = name.rsplit("/", 1)[-1]
    return base[:-len(".safetensors")] if base.endswith(".safetensors") else base


def lora_tag(name: str, strength: float, clip_strength: float) -> str:
    """The tag A1111 writes for a LoRA: `<lora:NAME:S>`, or `<lora:NAME:TE:UNET>` when the two differ; NAME is the
    file's stem (A1111 names LoRAs so)."""
    stem = lora_stem(name)
    if clip_strength == strength:
        return f"<lora:{stem}:{strength:g}>"
    return f"<lora:{stem}:{clip_strength:g}:{strength:g}>"
