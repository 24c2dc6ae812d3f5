"""prompt.json: strict validation into a `PromptSpec`; every error names the field and the allowed values."""
from __future__ import annotations

import json
import math
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path

from models.text.prompt_weights import PromptWeightError, check_prompt

MAX_FILE_BYTES = 64 * 1024      # a prompt file larger than this is refused before parsing
MAX_PROMPT_CHARS = 4000         # per prompt (the text encoder keeps at most 512 tokens anyway)
MAX_STEPS = 200
MAX_CFG = 30.0
MAX_SIDE = 4096                 # pixels
SEED_LIMIT = 2 ** 64            # seeds are 0 <= seed < 2^64
SAMPLERS = ("euler",)
SCHEDULERS = ("sgm_uniform", "simple")
DEFAULT_STEPS = 30
DEFAULT_CFG = 4.0

# Spectrum settings: name -> (type, low, high, default). Defaults as in anima-facts.md (stable-diffusion.cpp).
SPECTRUM_FIELDS = {
    "w": (float, 0.0, 1.0, 0.4),        # blend weight of the Chebyshev forecast vs the Taylor step
    "m": (int, 1, 8, 3),                # Chebyshev degree
    "lam": (float, 0.0, 100.0, 1.0),    # ridge penalty
    "window": (float, 1.0, 50.0, 2.0),  # initial forecast window
    "flex": (float, 0.0, 10.0, 0.5),    # window growth per computed call after warm-up
    "warmup": (int, 0, MAX_STEPS, 4),   # calls always computed at the start
    "stop": (float, 0.0, 1.0, 0.9),     # fraction of the steps after which every call is computed
}
MAX_INT_DIGITS = 40             # a JSON integer longer than this is never a valid value (seeds are < 2^64: 20 digits)
TOP_FIELDS = ("prompt", "negative_prompt", "seed", "steps", "cfg", "width", "height", "sampler", "scheduler",
              "spectrum", "output", "overwrite")


class PromptError(ValueError):
    """A prompt.json problem; `field` is the dotted field name ('' for the file as a whole)."""

    def __init__(self, field: str, message: str):
        self.field, self.detail = field, message
        super().__init__(f"prompt.json: field '{field}': {message}" if field else f"prompt.json: {message}")


@dataclass(frozen=True)
class SpectrumSettings:
    enabled: bool = True
    w: float = 0.4
    m: int = 3
    lam: float = 1.0
    window: float = 2.0
    flex: float = 0.5
    warmup: int = 4
    stop: float = 0.9


@dataclass(frozen=True)
class PromptSpec:
    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    seed_random: bool = False           # True when the file had no seed and one was drawn (recorded for the report)
    steps: int = DEFAULT_STEPS
    cfg: float = DEFAULT_CFG
    width: int | None = None            # None: the pack's resolution (filled by `with_resolution`)
    height: int | None = None
    sampler: str = "euler"
    scheduler: str = "sgm_uniform"
    spectrum: SpectrumSettings = field(default_factory=SpectrumSettings)
    output: str | None = None           # absolute path of a .png file or of a directory; None: the job folder
    overwrite: bool = False             # an existing `output` file is replaced (else kept, and the job says so)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PromptSpec":
        """Rebuild a spec stored by `to_dict` (job.json); re-validates every field."""
        d = dict(d)
        seed_random = bool(d.pop("seed_random", False))
        spec = parse_prompt_obj(d, check_output=False)
        return _replace(spec, seed_random=seed_random)

    def with_sizes(self, sizes) -> "PromptSpec":
        """Fill an omitted width/height from the first size that fits (the default pack first); a size that has no
        model pack is refused, naming the sizes that have one. `sizes`: (width, height) pairs."""
        sizes = [tuple(s) for s in sizes]
        fits = [(w, h) for w, h in sizes if self.width in (None, w) and self.height in (None, h)]
        if not fits:
            name = "width" if self.width is not None else "height"
            want = f"{self.width if self.width is not None else '*'}x{self.height if self.height is not None else '*'}"
            have = ", ".join(f"{w}x{h}" for w, h in sizes) or "none"
            raise PromptError(name, f"{want} has no model pack; the sizes with a pack: {have}")
        return _replace(self, width=fits[0][0], height=fits[0][1])

    def with_resolution(self, width: int, height: int) -> "PromptSpec":
        """`with_sizes` for one pack."""
        return self.with_sizes([(width, height)])


def as_sizes(resolution) -> list[tuple[int, int]]:
    """One (width, height) or a sequence of them -> a list of pairs."""
    if len(resolution) == 2 and all(isinstance(v, int) for v in resolution):
        return [tuple(resolution)]
    return [tuple(r) for r in resolution]


def _replace(spec, **kw):
    d = {f: getattr(spec, f) for f in spec.__dataclass_fields__}
    d.update(kw)
    return type(spec)(**d)


# ---------------------------------------------------------------- field checkers


class _LongInt:
    """A JSON integer with more than MAX_INT_DIGITS digits, kept unconverted: int() of a few thousand digits raises
    ValueError (Python's int-from-string limit) before any field could be named; the field check names it instead."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(text: str):
    return int(text) if len(text) <= MAX_INT_DIGITS else _LongInt(text)


def _type_name(v) -> str:
    if isinstance(v, _LongInt):
        return "integer"
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _int(name: str, v, low: int, high: int) -> int:
    if isinstance(v, _LongInt):
        raise PromptError(name, f"must be in {low}..{high}, got an integer of {v.digits} digits")
    if isinstance(v, bool) or not isinstance(v, int):
        raise PromptError(name, f"must be an integer in {low}..{high}, got {_type_name(v)} {v!r}")
    if not low <= v <= high:
        raise PromptError(name, f"must be in {low}..{high}, got {v}")
    return v


def _float(name: str, v, low: float, high: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PromptError(name, f"must be a number in [{low}, {high}], got {_type_name(v)} {v!r}")
    v = float(v)
    if not math.isfinite(v) or not low <= v <= high:
        raise PromptError(name, f"must be in [{low}, {high}], got {v}")
    return v


def _unicode(name: str, v: str) -> None:
    """JSON escapes can spell lone surrogates (\\ud800) that are not Unicode text: the encoder and every message
    codec would fail on them later, in the middle of a job."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(name, f"holds a lone surrogate (U+{ord(v[e.start]):04X} at character {e.start}), "
                                "which is not valid Unicode text") from None


def _text(name: str, v, *, required: bool) -> str:
    if not isinstance(v, str):
        raise PromptError(name, f"must be a string, got {_type_name(v)}")
    _unicode(name, v)
    if required and not v.strip():
        raise PromptError(name, "must not be empty")
    if len(v) > MAX_PROMPT_CHARS:
        raise PromptError(name, f"is {len(v)} characters long; the limit is {MAX_PROMPT_CHARS}")
    if "\x00" in v:
        raise PromptError(name, "must not contain NUL characters")
    try:
        check_prompt(v)
    except PromptWeightError as e:
        raise PromptError(name, str(e)) from None
    return v


def _choice(name: str, v, allowed: tuple) -> str:
    if not isinstance(v, str) or v not in allowed:
        raise PromptError(name, f"must be one of {', '.join(repr(a) for a in allowed)}, got {v!r}")
    return v


def _side(name: str, v) -> int:
    v = _int(name, v, 16, MAX_SIDE)
    if v % 16:
        raise PromptError(name, f"must be a multiple of 16 (8x VAE downsampling x 2x2 patches), got {v}")
    return v


def _spectrum(v) -> SpectrumSettings:
    if isinstance(v, bool):
        return SpectrumSettings(enabled=v)
    if not isinstance(v, dict):
        raise PromptError("spectrum", f"must be true, false or an object of settings, got {_type_name(v)}")
    kw = {}
    for key, val in v.items():
        name = f"spectrum.{key}"
        if key == "enabled":
            if not isinstance(val, bool):
                raise PromptError(name, f"must be true or false, got {_type_name(val)}")
            kw[key] = val
            continue
        if key not in SPECTRUM_FIELDS:
            raise PromptError(name, f"unknown setting; allowed: enabled, {', '.join(SPECTRUM_FIELDS)}")
        typ, low, high, _ = SPECTRUM_FIELDS[key]
        kw[key] = _int(name, val, low, high) if typ is int else _float(name, val, low, high)
    if "stop" in kw and kw["stop"] <= 0.0:
        raise PromptError("spectrum.stop", "must be greater than 0")
    return SpectrumSettings(**kw)


def _output(v, *, base_dir: Path | None, check: bool, overwrite: bool = False) -> str:
    if not isinstance(v, str) or not v.strip():
        raise PromptError("output", f"must be a non-empty path string, got {_type_name(v)} {v!r}")
    if "\x00" in v:
        raise PromptError("output", "must not contain NUL characters")
    _unicode("output", v)
    p = Path(os.path.expanduser(v))
    if not p.is_absolute():
        p = (base_dir or Path.cwd()) / p
    p = Path(os.path.normpath(p))
    if not check:
        return str(p)
    try:
        return _check_output(p, overwrite)
    except OSError as e:       # a name over 255 bytes, a path too long, a loop of links, no permission ...
        raise PromptError("output", f"{p}: {e.strerror or e}") from None


def output_file(output: str, job_id: str) -> Path:
    """The PNG file a job delivers to: `output` itself when it names a .png file, else JOB.png inside that folder."""
    return Path(output) if output.lower().endswith(".png") else Path(output) / f"{job_id}.png"


def _check_output(p: Path, overwrite: bool) -> str:
    # a .png path names the image file; anything else names a directory (created when its parent exists)
    if p.suffix.lower() == ".png":
        if p.is_dir():
            raise PromptError("output", f"{p} is a directory, not a .png file")
        if not overwrite and os.path.lexists(p):
            raise PromptError("output", f"{p} exists; choose another name, or set \"overwrite\": true to replace it")
        d = p.parent
    else:
        if p.exists() and not p.is_dir():
            raise PromptError("output", f"{p} exists and is not a directory (name a directory or a .png file)")
        d = p if p.exists() else p.parent
    if not d.is_dir():
        raise PromptError("output", f"directory {d} does not exist")
    if not os.access(d, os.W_OK | os.X_OK):
        raise PromptError("output", f"directory {d} is not writable")
    return str(p)


# ---------------------------------------------------------------- entry points


def parse_prompt_obj(obj, *, base_dir: Path | None = None, check_output: bool = True,
                     resolution=None) -> PromptSpec:
    """Validate a decoded prompt object. A missing seed is drawn at random and marked `seed_random`. `resolution`:
    the (width, height) of the pack, or a list of them (several packs, the default first); None: not checked."""
    if not isinstance(obj, dict):
        raise PromptError("", f"the top level must be a JSON object, got {_type_name(obj)}")
    for key in obj:
        if key not in TOP_FIELDS:
            raise PromptError(str(key).encode("utf-8", "backslashreplace").decode("ascii", "replace")[:80],
                              f"unknown field; allowed: {', '.join(TOP_FIELDS)}")
    if "prompt" not in obj:
        raise PromptError("prompt", "is required")
    kw: dict = {"prompt": _text("prompt", obj["prompt"], required=True)}
    if "negative_prompt" in obj:
        kw["negative_prompt"] = _text("negative_prompt", obj["negative_prompt"], required=False)
    if obj.get("seed") is None:     # omitted or null -> random, recorded
        kw["seed"], kw["seed_random"] = secrets.randbelow(SEED_LIMIT), True
    else:
        kw["seed"] = _int("seed", obj["seed"], 0, SEED_LIMIT - 1)
    if "steps" in obj:
        kw["steps"] = _int("steps", obj["steps"], 1, MAX_STEPS)
    if "cfg" in obj:
        kw["cfg"] = _float("cfg", obj["cfg"], 1.0, MAX_CFG)
    for side in ("width", "height"):
        if obj.get(side) is not None:       # omitted or null -> the pack's resolution
            kw[side] = _side(side, obj[side])
    if "sampler" in obj:
        kw["sampler"] = _choice("sampler", obj["sampler"], SAMPLERS)
    if "scheduler" in obj:
        kw["scheduler"] = _choice("scheduler", obj["scheduler"], SCHEDULERS)
    if "spectrum" in obj:
        kw["spectrum"] = _spectrum(obj["spectrum"])
    if "overwrite" in obj:
        if not isinstance(obj["overwrite"], bool):
            raise PromptError("overwrite", f"must be true or false, got {_type_name(obj['overwrite'])}")
        kw["overwrite"] = obj["overwrite"]
    if "output" in obj and obj["output"] is not None:
        kw["output"] = _output(obj["output"], base_dir=base_dir, check=check_output,
                               overwrite=kw.get("overwrite", False))
    spec = PromptSpec(**kw)
    if resolution is not None:
        spec = spec.with_sizes(as_sizes(resolution))
    return spec


def _reject_constant(name: str):
    raise PromptError("", f"{name} is not valid JSON (numbers must be finite)")


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise PromptError(k, "appears twice")
        d[k] = v
    return d


def parse_prompt_bytes(data: bytes | str, **kw) -> PromptSpec:
    """Decode and validate prompt.json content (UTF-8, at most MAX_FILE_BYTES)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_FILE_BYTES:
        raise PromptError("", f"the file is {len(raw)} bytes; the limit is {MAX_FILE_BYTES}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptError("", f"not UTF-8 text (byte {e.start})") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates,
                         parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise PromptError("", f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise PromptError("", "invalid JSON: nested too deeply") from None
    return parse_prompt_obj(obj, **kw)


def read_prompt_file(path: str | os.PathLike) -> bytes:
    """A prompt file's bytes, read once (what is validated is what is sent), at most MAX_FILE_BYTES."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise PromptError("", f"cannot read {p}: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise PromptError("", f"{p} is more than {MAX_FILE_BYTES} bytes; the limit is {MAX_FILE_BYTES}")
    return data


def read_prompt_stream(stream, name: str = "standard input") -> bytes:
    """prompt.json from an open binary stream (`submit -` reads standard input), at most MAX_FILE_BYTES."""
    try:
        data = stream.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise PromptError("", f"cannot read {name}: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise PromptError("", f"{name} holds more than {MAX_FILE_BYTES} bytes; the limit is {MAX_FILE_BYTES}")
    if not data.strip():
        raise PromptError("", f"{name} is empty: expected a prompt.json object")
    return data


def load_prompt(path: str | os.PathLike, **kw) -> PromptSpec:
    """Read and validate a prompt file; relative `output` paths resolve from the current directory."""
    return parse_prompt_bytes(read_prompt_file(path), **kw)
