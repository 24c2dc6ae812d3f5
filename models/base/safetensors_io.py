"""Safetensors reading through memory mapping (bf16/f16/f32 -> numpy, no torch) and streaming writing."""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Union

import numpy as np

from models.base.durable import atomic_write

# Header size bound: real checkpoints have headers of a few hundred KB.
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_DIMS = 32                   # numpy allows 64; real tensors have at most 5
MAX_INDEX = 2**62               # a dimension or a byte offset beyond this is not a real file's

# safetensors dtype name -> (numpy storage dtype, itemsize). bf16 is stored as uint16 and widened by bit shift.
DTYPES = {
    "F64": (np.float64, 8), "F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2),
    "I64": (np.int64, 8), "I32": (np.int32, 4), "I16": (np.int16, 2), "I8": (np.int8, 1),
    "U8": (np.uint8, 1), "BOOL": (np.bool_, 1),
}
# dtypes that exist in the format (quantised community variants) but that nothing here computes with.
KNOWN_UNSUPPORTED = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "U16", "U32", "U64"}


class SafeTensorsError(ValueError):
    """A file that is not a readable safetensors file; the message names the file and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str          # safetensors name: "BF16", "F32", ...
    shape: tuple
    start: int          # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 bit patterns, round to nearest even; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def _indices(value, max_len: int) -> bool:
    """A JSON list of at most `max_len` integers in [0, MAX_INDEX] (not bools, not floats)."""
    return (isinstance(value, list) and len(value) <= max_len
            and all(type(v) is int and 0 <= v <= MAX_INDEX for v in value))


class SafeTensorsFile:
    """One safetensors file, memory-mapped; tensors are read one at a time on request."""

    def __init__(self, path: Union[str, os.PathLike], *, max_header_bytes: int = MAX_HEADER_BYTES,
                 max_keys: int | None = None, mapped: bool = True):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
        except OSError as e:
            raise SafeTensorsError(f"{self.path}: cannot open ({e.strerror})") from None
        if size < 8:
            raise SafeTensorsError(f"{self.path}: not a safetensors file ({size} bytes, too short for a header)")
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > max_header_bytes and 8 + n <= size:
                raise SafeTensorsError(f"{self.path}: header of {n} bytes; at most {max_header_bytes} are read")
            if n == 0 or n > max_header_bytes or 8 + n > size:
                raise SafeTensorsError(
                    f"{self.path}: not a safetensors file or truncated (header length {n}, file size {size})")
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:     # not UTF-8, not JSON, an int of > 4300 digits, deep nesting
            raise SafeTensorsError(f"{self.path}: not a safetensors file (header is not JSON: "
                                   f"{type(e).__name__}: {str(e)[:200]})") from None
        if not isinstance(header, dict):
            raise SafeTensorsError(f"{self.path}: not a safetensors file (header is not a JSON object)")
        if max_keys is not None and len(header) - ("__metadata__" in header) > max_keys:
            raise SafeTensorsError(f"{self.path}: {len(header) - ('__metadata__' in header)} tensors; at most "
                                   f"{max_keys} are read")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise SafeTensorsError(f"{self.path}: not a safetensors file (__metadata__ must map strings to strings)")
        self.metadata = meta
        base = 8 + n
        self._infos: dict = {}
        for name, ent in header.items():
            dtype, shape, offsets = (ent.get(k) for k in ("dtype", "shape", "data_offsets")) if isinstance(
                ent, dict) else (None, None, None)
            if not (isinstance(dtype, str) and _indices(shape, MAX_DIMS) and _indices(offsets, 2)
                    and len(offsets) == 2 and offsets[0] <= offsets[1]):
                raise SafeTensorsError(f"{self.path}: malformed header entry for tensor {name[:200]!r} (dtype a "
                                       f"string, shape and data_offsets lists of integers in [0, 2^62])")
            a, b = offsets
            shape = tuple(shape)
            info = TensorInfo(name, dtype, shape, base + a, base + b)
            if dtype in DTYPES:
                want = info.numel * DTYPES[dtype][1]
                if math.prod(max(1, d) for d in shape) * DTYPES[dtype][1] > MAX_INDEX:   # numpy could not shape it
                    raise SafeTensorsError(f"{self.path}: tensor {name!r} has an impossible shape {list(shape)}")
                if b - a != want:
                    raise SafeTensorsError(
                        f"{self.path}: tensor {name!r} has {b - a} bytes, shape {list(shape)} {dtype} needs {want}")
            if base + b > size:
                raise SafeTensorsError(
                    f"{self.path}: truncated: tensor {name!r} ends at byte {base + b}, file has {size} bytes")
            self._infos[name] = info
        self.size, self.data_start = size, base
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if size > base and mapped else None

    # -- introspection -------------------------------------------------------------------------------------------
    def keys(self) -> list:
        return list(self._infos)

    def __contains__(self, name) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None

    def shape(self, name: str) -> tuple:
        return self.info(name).shape

    def dtype(self, name: str) -> str:
        return self.info(name).dtype

    # -- data ----------------------------------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The stored array (bf16 as uint16 bit patterns): a read-only view into the mapping (no copy), or with
        `mapped=False` the bytes read for this call."""
        info = self.info(name)
        if info.dtype not in DTYPES:
            what = "quantized/unsupported" if info.dtype in KNOWN_UNSUPPORTED else "unknown"
            raise SafeTensorsError(f"{self.path}: tensor {name!r} has {what} dtype {info.dtype}")
        np_dtype = DTYPES[info.dtype][0]
        if self._mm is None:
            return self._read(info).view(np_dtype).reshape(info.shape)
        return self._mm[info.start:info.end].view(np_dtype).reshape(info.shape)

    def _read(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes by read(), not the mapping: a file cut short meanwhile is an error here, where a
        mapped page past the new end would be SIGBUS."""
        want = info.end - info.start
        buf = bytearray(want)
        with open(self.path, "rb") as f:
            f.seek(info.start)
            got = f.readinto(buf)
        if got != want:
            raise SafeTensorsError(f"{self.path}: truncated: tensor {info.name!r} needs bytes {info.start}.."
                                   f"{info.end}, the file now ends at {info.start + got}")
        return np.frombuffer(buf, np.uint8)

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        """The tensor converted to `dtype` (float32 by default) as a fresh array."""
        info = self.info(name)
        arr = self.raw(name)
        if info.dtype == "BF16":
            arr = bf16_to_f32(arr)
        return np.array(arr, dtype=dtype, copy=True)


# ---------------------------------------------------------------------------------------------------------------
# Writing. Entries are written in order; data may be a callable so that huge files are produced one tensor at a time.

@dataclass
class TensorEntry:
    name: str
    dtype: str                                  # "BF16", "F16", "F32", ...
    shape: tuple
    data: Union[np.ndarray, Callable[[], np.ndarray]]


def _to_storage(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        if arr.dtype == np.uint16:
            return np.ascontiguousarray(arr)
        return f32_to_bf16(np.asarray(arr, dtype=np.float32))
    return np.ascontiguousarray(arr, dtype=DTYPES[dtype][0])


def write_safetensors(path: Union[str, os.PathLike], entries: Iterable[TensorEntry], metadata: dict = None) -> None:
    """Write entries to `path` durably (models.base.durable.atomic_write), producing each tensor only when it is written."""
    entries = list(entries)
    header, offset = {}, 0
    for e in entries:
        if e.dtype not in DTYPES:
            raise ValueError(f"cannot write dtype {e.dtype} for {e.name}")
        nbytes = int(np.prod(e.shape, dtype=np.int64)) * DTYPES[e.dtype][1]
        header[e.name] = {"dtype": e.dtype, "shape": [int(s) for s in e.shape], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)

    def write(f) -> None:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for e in entries:
            arr = e.data() if callable(e.data) else e.data
            if tuple(arr.shape) != tuple(e.shape):
                raise ValueError(f"{e.name}: produced shape {tuple(arr.shape)}, declared {tuple(e.shape)}")
            f.write(_to_storage(arr, e.dtype).tobytes())
    atomic_write(path, write)


def save_arrays(path, arrays: dict, dtype: str = "F32", metadata: dict = None) -> None:
    """Small helper: write a dict of numpy arrays with one storage dtype."""
    write_safetensors(path, [TensorEntry(k, dtype, tuple(v.shape), v) for k, v in arrays.items()], metadata)
