"""The wire's field types and limits (msgspec types with bounds, models/base/schema.py) and ProtocolError."""

from typing import Annotated, ClassVar

from models.base.schema import Float, Ident, Int, Items, Mapping, Meta, Record, SchemaError, Text  # noqa: F401

# Limits shared by every message (units in the names).
MAX_NAME_CHARS = 128  # identifiers, stage names, slot names, map keys
MAX_PATH_CHARS = 4096  # file-system paths
MAX_TEXT_CHARS = 65_536  # prompts and free text (the job-level prompt limit is lower)
MAX_MAP_ITEMS = 64  # entries of any map field
MAX_LIST_ITEMS = 4096  # items of any list field unless the field says less


class ProtocolError(SchemaError):
    """A message broke the protocol; `field` names where (dotted path), `code` says how (bad_field, unknown_field,
    missing_field, too_large, or a codec code: version, unknown_kind, bad_frames, bad_request)."""


class WireRecord(Record):
    """Base of the messages' nested records: building one with a bad value raises ProtocolError."""

    ERROR: ClassVar[type] = ProtocolError


Name = Ident(MAX_NAME_CHARS)                    # a non-empty identifier: job ids, slot names, stage names
Path = Text(MAX_PATH_CHARS, 1)                  # a file-system path
Note = Text(MAX_PATH_CHARS)                     # free text of an error, a reason, a note
Version = Text(64)                              # a software version
Seconds = Float()                               # a duration or a time stamp, in [0, 1e12]
Count = Int(0, 2**40)


def Map(value, max_items: int = MAX_MAP_ITEMS, key=Name):
    """A map from identifier keys to `value`s (the wire's default bounds)."""
    return Mapping(key, value, max_items)


def List(item, max_items: int = MAX_LIST_ITEMS, min_items: int = 0):
    """A list (held as a tuple) of `item`s (the wire's default bounds)."""
    return Items(item, max_items, min_items)


# A plain value of a free-form info map: string, integer, finite float, bool or null.
# (msgpack carries no integer past [-2**63, 2**64 - 1])
Scalar = Annotated[int, Meta(ge=-(2**63))] | Float(-1e300, 1e300) | Text(MAX_PATH_CHARS) | bool | None
