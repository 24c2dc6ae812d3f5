"""Tensor descriptors `{dtype, shape, where}` and helpers to move numpy arrays as inline frames or arena slots."""

from typing import Any, Literal, Sequence

import numpy as np

from models.base.schema import UNSET, UnsetType
from protocol.fields import Int, List, Name, ProtocolError, WireRecord

# Wire dtype -> numpy dtype. bf16 travels as its raw uint16 bit patterns (numpy has no bfloat16).
DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
    "i64": np.dtype("<i8"),
    "u8": np.dtype("u1"),
}
_FROM_KIND = {("f", 4): "f32", ("f", 2): "f16", ("i", 8): "i64", ("u", 1): "u8"}  # (kind, itemsize) -> wire dtype

MAX_NDIM = 8
MAX_DIM = 2**31 - 1
MAX_TENSOR_BYTES = 2 * 2**30  # 2 GiB: far above any Anima tensor, below what breaks 32-bit sizes
MAX_FRAME_INDEX = 255
MAX_OFFSET = 2**48


class Where(WireRecord, frozen=True):
    """`{frame: k}` (inline multipart frame k >= 1) or `{slot: name, offset: bytes}` (the job's arena)."""

    frame: Int(1, MAX_FRAME_INDEX) | UnsetType = UNSET
    slot: Name | UnsetType = UNSET
    offset: Int(0, MAX_OFFSET) | UnsetType = UNSET

    def __post_init__(self):
        if (self.frame is UNSET) == (self.slot is UNSET) or (self.slot is UNSET) != (self.offset is UNSET):
            raise ProtocolError("", "must be {frame: k} or {slot: name, offset: bytes}")


class TensorDesc(WireRecord, frozen=True):
    """Where a tensor lives: `slot`+`offset` in the job's shared-memory arena, or inline multipart `frame` k (k >= 1).

    Built as TensorDesc(dtype, shape, slot=..., offset=...) or TensorDesc(dtype, shape, frame=k); on the wire
    `{dtype, shape, where}`."""

    dtype: Literal[tuple(DTYPES)]
    shape: List(Int(0, MAX_DIM), MAX_NDIM)
    where: Where

    @classmethod
    def _build(cls, dtype=None, shape=None, slot=None, offset=0, frame=None, *, where=None):
        if where is None:
            where = {} if slot is None else {"slot": slot, "offset": offset}
            if frame is not None:
                where["frame"] = frame
        return super()._build(dtype=dtype, shape=shape, where=where)

    def __post_init__(self):
        numel = 1
        for d in self.shape:
            numel *= d
        if numel * DTYPES[self.dtype].itemsize > MAX_TENSOR_BYTES:
            raise ProtocolError("shape", f"{numel} elements exceed the tensor limit of {MAX_TENSOR_BYTES} bytes",
                                "too_large")

    def __reduce__(self):
        return (_tensor_desc, (self.dtype, self.shape, self.slot, self.offset, self.frame))

    @property
    def slot(self) -> str | None:
        return None if self.where.slot is UNSET else self.where.slot

    @property
    def offset(self) -> int:
        return 0 if self.where.offset is UNSET else self.where.offset

    @property
    def frame(self) -> int | None:
        return None if self.where.frame is UNSET else self.where.frame

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    @property
    def inline(self) -> bool:
        return self.where.frame is not UNSET


def _tensor_desc(dtype, shape, slot, offset, frame) -> TensorDesc:
    return TensorDesc(dtype, shape, slot, offset, frame)


def wire_dtype(array: np.ndarray, dtype: str | None = None) -> str:
    """The wire dtype of `array` (any byte order); uint16 arrays must say dtype='bf16' explicitly."""
    key = (array.dtype.kind, array.dtype.itemsize)
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if key != (DTYPES[dtype].kind, DTYPES[dtype].itemsize):
            raise ValueError(f"an array of {array.dtype} cannot travel as {dtype} (expects {DTYPES[dtype]})")
        return dtype
    name = _FROM_KIND.get(key)
    if name is None:
        raise ValueError(f"array dtype {array.dtype} has no wire dtype (f32, f16, bf16 as uint16, i64, u8)")
    return name


class InlineFrames:
    """Collects arrays as extra multipart frames; `add` returns the descriptor pointing at the frame.

    Contiguous little-endian arrays are sent without a copy (a memoryview of the array); others are copied once.
    """

    def __init__(self, first_index: int = 1):
        self.first_index = first_index
        self.frames: list[Any] = []

    def add(self, array: np.ndarray, dtype: str | None = None) -> TensorDesc:
        array = np.asarray(array)
        name = wire_dtype(array, dtype)
        a = np.ascontiguousarray(array, dtype=DTYPES[name])  # no copy when already contiguous + little-endian
        index = self.first_index + len(self.frames)
        self.frames.append(memoryview(a.reshape(-1)).cast("B") if a.size else b"")
        return TensorDesc(name, tuple(array.shape), frame=index)


def frame_bytes(frame: Any) -> memoryview:
    """A byte memoryview of one received frame (bytes, bytearray, memoryview or zmq.Frame)."""
    buf = getattr(frame, "buffer", frame)
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def from_inline(desc: TensorDesc, inline: Sequence[Any], *, copy: bool = False) -> np.ndarray:
    """The array an inline descriptor points at; `inline` is `msg.inline` (frames 1..n, so frame k is inline[k-1])."""
    if desc.frame is None:
        raise ValueError("descriptor points at an arena slot, not an inline frame")
    if desc.frame > len(inline):
        raise ProtocolError("where.frame", f"frame {desc.frame} is missing ({len(inline)} inline frames)",
                            "bad_frames")
    mv = frame_bytes(inline[desc.frame - 1])
    if mv.nbytes != desc.nbytes:
        raise ProtocolError("where.frame", f"frame {desc.frame} holds {mv.nbytes} bytes, "
                            f"{desc.dtype}{list(desc.shape)} needs {desc.nbytes}", "bad_frames")
    a = np.frombuffer(mv, dtype=desc.np_dtype).reshape(desc.shape)  # read-only view over the frame
    return a.copy() if copy else a
