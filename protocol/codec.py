"""msgpack codec: `encode(msg) -> frames` and `decode(frames) -> msg`, with hard size limits and no pickle."""

import typing
from typing import Any, Iterator, Sequence, Union

import msgpack
import msgspec

from models.base.schema import TECHNICAL, convert
from protocol.fields import ProtocolError
from protocol.messages import KINDS, PROTOCOL_VERSION, Message
from protocol.tensors import TensorDesc, frame_bytes

MAX_HEADER_BYTES = 1 * 2**20  # frame 0 (the msgpack map)
MAX_FRAME_BYTES = 512 * 2**20  # one inline tensor frame
MAX_FRAMES = 64  # frames per message, header included
MAX_MESSAGE_BYTES = 1 * 2**30  # all frames together (sockets cap each frame at MAX_FRAME_BYTES: MAXMSGSIZE)
_MAX_CONTAINER_ITEMS = 8192  # any msgpack array or map inside frame 0

# Only a frame 0 the typed decoder refused is parsed again, by msgpack with these limits, to name what is wrong.
_UNPACK_LIMITS = dict(
    raw=False, strict_map_key=True, use_list=True,
    max_str_len=MAX_HEADER_BYTES, max_bin_len=0, max_ext_len=0,
    max_array_len=_MAX_CONTAINER_ITEMS, max_map_len=_MAX_CONTAINER_ITEMS,
)
_DECODER = msgspec.msgpack.Decoder(Union[tuple(KINDS.values())])     # every kind, told apart by its "kind" tag
_ENCODER = msgspec.msgpack.Encoder()


def iter_tensors(record: Any, path: str = "") -> Iterator[tuple[str, TensorDesc]]:
    """Every tensor descriptor inside a record (messages included), with its dotted field path."""
    if isinstance(record, TensorDesc):
        yield path, record
    elif isinstance(record, msgspec.Struct):
        for name in _tensor_fields(type(record)):
            yield from iter_tensors(getattr(record, name), f"{path}.{name}" if path else name)
    elif isinstance(record, (list, tuple)):
        for i, v in enumerate(record):
            yield from iter_tensors(v, f"{path}[{i}]")
    elif isinstance(record, dict):
        for k, v in record.items():
            yield from iter_tensors(v, f"{path}.{k}")


_TENSOR_FIELDS: dict[type, tuple[str, ...]] = {}


def _tensor_fields(cls) -> tuple[str, ...]:
    """The fields of a record class whose declared type can hold a TensorDesc (cached per class)."""
    names = _TENSOR_FIELDS.get(cls)
    if names is None:
        names = _TENSOR_FIELDS[cls] = tuple(f.name for f in msgspec.structs.fields(cls) if _holds_tensor(f.type))
    return names


def _holds_tensor(tp, seen=()) -> bool:
    if tp is TensorDesc:
        return True
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp not in seen and any(_holds_tensor(f.type, seen + (tp,)) for f in msgspec.structs.fields(tp))
    return any(_holds_tensor(a, seen) for a in typing.get_args(tp))


def _check_frames(msg: Message, frames: Sequence[Any]) -> None:
    """Each inline frame is referenced by exactly one descriptor and holds exactly dtype × shape bytes."""
    used: dict[int, str] = {}
    for path, desc in iter_tensors(msg):
        if desc.frame is None:
            continue
        where = f"{path}.where.frame"
        if desc.frame in used:
            raise ProtocolError(where, f"frame {desc.frame} is also used by {used[desc.frame]}", "bad_frames")
        if desc.frame >= len(frames):
            raise ProtocolError(where, f"frame {desc.frame} is missing (message has {len(frames)} frames)",
                                "bad_frames")
        got = frame_bytes(frames[desc.frame]).nbytes
        if got != desc.nbytes:
            raise ProtocolError(where, f"frame {desc.frame} holds {got} bytes, {desc.dtype}{list(desc.shape)} "
                                f"needs {desc.nbytes}", "bad_frames")
        used[desc.frame] = path
    if len(used) != len(frames) - 1:
        spare = sorted(set(range(1, len(frames))) - set(used))
        raise ProtocolError("frames", f"frame(s) {spare} are not referenced by any tensor descriptor", "bad_frames")


def _check_sizes(frames: Sequence[Any]) -> list[memoryview]:
    if not frames:
        raise ProtocolError("frames", "empty message", "bad_frames")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError("frames", f"{len(frames)} frames exceed the limit of {MAX_FRAMES}", "too_large")
    views = [frame_bytes(f) for f in frames]
    if views[0].nbytes > MAX_HEADER_BYTES:
        raise ProtocolError("frame0", f"{views[0].nbytes} bytes exceed the header limit of {MAX_HEADER_BYTES}",
                            "too_large")
    total = 0
    for i, v in enumerate(views[1:], 1):
        if v.nbytes > MAX_FRAME_BYTES:
            raise ProtocolError(f"frames[{i}]", f"{v.nbytes} bytes exceed the frame limit of {MAX_FRAME_BYTES}",
                                "too_large")
        total += v.nbytes
    if total + views[0].nbytes > MAX_MESSAGE_BYTES:
        raise ProtocolError("frames", f"{total} bytes exceed the message limit of {MAX_MESSAGE_BYTES}", "too_large")
    return views


def encode(msg: Message) -> list[Any]:
    """Frames for `msg`: the msgpack header, then `msg.inline` unchanged (zero copy). Checks frames and limits."""
    if not isinstance(msg, Message) or type(msg).KIND not in KINDS:
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    frames = [_ENCODER.encode(msg), *msg.inline]
    _check_sizes(frames)
    _check_frames(msg, frames)
    return frames


def peek_id(frame0: Any) -> int:
    """Best-effort request id of a (possibly broken) header, so an ERROR reply can carry it; 0 when unknown."""
    try:
        head = msgpack.unpackb(frame_bytes(frame0), **_UNPACK_LIMITS)
        rid = head.get("id") if isinstance(head, dict) else None
        return rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63 else 0
    except Exception:  # noqa: BLE001 - any garbage means "no id"
        return 0


def decode(frames: Sequence[Any]) -> Message:
    """The message in `frames` (bytes, memoryviews or zmq.Frames); any violation raises ProtocolError naming the field.

    Inline frames stay zero-copy: `msg.inline` holds memoryviews of frames 1..n.
    """
    views = _check_sizes(frames)
    try:
        msg = _DECODER.decode(views[0])
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise _diagnose(views[0]) from None
    msg.attach(views[1:])
    _check_frames(msg, views)
    return msg


def _diagnose(frame0: memoryview) -> ProtocolError:
    """What is wrong with a frame 0 the typed decoder refused: the header's v, kind and id in that order, then the
    fields (models.base.schema.explain names the field and its bounds)."""
    try:
        head = msgpack.unpackb(frame0, **_UNPACK_LIMITS)
    except Exception as e:  # msgpack raises several types for malformed or oversized input
        return ProtocolError("frame0", f"not a valid msgpack map within limits ({type(e).__name__}: {e})"[:400],
                             "bad_request")
    if not isinstance(head, dict):
        return ProtocolError("frame0", f"expected a msgpack map, got {type(head).__name__}")
    if "v" not in head:
        return ProtocolError("v", "missing protocol version", "version")
    if head["v"] != PROTOCOL_VERSION or isinstance(head["v"], bool):
        return ProtocolError("v", f"protocol version {head['v']!r} is not {PROTOCOL_VERSION}"[:200], "version")
    kind = head.get("kind")
    if not isinstance(kind, str):
        return ProtocolError("kind", f"missing or not a string: {kind!r}"[:200], "unknown_kind")
    cls = KINDS.get(kind)
    if cls is None:
        return ProtocolError("kind", f"unknown message kind {kind[:64]!r}", "unknown_kind")
    if "id" not in head:
        return ProtocolError("id", "missing required field", "missing_field")
    try:
        convert({k: v for k, v in head.items() if k != "kind"}, cls, wording=TECHNICAL, error=ProtocolError)
    except ProtocolError as e:
        return e
    return ProtocolError("frame0", "not a message this decoder reads", "bad_request")
