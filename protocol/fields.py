"""Field validators and the `Record` base class: strict, typed checks that name the bad field."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

# Limits shared by every message (units in the names).
MAX_NAME_CHARS = 128  # identifiers, stage names, slot names, map keys
MAX_PATH_CHARS = 4096  # file-system paths
MAX_TEXT_CHARS = 65_536  # prompts and free text (the job-level prompt limit is lower)
MAX_MAP_ITEMS = 64  # entries of any map field
MAX_LIST_ITEMS = 4096  # items of any list field unless the field says less
MAX_INT = 2**64 - 1  # msgpack's widest unsigned integer

IDENT_RE = re.compile(r"^[A-Za-z0-9_.:\-]+$")  # names that end up in logs, file names and shm names


class ProtocolError(Exception):
    """A message broke the protocol; `field` names where (dotted path), `code` says how."""

    def __init__(self, field: str, message: str, code: str = "bad_field"):
        self.field = field
        self.code = code
        self.detail = message
        super().__init__(f"{field}: {message}" if field else message)

    def under(self, prefix: str) -> "ProtocolError":
        """The same error with `prefix` in front of the field path."""
        if not prefix:
            return self
        field = f"{prefix}.{self.field}" if self.field and not self.field.startswith("[") else f"{prefix}{self.field}"
        return ProtocolError(field, self.detail, self.code)


def _type_name(value: Any) -> str:
    return type(value).__name__


class Spec:
    """Base validator: `check(value, path)` returns the normalized value or raises ProtocolError."""

    def check(self, value: Any, path: str) -> Any:
        raise NotImplementedError

    def to_wire(self, value: Any) -> Any:
        return value


class Int(Spec):
    def __init__(self, lo: int = 0, hi: int = MAX_INT):
        self.lo, self.hi = lo, hi

    def check(self, value, path):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(path, f"expected an integer, got {_type_name(value)}")
        if not self.lo <= value <= self.hi:
            raise ProtocolError(path, f"{value} is out of range [{self.lo}, {self.hi}]")
        return value


class Float(Spec):
    """A finite float in [lo, hi]; integers are accepted and widened."""

    def __init__(self, lo: float = 0.0, hi: float = 1e12):
        self.lo, self.hi = lo, hi

    def check(self, value, path):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(path, f"expected a number, got {_type_name(value)}")
        if isinstance(value, int) and abs(value) > 2**53:
            raise ProtocolError(path, f"{value} is out of range [{self.lo}, {self.hi}]")
        value = float(value)
        if not math.isfinite(value):
            raise ProtocolError(path, f"{value} is not finite")
        if not self.lo <= value <= self.hi:
            raise ProtocolError(path, f"{value} is out of range [{self.lo}, {self.hi}]")
        return value


class Bool(Spec):
    def check(self, value, path):
        if not isinstance(value, bool):
            raise ProtocolError(path, f"expected true/false, got {_type_name(value)}")
        return value


class Str(Spec):
    """A string of at most `max_chars`; optionally an identifier, or one of `choices`."""

    def __init__(self, max_chars: int = MAX_NAME_CHARS, *, min_chars: int = 0, ident: bool = False,
                 choices: tuple[str, ...] | None = None):
        self.max_chars, self.min_chars, self.ident, self.choices = max_chars, min_chars, ident, choices

    def check(self, value, path):
        if not isinstance(value, str):
            raise ProtocolError(path, f"expected a string, got {_type_name(value)}")
        if len(value) > self.max_chars:
            raise ProtocolError(path, f"string of {len(value)} chars exceeds the limit of {self.max_chars}", "too_large")
        if len(value) < self.min_chars:
            raise ProtocolError(path, "must not be empty" if self.min_chars == 1 else f"shorter than {self.min_chars}")
        if "\x00" in value:
            raise ProtocolError(path, "contains a NUL character")
        if self.choices is not None and value not in self.choices:
            raise ProtocolError(path, f"{value!r} is not one of {', '.join(self.choices)}")
        if self.ident and value and not IDENT_RE.match(value):
            raise ProtocolError(path, f"{value!r} may only hold letters, digits and _ . : -")
        return value


def Name(**kw) -> Str:
    """A non-empty identifier (job ids, slot names, stage names)."""
    return Str(MAX_NAME_CHARS, min_chars=1, ident=True, **kw)


def Path(**kw) -> Str:
    return Str(MAX_PATH_CHARS, min_chars=1, **kw)


class Optional(Spec):
    def __init__(self, inner: Spec):
        self.inner = inner

    def check(self, value, path):
        return None if value is None else self.inner.check(value, path)

    def to_wire(self, value):
        return None if value is None else self.inner.to_wire(value)


class List(Spec):
    """A list (normalized to a tuple) of items checked by `item`."""

    def __init__(self, item: Spec, *, max_items: int = MAX_LIST_ITEMS, min_items: int = 0):
        self.item, self.max_items, self.min_items = item, max_items, min_items

    def check(self, value, path):
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(path, f"expected a list, got {_type_name(value)}")
        if len(value) > self.max_items:
            raise ProtocolError(path, f"list of {len(value)} items exceeds the limit of {self.max_items}", "too_large")
        if len(value) < self.min_items:
            raise ProtocolError(path, f"needs at least {self.min_items} item(s), got {len(value)}")
        return tuple(self.item.check(v, f"{path}[{i}]") for i, v in enumerate(value))

    def to_wire(self, value):
        return [self.item.to_wire(v) for v in value]


class Map(Spec):
    """A map from identifier keys to values checked by `value`."""

    def __init__(self, value: Spec, *, max_items: int = MAX_MAP_ITEMS, keys: tuple[str, ...] | None = None,
                 key_chars: int = MAX_NAME_CHARS):
        self.value, self.max_items, self.keys = value, max_items, keys
        self.key = Str(key_chars, min_chars=1, ident=True, choices=keys)

    def check(self, value, path):
        if not isinstance(value, dict):
            raise ProtocolError(path, f"expected a map, got {_type_name(value)}")
        if len(value) > self.max_items:
            raise ProtocolError(path, f"map of {len(value)} entries exceeds the limit of {self.max_items}", "too_large")
        out = {}
        for k, v in value.items():
            self.key.check(k, f"{path}.<key>")
            out[k] = self.value.check(v, f"{path}.{k}")
        return out

    def to_wire(self, value):
        return {k: self.value.to_wire(v) for k, v in value.items()}


class Nested(Spec):
    """A nested Record (given as an instance or as a map)."""

    def __init__(self, cls: type["Record"]):
        self.cls = cls

    def check(self, value, path):
        if isinstance(value, self.cls):
            return value
        return self.cls.from_wire(value, path)

    def to_wire(self, value):
        return value.to_wire()


class Struct(Spec):
    """A plain frozen dataclass defined elsewhere (models/: one class for the in-process value and its wire form),
    checked field by field here: unknown fields, missing required ones and ill-typed values raise ProtocolError."""

    def __init__(self, cls: type, required: tuple[str, ...] = (), **fields: Spec):
        """required: fields the wire must carry even where the class has a default."""
        self.cls, self.fields = cls, fields
        known = {f.name: f for f in dataclasses.fields(cls)}
        missing = set(fields) ^ set(known)
        if missing:
            raise TypeError(f"Struct({cls.__name__}) must declare exactly its fields; differing: {sorted(missing)}")
        self.required = set(required) | {n for n, f in known.items()
                                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}

    def check(self, value, path):
        if isinstance(value, self.cls):
            value = {n: getattr(value, n) for n in self.fields}
        elif not isinstance(value, dict):
            raise ProtocolError(path, f"expected a map, got {_type_name(value)}")
        for key in value:
            if key not in self.fields:
                raise ProtocolError(f"{path}.{key}" if path else str(key), f"unknown field for {self.cls.__name__}",
                                    "unknown_field")
        for name in self.required - set(value):
            raise ProtocolError(f"{path}.{name}" if path else name, "missing required field", "missing_field")
        return self.cls(**{k: self.fields[k].check(v, f"{path}.{k}" if path else k) for k, v in value.items()})

    def to_wire(self, value):
        return {n: s.to_wire(getattr(value, n)) for n, s in self.fields.items()}


def spec(validator: Spec, default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING):
    """Declare a Record field checked by `validator` (optionally with a default or a default factory)."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"spec": validator})


def wire_fields(cls) -> tuple[dataclasses.Field, ...]:
    """The fields of a Record that travel on the wire (those declared with `spec`)."""
    cached = cls.__dict__.get("_wire_fields")
    if cached is None:
        cached = tuple(f for f in dataclasses.fields(cls) if "spec" in f.metadata)
        setattr(cls, "_wire_fields", cached)
    return cached


class Record:
    """Base of typed wire records (messages and their nested parts): validated on construction and on decode.

    Subclasses are `@dataclasses.dataclass(frozen=True, kw_only=True)` with every wire field declared by `spec(...)`.
    """

    def __post_init__(self):
        for f in wire_fields(type(self)):
            object.__setattr__(self, f.name, f.metadata["spec"].check(getattr(self, f.name), f.name))

    @classmethod
    def from_wire(cls, obj: Any, path: str = ""):
        """Build from a decoded msgpack map: missing, extra and ill-typed fields raise ProtocolError naming them."""
        if not isinstance(obj, dict):
            raise ProtocolError(path, f"expected a map, got {_type_name(obj)}")
        fields = wire_fields(cls)
        names = {f.name for f in fields}
        for key in obj:
            if not isinstance(key, str) or key not in names:
                where = f"{path}.{key}" if path else str(key)
                raise ProtocolError(where, f"unknown field for {cls.__name__}", "unknown_field")
        kwargs = {}
        for f in fields:
            if f.name in obj:
                kwargs[f.name] = obj[f.name]
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{path}.{f.name}" if path else f.name, "missing required field", "missing_field")
        try:
            return cls(**kwargs)
        except ProtocolError as e:
            raise e.under(path) from None

    def to_wire(self) -> dict:
        """The msgpack-ready map of wire fields."""
        return {f.name: f.metadata["spec"].to_wire(getattr(self, f.name)) for f in wire_fields(type(self))}


class Scalar(Spec):
    """A plain value for free-form info maps: string, integer, finite float, bool or null."""

    def __init__(self, max_chars: int = MAX_PATH_CHARS):
        self.text = Str(max_chars)

    def check(self, value, path):
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            return Int(-(2**63), MAX_INT).check(value, path)
        if isinstance(value, float):
            return Float(-1e300, 1e300).check(value, path)
        if isinstance(value, str):
            return self.text.check(value, path)
        raise ProtocolError(path, f"expected a string, number, bool or null, got {_type_name(value)}")
