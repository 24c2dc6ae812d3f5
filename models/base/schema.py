"""THE schema library: every record read from outside the process (wire messages, prompt.json, the pipeline config,
pack manifests) is a `Record`, a msgspec Struct whose field types carry their bounds, and is checked by msgspec's
typed decoder. A violation becomes one `SchemaError` naming the field (dotted path), the offending value and the
allowed range; `explain` is the one place that turns msgspec's ValidationError into those words, and a `Wording`
says them for one audience (the wire and the config file: TECHNICAL; prompt.json: its own, in orchestrator/).

    class Tile(Record, frozen=True):
        side: Int(4, 4096) = 32                 # an integer in [4, 4096]; bools are never integers
        overlap: Float(0.0, 0.9) = 0.5          # finite, integers accepted; NaN and Inf are refused
        name: Ident(128) = "t"                  # letters, digits and _ . : -
    Tile(side=2)                                # SchemaError: side: 2 is out of range [4, 4096]
    convert({"side": 8, "x": 1}, Tile)          # SchemaError: x: unknown field; known: side, overlap, name

A record built in code is checked exactly as one decoded from data (construction goes through msgspec.convert), so
no unchecked record exists. Rules between fields live in the record's `__post_init__` and raise SchemaError;
`Record.settled` builds a copy of checked values with new ones filled in without running those rules again (its caller
re-checks what the filling can change)."""

import contextvars
import math
import re
import types
import typing
from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec
from msgspec import UNSET, Meta, UnsetType

__all__ = ["Record", "SchemaError", "Wording", "TECHNICAL", "convert", "explain", "Int", "Float", "Text", "Ident",
           "Items", "Mapping", "UNSET", "UnsetType", "Meta", "NO_NUL", "IDENT_RE"]

NO_NUL = r"\A[^\x00]*\Z"                        # every string: a NUL ends a C string, a log line, a file name
IDENT_RE = re.compile(r"\A[A-Za-z0-9_.:\-]+\Z")  # names that end up in logs, file names and shm names
MAX_INT = 2**64 - 1                             # msgpack's widest unsigned integer
MAX_INT64 = 2**63 - 1                           # msgspec holds integer bounds as int64


class _Above64(typing.NamedTuple):
    """An upper bound past int64 (seeds reach 2**64 - 1): msgspec cannot hold it, the record checks it itself."""
    hi: int


def Int(lo: int = 0, hi: int = MAX_INT):
    """An integer in [lo, hi] (bools are not integers)."""
    if hi > MAX_INT64:
        return Annotated[int, Meta(ge=lo), _Above64(hi)]
    return Annotated[int, Meta(ge=lo, le=hi)]


def Float(lo: float = 0.0, hi: float = 1e12, *, above: float | None = None):
    """A finite number in [lo, hi] (or (above, hi]); integers are accepted and widened to float."""
    if above is not None:
        return Annotated[float, Meta(gt=above, le=hi)]
    return Annotated[float, Meta(ge=lo, le=hi)]


def Text(max_chars: int, min_chars: int = 0):
    """A string of min_chars..max_chars characters without NUL."""
    return Annotated[str, Meta(min_length=min_chars, max_length=max_chars, pattern=NO_NUL)]


def Ident(max_chars: int = 128):
    """A non-empty identifier: letters, digits and _ . : - (job ids, slot names, stage names, map keys)."""
    return Annotated[str, Meta(min_length=1, max_length=max_chars, pattern=IDENT_RE.pattern)]


def Items(item, max_items: int, min_items: int = 0):
    """A list (held as a tuple) of min_items..max_items items."""
    return Annotated[tuple[item, ...], Meta(min_length=min_items, max_length=max_items)]


def Mapping(key, value, max_items: int):
    """A map of at most max_items entries."""
    return Annotated[dict[key, value], Meta(max_length=max_items)]


class SchemaError(ValueError):
    """A record broke its schema; `field` names where (dotted path, map keys as `.key`, a bad key as `.<key>`),
    `code` says how: bad_field, unknown_field, missing_field or too_large."""

    def __init__(self, field: str, message: str, code: str = "bad_field"):
        self.field = field
        self.code = code
        self.detail = message
        super().__init__(f"{field}: {message}" if field else message)

    def under(self, prefix: str) -> "SchemaError":
        """The same error with `prefix` in front of the field path."""
        if not prefix:
            return self
        return type(self)(_join(prefix, self.field), self.detail, self.code)


def _join(prefix: str, field: str) -> str:
    if not field:
        return prefix
    if not prefix:
        return field
    return f"{prefix}{field}" if field.startswith("[") else f"{prefix}.{field}"


# ---- conversion and the one translation of msgspec's errors --------------------------------------------------------

def _plain(value):
    """Python values as the decoder would see them: float subclasses (numpy's float64) as floats."""
    t = type(value)
    if t is dict:
        return {k: _plain(v) for k, v in value.items()}
    if t is list or t is tuple:
        return t(_plain(v) for v in value)
    if t is not float and isinstance(value, float) and not isinstance(value, bool):
        return float(value)
    return value


def convert(obj: Any, tp: Any, *, wording: "Wording | None" = None, error: type = SchemaError, where: str = "",
            python: bool = False):
    """`obj` (decoded JSON/TOML/msgpack; with `python`, values from code) as a `tp`; `error` (a SchemaError) naming
    the field under `where` otherwise."""
    try:
        return msgspec.convert(_plain(obj) if python else obj, tp)
    except msgspec.ValidationError as e:
        raise explain(e, obj, tp, wording or TECHNICAL, error).under(where) from None
    except UnicodeEncodeError:                  # a key that is not Unicode text (a lone surrogate from JSON escapes)
        raise _bad_text_key(obj, tp, "", wording or TECHNICAL, error).under(where) from None


def _bad_text_key(obj, tp, path: str, wording: "Wording", error: type) -> SchemaError:
    if isinstance(obj, dict):
        cls = record_in(tp)
        for k, v in obj.items():
            try:
                str(k).encode("utf-8")
            except UnicodeEncodeError:
                if cls is not None:
                    known = fields_of(cls)
                    return error(*wording.say(path, Problem("unknown", record=cls, key=k, expected=known,
                                                            unknown=tuple(x for x in obj if x not in known))))
                return error(_join(path, "<key>"), "holds a lone surrogate, which is not valid Unicode text")
            sub = _field_types(cls).get(k, Any) if cls is not None else _value_type(tp)
            found = _bad_text_key(v, sub, _join(path, str(k).encode("utf-8", "backslashreplace").decode()),
                                  wording, error)
            if found is not None:
                return found
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found = _bad_text_key(v, _item_type(_member(tp, obj, "array"), i) if _has(tp, "array") else Any,
                                  f"{path}[{i}]", wording, error)
            if found is not None:
                return found
    return None if path else error("", "holds a lone surrogate, which is not valid Unicode text")


def _has(tp, shape: str) -> bool:
    return any(_shape_of(m) == shape for m in _members(tp))


def _value_type(tp):
    return typing.get_args(_unwrap(_member(tp, {}, "map"))[0])[1] if _has(tp, "map") else Any


def explain(e: msgspec.ValidationError, obj: Any, tp: Any, wording: "Wording",
            error: type = SchemaError) -> SchemaError:
    """The SchemaError for msgspec's error `e` on `obj` against `tp`: the path from the error's `$.a.b[0]`, the
    offending value and the declared type (with its Meta bounds) found by walking `obj` and `tp` along it."""
    text = str(e)
    message, sep, loc = text.rpartition(" - at `")
    if not sep:
        message, loc = text, "$`"
    loc = loc[:-1]                                          # drop the closing backtick
    in_key = False
    if loc.startswith("key` in `"):
        in_key, loc = True, loc[len("key` in `"):]
    cause = e.__cause__
    try:
        path, value, at = _walk(obj, tp, loc)
        if in_key:
            path, value, at = _bad_key(path, value, at)
        if isinstance(cause, _Beyond):
            path, at = _join(path, cause.key), int
            problem = Problem("range", cause.value, meta=cause.meta, declared=int)
        else:
            problem = _problem(message, value, at, cause)
    except Exception:  # noqa: BLE001 - a path this walker cannot follow: msgspec's own words, still a SchemaError
        return error(loc.removeprefix("$").lstrip("."), message)
    if isinstance(problem, SchemaError):                    # a record's own rule (its __post_init__)
        return error(_join(path, problem.field), problem.detail, problem.code)
    return error(*wording.say(path, problem))


_SEGMENT = re.compile(r"\.([^.\[\]]+)|\[(\d+|\.\.\.)\]")


def _walk(obj, tp, loc: str):
    """Follow msgspec's location `$...` through obj and tp -> (dotted path, value there, its declared type)."""
    path = ""
    rest = loc[1:]
    while rest:
        m = _SEGMENT.match(rest)
        if m is None:
            raise ValueError(f"cannot follow {loc!r}")
        rest = rest[m.end():]
        name, index = m.groups()
        if name is not None:
            cls = _member(tp, obj, "struct")
            tp = _field_types(cls)[name]
            obj = obj[name] if isinstance(obj, dict) else getattr(obj, name)
            path = _join(path, name)
        elif index != "...":
            seq = _member(tp, obj, "array")
            tp = _item_type(seq, int(index))
            obj = obj[int(index)]
            path = f"{path}[{index}]"
        else:                                               # a map value: msgspec does not say which key
            mp = _member(tp, obj, "map")
            _, value_tp = typing.get_args(_unwrap(mp)[0])
            key = next(k for k, v in obj.items() if not _fits(v, value_tp))
            tp, obj = value_tp, obj[key]
            path = _join(path, str(key))
    return path, obj, tp


def _bad_key(path: str, obj, tp):
    mp = _member(tp, obj, "map")
    key_tp, _ = typing.get_args(_unwrap(mp)[0])
    key = next(k for k in obj if not _fits(k, key_tp))
    return _join(path, "<key>"), key, key_tp


def record_in(tp):
    """The record class a declared type holds (alone, or in a union), else None."""
    try:
        return _member(tp, None, "struct")
    except ValueError:
        return None


def _fits(value, tp) -> bool:
    try:
        msgspec.convert(_plain(value), tp)
        return True
    except msgspec.ValidationError:
        return False


def _unwrap(tp) -> tuple[Any, dict]:
    """(the type under Annotated, its Meta bounds merged)."""
    meta: dict = {}
    while typing.get_origin(tp) is Annotated:
        tp, *extra = typing.get_args(tp)
        for m in extra:
            if isinstance(m, _Above64):
                meta["le"] = m.hi
            if isinstance(m, Meta):
                for attr in ("ge", "le", "gt", "lt", "min_length", "max_length", "pattern", "title", "description"):
                    if getattr(m, attr) is not None:
                        meta[attr] = getattr(m, attr)
    return tp, meta


def _members(tp) -> list:
    base, _ = _unwrap(tp)
    if typing.get_origin(base) in (Union, types.UnionType):
        return [m for m in typing.get_args(base)]
    return [tp]


def _shape_of(tp) -> str:
    """What JSON-ish shape a declared type takes: struct, array, map, null, unset, or its scalar kind."""
    base, _ = _unwrap(tp)
    origin = typing.get_origin(base)
    if isinstance(base, type) and issubclass(base, msgspec.Struct):
        return "struct"
    if origin in (tuple, list, set, frozenset) or base in (tuple, list):
        return "array"
    if origin is dict or base is dict:
        return "map"
    if base is type(None):
        return "null"
    if base is UnsetType:
        return "unset"
    if origin is Literal:
        return "choice"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(base, "any")


def _member(tp, obj, shape: str):
    """The member of a (possibly Optional/union) type that has `shape`; for several structs, the one whose tag
    `obj` names."""
    found = [m for m in _members(tp) if _shape_of(m) == shape]
    if len(found) > 1 and shape == "struct" and isinstance(obj, dict):
        for m in found:
            cfg = _unwrap(m)[0].__struct_config__
            if cfg.tag_field and obj.get(cfg.tag_field) == cfg.tag:
                return _unwrap(m)[0]
    if not found:
        raise ValueError(f"no {shape} in {tp!r}")
    return _unwrap(found[0])[0] if shape == "struct" else found[0]


_HINTS: dict = {}


def _field_types(cls) -> dict:
    """{data name: declared type} of a Struct class (cached)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = {f.encode_name: f.type for f in msgspec.structs.fields(cls)}
    return hints


def _item_type(seq, index: int):
    base, _ = _unwrap(seq)
    args = typing.get_args(base)
    if not args:
        return Any
    if len(args) == 2 and args[1] is Ellipsis or typing.get_origin(base) is not tuple:
        return args[0]
    return args[index]


class Problem(typing.NamedTuple):
    """What is wrong with one value, for a Wording: `kind` is type, range, nonfinite, length, nul, ident, pattern,
    choice, unknown or missing."""
    kind: str
    value: Any = None
    expected: tuple = ()            # type: the shapes allowed (integer, number, string, array, map, boolean, null...)
    meta: dict = {}                 # the declared bounds (ge, le, gt, lt, min_length, max_length, pattern)
    choices: tuple = ()
    count: int = 0                  # length: items or characters counted
    unit: str = ""                  # length: characters, items or entries
    record: Any = None              # unknown/missing: the record class
    key: str = ""
    unknown: tuple = ()             # unknown: every unknown key of that object
    declared: Any = None            # the declared type (a Wording may look at it)


def _problem(message: str, value, tp, cause) -> "Problem | SchemaError":
    if isinstance(cause, SchemaError):
        return cause
    for prefix, kind in (("Object missing required field `", "missing"),
                         ("Object contains unknown field `", "unknown")):
        if message.startswith(prefix):
            cls = _member(tp, value, "struct")
            known = _known(cls)
            if kind == "missing":
                return Problem("missing", record=cls, key=message[len(prefix):-1], declared=tp)
            unknown = tuple(k for k in value if k not in known)
            return Problem("unknown", record=cls, key=unknown[0], unknown=unknown, expected=known, declared=tp)
    if isinstance(cause, (ValueError, TypeError)) and message == str(cause):
        return SchemaError("", message)                     # a rule that raised a plain error
    found = classify(value, tp)
    return found if found is not None else SchemaError("", message)


def _matches(value, tp) -> bool:
    """Does value have the shape of tp (ignoring bounds)?"""
    shape = _shape_of(tp)
    if shape == "boolean":
        return isinstance(value, bool)
    if shape == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if shape == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if shape in ("string", "choice"):
        choices = typing.get_args(_unwrap(tp)[0]) if shape == "choice" else ()
        return isinstance(value, str) if not choices else isinstance(value, type(choices[0]))
    if shape == "array":
        return isinstance(value, (list, tuple))
    if shape in ("map", "struct"):
        return isinstance(value, dict) or (shape == "struct" and isinstance(value, _unwrap(tp)[0]))
    if shape == "null":
        return value is None
    return shape == "any"


def classify(value, tp) -> Problem | None:
    """What is wrong with `value` as a `tp` (None: nothing this checker sees)."""
    members = [m for m in _members(tp) if _shape_of(m) != "unset"]
    if len(members) > 1:
        for m in members:
            if _matches(value, m):
                return classify(value, m)
        given = [m for m in members if _shape_of(m) != "null"]
        if len(given) > 1:
            return Problem("type", value, expected=tuple(_shape_of(m) for m in members), declared=tp)
        members = given                         # an optional value: what it must be when given
    tp = members[0] if members else tp
    base, meta = _unwrap(tp)
    shape = _shape_of(tp)
    if not _matches(value, tp):
        return Problem("type", value, expected=(shape,), meta=meta, declared=tp,
                       choices=typing.get_args(base) if shape == "choice" else ())
    if shape == "choice":
        return None if value in typing.get_args(base) else Problem("choice", value, choices=typing.get_args(base),
                                                                   declared=tp)
    if shape in ("integer", "number"):
        if shape == "number" and isinstance(value, float) and not math.isfinite(value):
            return Problem("nonfinite", value, meta=meta, declared=tp)
        if shape == "number" and isinstance(value, int) and abs(value) > 2**53:
            return Problem("range", value, meta=meta, declared=tp)     # not a float without losing digits
        if _out_of_range(value, meta):
            return Problem("range", value, meta=meta, declared=tp)
        return None
    if shape == "string":
        n = len(value)
        if n > meta.get("max_length", n) or n < meta.get("min_length", 0):
            return Problem("length", value, meta=meta, count=n, unit="characters", declared=tp)
        pattern = meta.get("pattern")
        if pattern is not None and not re.search(pattern, value):
            if "\x00" in value:
                return Problem("nul", value, meta=meta, declared=tp)
            return Problem("ident" if pattern == IDENT_RE.pattern else "pattern", value, meta=meta, declared=tp)
        return None
    if shape in ("array", "map"):
        n = len(value)
        if n > meta.get("max_length", n) or n < meta.get("min_length", 0):
            return Problem("length", value, meta=meta, count=n, unit="items" if shape == "array" else "entries",
                           declared=tp)
    return None


def _out_of_range(value, meta: dict) -> bool:
    return (("ge" in meta and not value >= meta["ge"]) or ("le" in meta and not value <= meta["le"])
            or ("gt" in meta and not value > meta["gt"]) or ("lt" in meta and not value < meta["lt"]))


def _wide_bound(tp) -> int | None:
    for m in _members(tp):
        if typing.get_origin(m) is Annotated:
            for extra in typing.get_args(m)[1:]:
                if isinstance(extra, _Above64):
                    return extra.hi
    return None


def _meta_of(cls, key: str) -> dict:
    for m in _members(_field_types(cls)[key]):
        if _wide_bound(m) is not None:
            return {**_unwrap(m)[1], "le": _wide_bound(m)}
    return {}


class _Beyond(ValueError):
    """An integer past a bound msgspec cannot hold (raised by the record's generated __post_init__)."""

    def __init__(self, key: str, value: int, meta: dict):
        self.key, self.value, self.meta = key, value, meta
        super().__init__(f"{key}: {value} is out of range")


def _known(cls) -> tuple[str, ...]:
    """A record's keys as messages list them: its own fields first, then those of its bases."""
    names = cls.__struct_fields__
    out: list = []
    for k in cls.__mro__:
        for n in k.__dict__.get("__annotations__", {}):
            if n in names and n not in out:
                out.append(n)
    return tuple(out)


def fields_of(cls) -> tuple[str, ...]:
    """The data names of a record's fields, in order."""
    return cls.__struct_encode_fields__


def base_types(cls) -> dict[str, type]:
    """Each field's plain Python type (int for a bounded Int, ...), by its name in code."""
    return {f.name: _unwrap(f.type)[0] for f in msgspec.structs.fields(cls)}



# ---- records ----------------------------------------------------------------------------------------------------

_SETTLED = contextvars.ContextVar("schema_settled", default=False)     # Record.settled: the rules are not re-run


class _RecordMeta(msgspec.StructMeta):
    """Calling a record class builds it through `convert`: code cannot make a record the decoder would refuse.
    Every record's fields are keyword-only (msgspec's option is per class: set here once for all)."""

    def __new__(mcls, name, bases, namespace, **options):
        options.setdefault("kw_only", True)
        wide = {k: v for b in bases for k, v in getattr(b, "_WIDE_INTS", {}).items()}
        wide.update({k: hi for k, tp in namespace.get("__annotations__", {}).items()
                     if (hi := _wide_bound(tp)) is not None})
        own = namespace.get("__post_init__") or next(
            (b.__dict__["_OWN_POST_INIT"] for b in bases if "_OWN_POST_INIT" in b.__dict__), None)
        if wide or own is not None:             # the bounds msgspec cannot check, then the record's own rules
            namespace["_WIDE_INTS"], namespace["_OWN_POST_INIT"] = wide, own

            def __post_init__(self):
                for key, hi in wide.items():
                    value = getattr(self, key)
                    if isinstance(value, int) and value > hi:
                        raise _Beyond(key, value, _meta_of(type(self), key))
                if own is not None and not _SETTLED.get():
                    own(self)
            namespace["__post_init__"] = __post_init__
        return super().__new__(mcls, name, bases, namespace, **options)

    def __call__(cls, *args, **kw):
        return cls._build(*args, **kw)


class Record(msgspec.Struct, metaclass=_RecordMeta, kw_only=True, forbid_unknown_fields=True):
    """Base of every validated record. Subclasses add `frozen=True` where the record is a value.

    KEY_NOUN names the record's keys in messages ("field", "setting"); WIRE_DEFAULTS: fields the data must carry
    (no default for the decoder) that code may leave out when it builds the record (name -> factory); ERROR and
    WORDING: the SchemaError subclass construction raises, and its words. A field's Meta(description=...) says what
    it must be where its type alone would not (a Wording may use it)."""

    KEY_NOUN: ClassVar[str] = "field"
    UNKNOWN_AT_TABLE: ClassVar[bool] = False    # unknown keys are reported all at once, at the record's own path
    WIRE_DEFAULTS: ClassVar[dict] = {}
    ERROR: ClassVar[type] = SchemaError
    WORDING: ClassVar[Any] = None               # construction's Wording (None: TECHNICAL)

    @classmethod
    def _build(cls, *args, **kw):
        if args:                                # positional: in field order (also how pickle and copy rebuild)
            names = cls.__struct_fields__
            if len(args) > len(names):
                raise TypeError(f"{cls.__name__} takes at most {len(names)} positional arguments")
            for name, value in zip(names, args):
                if name in kw:
                    raise TypeError(f"{cls.__name__} got two values for {name!r}")
                kw[name] = value
        for name, make in cls.WIRE_DEFAULTS.items():
            if name not in kw:
                kw[name] = make()
        return convert(kw, cls, wording=cls.WORDING, error=cls.ERROR, python=True)

    @classmethod
    def from_data(cls, obj: Any, where: str = ""):
        """A record from decoded data (JSON, TOML, msgpack objects), checked; cls.ERROR naming the field under
        `where` otherwise."""
        return convert(obj, cls, wording=cls.WORDING, error=cls.ERROR, where=where)

    @classmethod
    def settled(cls, fields: dict):
        """A record of values that already passed this record's rules (a copy with fields filled from checked data,
        e.g. a prompt record resolved against its pack): built by type, every field's type and bounds checked as
        usual, its own rules (`__post_init__`) not run again. The caller checks what its filling could change."""
        token = _SETTLED.set(True)
        try:
            return cls(**fields)
        finally:
            _SETTLED.reset(token)

    def replace(self, **changes):
        """A copy with some fields changed, checked like any new record."""
        return type(self)(**{**{n: getattr(self, n) for n in self.__struct_fields__}, **changes})

    def to_dict(self) -> dict:
        """The record as plain data (JSON- and msgpack-ready)."""
        return msgspec.to_builtins(self)


# ---- wording ------------------------------------------------------------------------------------------------------

class Wording:
    """How a Problem reads for one audience; `say(path, problem)` -> (field, message, code). TECHNICAL words the wire
    and the config file; subclasses change single phrases (prompt.json speaks JSON to its users)."""

    TYPE_NAMES = {"boolean": "boolean", "integer": "integer", "number": "float", "string": "string",
                  "choice": "string", "array": "array", "map": "dict", "struct": "dict", "null": "null", "any": "any"}

    def say(self, path: str, p: Problem) -> tuple[str, str, str]:
        if p.kind == "unknown":
            return self.unknown(path, p)
        if p.kind == "missing":
            return _join(path, p.key), self.missing(p), "missing_field"
        text = getattr(self, p.kind)(p)
        too_large = p.kind == "length" and p.count > p.meta.get("max_length", p.count)
        return path, text, "too_large" if too_large else "bad_field"

    # one method per Problem kind
    def type(self, p: Problem) -> str:
        names = " or ".join(dict.fromkeys(self.TYPE_NAMES[e] for e in p.expected))
        return f"expected {names}, got {type(p.value).__name__} ({_short(p.value)})"

    def range(self, p: Problem) -> str:
        return f"{self.number(p.value, p.declared)} is out of range {self.bounds(p.meta)}"

    def nonfinite(self, p: Problem) -> str:
        if p.value != p.value:
            return "NaN is not a value"
        return self.range(p)

    def length(self, p: Problem) -> str:
        lo, hi = p.meta.get("min_length", 0), p.meta.get("max_length")
        return f"expected {lo}..{hi if hi is not None else ''} {p.unit}, got {p.count}"

    def nul(self, p: Problem) -> str:
        return "contains a NUL character"

    def ident(self, p: Problem) -> str:
        return f"{_short(p.value)} may only hold letters, digits and _ . : -"

    def pattern(self, p: Problem) -> str:
        return f"{_short(p.value)} does not match {p.meta.get('pattern')}"

    def choice(self, p: Problem) -> str:
        return f"{_short(p.value)} is not one of {', '.join(map(str, p.choices))}"

    def missing(self, p: Problem) -> str:
        return "missing required field"

    def unknown(self, path: str, p: Problem) -> tuple[str, str, str]:
        noun = p.record.KEY_NOUN
        if p.record.UNKNOWN_AT_TABLE:
            return path, f"unknown {noun} {sorted(map(str, p.unknown))}; known: {', '.join(p.expected)}", "unknown_field"
        return _join(path, str(p.key)), f"unknown {noun}; known: {', '.join(p.expected)}", "unknown_field"

    # helpers a subclass may reuse
    @staticmethod
    def number(value, declared) -> str:
        if _shape_of(declared) == "number" and isinstance(value, int) and abs(value) <= 2**53:
            return str(float(value))
        return str(value)

    @staticmethod
    def bounds(meta: dict) -> str:
        lo = f"[{meta['ge']}" if "ge" in meta else f"({meta['gt']}" if "gt" in meta else "(-inf"
        hi = f"{meta['le']}]" if "le" in meta else f"{meta['lt']})" if "lt" in meta else "inf)"
        return f"{lo}, {hi}"


def _short(value) -> str:
    return f"{value!r:.80}"


TECHNICAL = Wording()
