"""DiT + LLM-adapter checkpoint: memory-mapped, prefix-stripped, classified, config-detected and shape-validated."""
from __future__ import annotations

import logging
import os
from typing import Iterator, Mapping, Optional

import numpy as np

from models.dit.config import (DIT_PREFIXES, IGNORED_PATTERNS, AdapterConfig, CheckpointError, DiTConfig,
                            detect_adapter_config, detect_dit_config, expected_adapter_shapes, expected_dit_shapes)
from models.records.manifest import file_sha256
from models.base.safetensors_io import DTYPES, KNOWN_UNSUPPORTED, SafeTensorsError, SafeTensorsFile, bf16_to_f32

log = logging.getLogger(__name__)

FLOAT_DTYPES = ("BF16", "F16", "F32")     # what the DiT path computes with (widened to f32 on read)
ADAPTER_PREFIX = "llm_adapter."
GGUF_MAGIC = b"GGUF"
BRANCH_MODULES = {"self": "self_attn", "cross": "cross_attn", "ffn": "mlp"}


def strip_prefix(key: str) -> str:
    for p in DIT_PREFIXES:
        if key.startswith(p):
            return key[len(p):]
    return key


def is_ignored(key: str) -> bool:
    return any(p.search(key) for p in IGNORED_PATTERNS)


def classify_keys(keys) -> str:
    """What a set of tensor names looks like: 'dit', 'text-encoder', 'vae', 'vae-diffusers' or 'unknown'."""
    keys = list(keys)
    stripped = {strip_prefix(k) for k in keys}
    if "x_embedder.proj.1.weight" in stripped or any(k.startswith("blocks.") and ".adaln_modulation_" in k
                                                      for k in stripped):
        return "dit"
    if any(k.startswith(("model.layers.", "model.embed_tokens", "layers.", "embed_tokens.")) for k in keys):
        return "text-encoder"
    if any(k.startswith(("post_quant_conv", "quant_conv", "decoder.conv_in", "decoder.mid_block",
                         "decoder.up_blocks")) for k in keys):
        return "vae-diffusers"
    if any(k.startswith(("decoder.", "conv2.", "encoder.", "conv1.")) for k in keys):
        return "vae"
    return "unknown"


LOOKS_LIKE = {
    "text-encoder": "a Qwen3 text encoder (keys model.layers.* / model.embed_tokens)",
    "vae": "a VAE (Wan 2.1 / Qwen-Image layout: decoder.*, conv2.*, encoder.*)",
    "vae-diffusers": "a VAE in diffusers layout (post_quant_conv, decoder.conv_in, ...)",
    "unknown": "no Anima DiT (no x_embedder.proj.1.weight, no blocks.N.adaln_modulation_*)",
}


def check_gguf(path: str) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
    if head == GGUF_MAGIC:
        raise CheckpointError(f"{path}: is a GGUF file (quantized variant); only safetensors bf16/fp16/fp32 "
                              "DiT checkpoints are supported")


def check_quantized(st: SafeTensorsFile) -> None:
    """Reject fp8/other quantized variants: scale tensors or dtypes nothing here computes with."""
    for k in st.keys():
        if k.endswith((".weight_scale", ".scale_weight", ".input_scale", ".weight_scale_2")) or \
                k.endswith("scaled_fp8"):
            raise CheckpointError(f"{st.path}: key {k!r}: quantized checkpoint (fp8 with weight scales) is not "
                                  "supported; use the bf16 release")
        dt = st.dtype(k)
        if dt not in FLOAT_DTYPES and not is_ignored(strip_prefix(k)):
            what = "quantized dtype" if dt in KNOWN_UNSUPPORTED else "unsupported dtype"
            raise CheckpointError(f"{st.path}: key {k!r} has {what} {dt}; supported: {', '.join(FLOAT_DTYPES)}")


class DiTCheckpoint:
    """An opened, validated Anima DiT checkpoint; tensors are read on demand (stripped key names)."""

    def __init__(self, st: SafeTensorsFile, names: dict, config: DiTConfig, adapter_config: Optional[AdapterConfig]):
        self._st = st
        self._names = names                  # stripped key -> key in the file
        self.path = st.path
        self.config = config
        self.adapter_config = adapter_config
        self._sha256: Optional[str] = None

    # -- opening ---------------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path) -> "DiTCheckpoint":
        path = os.fspath(path)
        check_gguf(path)
        try:
            st = SafeTensorsFile(path)
        except SafeTensorsError as e:
            raise CheckpointError(str(e)) from None
        kind = classify_keys(st.keys())
        if kind != "dit":
            raise CheckpointError(f"{path}: not an Anima DiT checkpoint: it looks like {LOOKS_LIKE[kind]}")
        check_quantized(st)
        names, shapes = {}, {}
        for k in st.keys():
            s = strip_prefix(k)
            if is_ignored(s):
                continue
            if s in names:
                raise CheckpointError(f"{path}: key {s!r} appears twice ({names[s]!r} and {k!r})")
            names[s] = k
            shapes[s] = st.shape(k)
        try:
            config = detect_dit_config(shapes)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        expected = dict(expected_dit_shapes(config))
        adapter = None
        if any(s.startswith(ADAPTER_PREFIX) for s in shapes):
            try:
                adapter = detect_adapter_config(shapes, ADAPTER_PREFIX)
            except CheckpointError as e:
                raise CheckpointError(f"{path}: LLM adapter: {e}") from None
            expected.update(expected_adapter_shapes(adapter, ADAPTER_PREFIX))
        else:
            log.warning("%s: no llm_adapter.* tensors; text conditioning needs them from elsewhere", path)
        cls._validate(path, names, shapes, expected)
        log.info("opened %s: %s", path, config)
        return cls(st, names, config, adapter)

    @staticmethod
    def _validate(path: str, names: dict, shapes: dict, expected: dict) -> None:
        for s, want in expected.items():
            if s not in shapes:
                raise CheckpointError(f"{path}: missing key {s!r} (expected shape {list(want)})")
            if tuple(shapes[s]) != tuple(want):
                raise CheckpointError(f"{path}: key {names[s]!r} has shape {list(shapes[s])}, "
                                      f"expected {list(want)}")
        extra = sorted(set(shapes) - set(expected))
        if extra:
            log.warning("%s: %d unexpected tensors ignored (first: %s)", path, len(extra), names[extra[0]])
            for s in extra:
                del names[s]

    # -- access ----------------------------------------------------------------------------------------------------
    def keys(self) -> list:
        return list(self._names)

    def __contains__(self, key) -> bool:
        return key in self._names

    def shape(self, key: str) -> tuple:
        return self._st.shape(self._name(key))

    def dtype(self, key: str) -> str:
        return self._st.dtype(self._name(key))

    def _name(self, key: str) -> str:
        try:
            return self._names[key]
        except KeyError:
            raise CheckpointError(f"{self.path}: missing key {key!r}") from None

    def get(self, key: str) -> np.ndarray:
        """Tensor by stripped key name as a fresh float32 array.

        Read with pread rather than through the memory map: mapped pages stay in this process's RSS (4 GB after a
        full pass over a full-size checkpoint), read pages only in the shared page cache.
        """
        info = self._st.info(self._name(key))
        storage = DTYPES[info.dtype][0]                    # check_quantized admitted only BF16/F16/F32
        buf = np.empty(info.numel, storage)
        view, done = memoryview(buf).cast("B"), 0
        with open(self.path, "rb", buffering=0) as f:
            while done < view.nbytes:
                n = os.preadv(f.fileno(), [view[done:]], info.start + done)
                if n <= 0:
                    raise CheckpointError(f"{self.path}: key {info.name!r}: file ended while reading (truncated?)")
                done += n
        buf = buf.reshape(info.shape)
        if info.dtype == "BF16":
            return bf16_to_f32(buf)
        return buf.astype(np.float32, copy=False)

    def host_weights(self) -> dict:
        """Every host-side tensor (models.dit.host_ops.host_keys) as float32."""
        from models.dit.host_ops import host_keys
        return {k: self.get(k) for k in host_keys(self.config)}

    def branch_weights(self, block: int, kind: str) -> dict:
        """One branch's weights ('self'|'cross'|'ffn') with the `blocks.i.<module>.` prefix removed, float32."""
        if kind not in BRANCH_MODULES:
            raise ValueError(f"branch kind {kind!r}; choose one of {list(BRANCH_MODULES)}")
        if not 0 <= block < self.config.blocks:
            raise ValueError(f"block {block} out of range 0..{self.config.blocks - 1}")
        p = f"blocks.{block}.{BRANCH_MODULES[kind]}."
        return {k[len(p):]: self.get(k) for k in self._names if k.startswith(p)}

    def mapping(self) -> "CheckpointMapping":
        """A read-only Mapping view (stripped key -> f32 array, read on access)."""
        return CheckpointMapping(self)

    def param_count(self) -> int:
        return sum(int(np.prod(self.shape(k), dtype=np.int64)) for k in self._names)

    def sha256(self) -> str:
        """sha256 of the whole file, streamed in chunks; cached after the first call."""
        if self._sha256 is None:
            self._sha256 = file_sha256(self.path)
        return self._sha256

    def __repr__(self) -> str:
        return f"DiTCheckpoint({self.path!r}, {self.config})"


class CheckpointMapping(Mapping):
    """Mapping facade over a DiTCheckpoint so host ops can read weights lazily."""

    def __init__(self, ckpt: DiTCheckpoint):
        self._ckpt = ckpt

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._ckpt:
            raise KeyError(key)
        return self._ckpt.get(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._ckpt.keys())

    def __len__(self) -> int:
        return len(self._ckpt.keys())
