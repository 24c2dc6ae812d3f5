"""prompt.json: strict reading into a `PromptFile` (protocol/prompt.py, the one prompt record) and its resolution
into a `PromptSpec` (the seed drawn, Spectrum's settings, `output` an absolute checked path); every error names the
field and the allowed values."""
import json
import os
import secrets
from pathlib import Path

from models.sampling.sampler import spectrum_refusal
from models.sampling.spectrum import SpectrumSettings
from protocol.prompt import (DEFAULT_CFG, DEFAULT_STEPS, MAX_BATCH, MAX_CFG, MAX_FILE_BYTES,  # noqa: F401
                             MAX_INT_DIGITS, MAX_PROMPT_CHARS, MAX_SIDE, MAX_STEPS, PROMPT, SEED_LIMIT, PromptError, PromptFile,
                             PromptSpec, _LongInt, _unicode, check_sampled, fit_size)


def _parse_int(text: str):
    return int(text) if len(text) <= MAX_INT_DIGITS else _LongInt(text)


def as_sizes(resolution) -> list[tuple[int, int]]:
    """One (width, height) or a sequence of them -> a list of pairs."""
    if len(resolution) == 2 and all(isinstance(v, int) for v in resolution):
        return [tuple(resolution)]
    return [tuple(r) for r in resolution]


def _output(v: str, *, base_dir: Path | None, check: bool, overwrite: bool = False) -> str:
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


def prompt_record(obj) -> PromptFile:
    """A decoded prompt object as the prompt record (what SUBMIT carries), every field checked."""
    if not isinstance(obj, dict):
        raise PromptError("", f"the top level must be a JSON object, got {PROMPT.json_type(obj)}")
    return PromptFile.from_data(obj)


def resolve_prompt(f: PromptFile, *, base_dir: Path | None = None, check_output: bool = True,
                   resolution=None, sampling: dict | None = None) -> PromptSpec:
    """The record as the job runs it: a missing seed drawn at random and marked `seed_random`, steps, cfg, sampler and
    scheduler it leaves unset taken from its pack's record (`sampling`: {(width, height): the pack's settings or None})
    else prompt.json's defaults, Spectrum's default settled, `output` absolute (and checked, with `check_output`).
    `resolution`: the (width, height) of the pack, or a list of them (several packs, the default first); None: not
    checked."""
    kw = {name: getattr(f, name) for name in f.__struct_fields__}
    kw.update(f.sampling_filled(pack_sampling_for(f, resolution, sampling)))
    kw["prompt"], kw["negative_prompt"] = f.cond("positive").text, f.cond("negative").text   # each side's text
    if f.seed is None:                  # omitted or null -> random, recorded
        kw["seed"], kw["seed_random"] = secrets.randbelow(SEED_LIMIT), True
    if f.spectrum is None:              # the default: Spectrum where the sampler allows it (docs/samplers.md)
        kw["spectrum"] = SpectrumSettings(enabled=spectrum_refusal(kw["sampler"]) is None and f.cache is None)
    elif isinstance(f.spectrum, bool):
        kw["spectrum"] = SpectrumSettings(enabled=f.spectrum)
    if f.output is not None:
        kw["output"] = _output(f.output, base_dir=base_dir, check=check_output, overwrite=f.overwrite)
    unfit = None
    if resolution is not None:
        try:
            kw["width"], kw["height"] = fit_size(f, as_sizes(resolution))
        except PromptError as e:        # said after the rules below (the order a spec's errors have always come in)
            unfit = e
    # the record's rules held when it was checked (at its way in); of them only those that read the settings filled
    # here can change their answer, and they run once more
    spec = PromptSpec.settled(kw)
    if not f.sampling_set():
        check_sampled(spec)
    if unfit is not None:
        raise unfit
    return spec


def pack_sampling_for(f: PromptFile, resolution, sampling: dict | None) -> dict | None:
    """The sampling settings the pack a job runs on records (the first size that fits it, as `with_sizes` picks);
    None without a record, or when the size is not known here."""
    if not sampling or resolution is None:
        return None
    fits = [s for s in as_sizes(resolution) if f.width in (None, s[0]) and f.height in (None, s[1])]
    return sampling.get(fits[0]) if fits else None


def parse_prompt_obj(obj, **kw) -> PromptSpec:
    """Validate a decoded prompt object and resolve it (`resolve_prompt`'s keywords)."""
    return resolve_prompt(prompt_record(obj), **kw)


def _reject_constant(name: str):
    raise PromptError("", f"{name} is not valid JSON (numbers must be finite)")


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise PromptError(k, "appears twice")
        d[k] = v
    return d


def parse_prompt_text(data: bytes | str) -> PromptFile:
    """prompt.json content (UTF-8, at most MAX_FILE_BYTES) as the prompt record."""
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
    return prompt_record(obj)


def parse_prompt_bytes(data: bytes | str, **kw) -> PromptSpec:
    """Decode, validate and resolve prompt.json content (`resolve_prompt`'s keywords)."""
    return resolve_prompt(parse_prompt_text(data), **kw)


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
