"""Tensor descriptors `{dtype, shape, where}` and helpers to move numpy arrays as inline frames or arena slots."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from protocol.fields import IDENT_RE, MAX_NAME_CHARS, ProtocolError, Spec

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


@dataclasses.dataclass(frozen=True)
class TensorDesc:
    """Where a tensor lives: `slot`+`offset` in the job's shared-memory arena, or inline multipart `frame` k (k >= 1)."""

    dtype: str
    shape: tuple[int, ...]
    slot: str | None = None
    offset: int = 0
    frame: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))
        _check_desc(self.dtype, self.shape, self.slot, self.offset, self.frame, "")

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
        return self.frame is not None

    def to_wire(self) -> dict:
        where = {"frame": self.frame} if self.frame is not None else {"slot": self.slot, "offset": self.offset}
        return {"dtype": self.dtype, "shape": list(self.shape), "where": where}

    @classmethod
    def from_wire(cls, obj: Any, path: str = "") -> "TensorDesc":
        p = (lambda name: f"{path}.{name}" if path else name)
        if not isinstance(obj, dict):
            raise ProtocolError(path, f"expected a tensor descriptor map, got {type(obj).__name__}")
        for key in obj:
            if key not in ("dtype", "shape", "where"):
                raise ProtocolError(p(str(key)), "unknown field for a tensor descriptor", "unknown_field")
        for key in ("dtype", "shape", "where"):
            if key not in obj:
                raise ProtocolError(p(key), "missing required field", "missing_field")
        shape, where = obj["shape"], obj["where"]
        if not isinstance(shape, (list, tuple)):
            raise ProtocolError(p("shape"), f"expected a list, got {type(shape).__name__}")
        if not isinstance(where, dict):
            raise ProtocolError(p("where"), f"expected a map, got {type(where).__name__}")
        keys = set(where)
        if keys == {"frame"}:
            slot, offset, frame = None, 0, where["frame"]
        elif keys == {"slot", "offset"}:
            slot, offset, frame = where["slot"], where["offset"], None
        else:
            raise ProtocolError(p("where"), "must be {frame: k} or {slot: name, offset: bytes}")
        _check_desc(obj["dtype"], shape, slot, offset, frame, path)
        return cls(obj["dtype"], tuple(shape), slot, offset, frame)


def _check_desc(dtype, shape, slot, offset, frame, path: str) -> None:
    p = (lambda name: f"{path}.{name}" if path else name)
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError(p("dtype"), f"{dtype!r} is not one of {', '.join(DTYPES)}")
    if len(shape) > MAX_NDIM:
        raise ProtocolError(p("shape"), f"{len(shape)} dimensions exceed the limit of {MAX_NDIM}", "too_large")
    numel = 1
    for i, d in enumerate(shape):
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= MAX_DIM:
            raise ProtocolError(p(f"shape[{i}]"), f"{d!r} is not a dimension in [0, {MAX_DIM}]")
        numel *= d
    if numel * DTYPES[dtype].itemsize > MAX_TENSOR_BYTES:
        raise ProtocolError(p("shape"), f"{numel} elements exceed the tensor limit of {MAX_TENSOR_BYTES} bytes",
                            "too_large")
    if (slot is None) == (frame is None):
        raise ProtocolError(p("where"), "exactly one of slot or frame must be given")
    if frame is not None:
        if isinstance(frame, bool) or not isinstance(frame, int) or not 1 <= frame <= MAX_FRAME_INDEX:
            raise ProtocolError(p("where.frame"), f"{frame!r} is not a frame index in [1, {MAX_FRAME_INDEX}]")
    else:
        if not isinstance(slot, str) or not slot or len(slot) > MAX_NAME_CHARS or not IDENT_RE.match(slot):
            raise ProtocolError(p("where.slot"), f"{slot!r} is not a slot name")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= 2**48:
            raise ProtocolError(p("where.offset"), f"{offset!r} is not a byte offset")


class Tensor(Spec):
    """Record field holding a TensorDesc (instance or wire map)."""

    def check(self, value, path):
        if isinstance(value, TensorDesc):
            return value
        return TensorDesc.from_wire(value, path)

    def to_wire(self, value):
        return value.to_wire()


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
