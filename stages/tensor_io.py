"""Reading request tensors and placing reply tensors, wherever a descriptor points: an arena slot or an inline frame."""
from __future__ import annotations

import numpy as np

from protocol.fields import ProtocolError
from protocol.tensors import DTYPES, InlineFrames, TensorDesc, from_inline


def read_tensor(ctx, arena: str | None, desc: TensorDesc, inline, *, field: str, dtype: str | None = None,
                shape: tuple | None = None, copy: bool = False) -> np.ndarray:
    """The array `desc` points at (a view unless `copy`); `dtype`/`shape` are checked when given, naming `field`."""
    if dtype is not None and desc.dtype != dtype:
        raise ProtocolError(field, f"expected dtype {dtype}, got {desc.dtype}")
    if shape is not None and tuple(desc.shape) != tuple(shape):
        raise ProtocolError(field, f"expected shape {list(shape)}, got {list(desc.shape)}")
    if desc.inline:
        return from_inline(desc, inline, copy=copy)
    if arena is None:
        raise ProtocolError(field, "points at an arena slot but the request names no arena")
    return ctx.arena(arena).read(desc, copy=copy)


class ReplyTensors:
    """Places outputs: into the slot a request named, or, for remote peers, as inline frames of the reply."""

    def __init__(self, ctx, arena: str | None):
        self.ctx, self.arena = ctx, arena
        self.frames = InlineFrames()

    def put(self, array: np.ndarray, target: TensorDesc | None, *, field: str) -> TensorDesc:
        if target is None or target.inline:
            if target is not None:
                _check(array, target, field)
            return self.frames.add(array, target.dtype if target is not None else None)
        if self.arena is None:
            raise ProtocolError(field, "points at an arena slot but the request names no arena")
        _check(array, target, field)
        self.ctx.arena(self.arena).write(target, array)
        return target

    @property
    def inline(self) -> tuple:
        return tuple(self.frames.frames)


def _check(array: np.ndarray, target: TensorDesc, field: str) -> None:
    if tuple(array.shape) != tuple(target.shape):
        raise ProtocolError(field, f"output has shape {list(array.shape)}, the request expects {list(target.shape)}")
    if np.dtype(array.dtype) != DTYPES[target.dtype] and target.dtype != "bf16":
        raise ProtocolError(field, f"output is {array.dtype}, the request expects {target.dtype}")
