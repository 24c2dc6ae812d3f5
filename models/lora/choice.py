"""THE record of a LoRA a job names, from prompt.json through SUBMIT, ENCODE and DENOISE to the stages that apply it,
and what each stage makes of it: the file under the models folder's loras/ (resolved where it is used: a remote stage
has its own models folder), the LoraUse a plan takes, and the short hash A1111 writes in a PNG's `Lora hashes`.

    {"name": "style.safetensors", "strength": 0.8, "clip_strength": 1.0}     prompt.json `loras[i]`

`strength` is ComfyUI's strength_model (the DiT and its LLM adapter), `clip_strength` its strength_clip (the Qwen3
text encoder; omitted: `strength`), both within ComfyUI's LoraLoader bounds.
"""
from __future__ import annotations

import hashlib
import struct
from typing import ClassVar

from models.lora.plan import MAX_STRENGTH, LoraUse
from models.setup.models_dir import MAX_LORA_NAME, lora_path
from models.base.schema import Float, Record, Text

MAX_LORAS = 8                   # per job: LoRAs stack along a LoRA-ready pack's rank, which bounds them anyway
HASH_CHUNK = 8 * 1024 * 1024
SHORT_HASH = 12                 # hex digits A1111 shows of a LoRA's hash

Strength = Float(-MAX_STRENGTH, MAX_STRENGTH)


class LoraChoice(Record, frozen=True):
    """One LoRA of a job: its name under MODELS/loras/ and its strengths."""

    KEY_NOUN: ClassVar[str] = "LoRA field"

    name: Text(MAX_LORA_NAME, 1)
    strength: Strength = 1.0
    clip_strength: Strength | None = None

    @property
    def te_strength(self) -> float:
        return self.strength if self.clip_strength is None else self.clip_strength

    def use(self, models_dir) -> LoraUse:
        """The LoraUse of this choice in a models folder (models_dir.ModelsDirError when the name leads nowhere)."""
        return LoraUse(str(lora_path(models_dir, self.name)), self.strength, self.clip_strength, self.name)


def lora_uses(choices, models_dir) -> list:
    """[LoraUse] of a job's choices in a models folder, in order."""
    return [c.use(models_dir) for c in choices]


def lora_short_hash(path) -> str:
    """The hash A1111 and Civitai name a LoRA by (`Lora hashes: "NAME: HASH"`): the first 12 hex digits of the
    sha256 of a safetensors file's tensor data, its JSON header left out (sd-scripts'
    train_util.addnet_hash_safetensors, which A1111's networks use for .safetensors LoRAs), so editing the metadata
    keeps the hash."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        while True:
            chunk = f.read(HASH_CHUNK)
            if not chunk:
                return h.hexdigest()[:SHORT_HASH]
            h.update(chunk)
