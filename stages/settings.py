"""The per-stage settings: every `[stage.NAME]` key of the pipeline config typed, bounded and documented in one
table (STAGE_SETTINGS), rules between keys of one table (STAGE_RULES), and the settings a model backend declares
itself (its SETTINGS class attribute). stages.config reads the file and calls check_stage_table for each table."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


class ConfigError(ValueError):
    """A bad config file or value; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One `[stage.NAME]` key. `default` None: not set unless given (the code then uses another value, e.g. the
    top-level `threads`). Numbers are checked against [low, high]; lists against `length` and `items`; `check` may
    add a rule of its own (returns what is wrong, or "")."""

    kind: type                                   # bool | int | float (an int is accepted) | str | list
    default: Any = None
    low: float | None = None
    high: float | None = None
    choices: tuple | None = None
    items: tuple[type, ...] = (str,)             # list elements
    length: tuple[int, int] = (0, 4096)          # list items, or characters of a str
    check: Callable[[Any], str] | None = None
    help: str = ""


def _core_mask(value) -> str:
    from models.backends.core_mask import CORE_MASKS, core_mask_word   # the one table of core masks
    if isinstance(value, int):
        return "" if value >= 0 else "a core mask integer must be >= 0"
    try:
        core_mask_word(value)
    except ValueError:
        return f"choose one of {', '.join(CORE_MASKS)} or an integer"
    return ""


def _encoder_backend(value) -> str:
    from models.text.conditioning import BACKENDS            # the text encoder's compute backends live there
    return "" if value in BACKENDS else f"{value!r:.80} is not one of {', '.join(BACKENDS)}"


def _vae_backend(value) -> str:
    from models.backends import vae_pack_backends            # torch (the VAE file) or a backend running VAE packs
    names = ("torch", *vae_pack_backends())
    return "" if value in names else f"{value!r:.80} is not one of {', '.join(names)}"


def _vae_packs(value) -> str:
    items = [value] if isinstance(value, str) else value
    if not 1 <= len(items) <= 64 or not all(isinstance(v, str) and 1 <= len(v) <= 4096 and "\x00" not in v
                                            for v in items):
        return "expected a VAE pack folder, or a list of 1..64 of them (one per image size)"
    return ""


def _policy_problem(table: dict) -> str:
    from models.policy import policy_problem                 # the policy grammar lives there (backend checked later)
    return policy_problem(table["policy"], table)


def _path_setting(help_: str) -> Setting:
    return Setting(str, length=(1, 4096), help=help_)


_THREADS = Setting(int, None, 1, 256, help="threads of this stage (default: the top-level threads)")
# the model backends' constructor arguments (models.backends.backend_kwargs passes those a backend names); a backend
# may declare more in its SETTINGS class attribute (see check_stage_table)
_BACKEND_SETTINGS = {
    "core_mask": Setting((str, int), check=_core_mask, help="rknn: NPU core(s)"),
    "lite": Setting(str, choices=("real", "standin"), help="rknn: RKNNLite provider"),
    "venv": _path_setting("rknn-sim: the rknn-toolkit2 environment (default .venv-rknn)"),
    "target": Setting(str, length=(1, 64), help="rknn-sim: the simulated target platform (rk3588)"),
    "log_dir": _path_setting("rknn-sim: where the toolkit's logs go"),
}

# [stage.NAME] key -> Setting: the one table of every per-stage setting (docs/architecture.md, "Settings").
STAGE_SETTINGS: dict[str, dict[str, Setting]] = {
    "encoder": {
        "threads": _THREADS,
        "backend": Setting(str, "torch", check=_encoder_backend, help="torch (model files) or onnx (an encoder pack)"),
        "pack": _path_setting("backend onnx: the encoder pack folder (anima-models export-encoder; relative to the "
                              "config file)"),
        "dit": _path_setting("the DiT file holding the LLM adapter (default: from models_dir)"),
        "text_encoder": _path_setting("Qwen3 text encoder file"),
        "qwen_tokenizer": _path_setting("Qwen tokenizer folder"),
        "t5_tokenizer": _path_setting("T5 tokenizer file or folder"),
    },
    "scheduler": {
        "branch_timeout_s": Setting(float, 600.0, 1.0, 86400.0, help="a live executor is waited for this long "
                                    "per branch call"),
    },
    "executor": {
        "policy": Setting((str, dict), "auto", help="lifecycle policy: auto, or terms joined by + (models/policy.py), "
                          "or a table; checked with resident_mb and dual_masks (STAGE_RULES)"),
        "resident_mb": Setting(float, None, 0.0, float(2**40), help="MiB budget of resident contexts"),
        "dual_masks": Setting(list, items=(str, int), length=(2, 2), check=lambda v: "".join(map(_core_mask, v)),
                              help="the two core masks of the dual_core contexts"),
        "threads": _THREADS,
        "trace": _path_setting("append one JSON line per branch call (relative to the config file)"),
        **_BACKEND_SETTINGS,
        "dual_core": Setting(bool, check=lambda v: 'dual_core is a lifecycle policy now: policy = "dual_core" (or '
                             '"prefetch+dual_core"); dual_masks stays a setting'),
    },
    "vae": {
        "backend": Setting(str, "torch", check=_vae_backend, help="torch (the VAE file) or a model backend running "
                           "VAE packs (onnx, rknn-sim, rknn)"),
        "vae": _path_setting("torch: the VAE file (default: from models_dir)"),
        "vae_pack": Setting((str, list), items=(str,), check=_vae_packs, help="the other backends: a VAE pack folder "
                            "(anima-models pack-vae), or a list, one per image size; relative to the config file"),
        "threads": _THREADS,
        **_BACKEND_SETTINGS,
        "max_latent": Setting(int, 512, 1, 4096, help="DECODE: largest latent h and w (prompts allow 4096 px)"),
        "tile_min": Setting(int, 16, 1, 4096, help="DECODE: smallest tile side in latent pixels"),
        "tile_max": Setting(int, 128, 1, 4096, help="DECODE: largest tile side, and the largest untiled latent"),
        "min_stride_fraction": Setting(float, 0.25, 0.05, 1.0, help="DECODE: the tile stride (tile minus overlap) "
                                       "is at least this fraction of the tile (work < 1/fraction² of untiled)"),
    },
    "orchestrator": {
        "max_queue": Setting(int, 16, 1, 10_000, help="queued + running jobs"),
        "min_free_mb": Setting(float, 64.0, 0.0, 1e7, help="free disk needed in the run folder to accept a job"),
        "stage_retries": Setting(int, 3, 0, 20, help="restarts of one stage absorbed per job before it fails"),
        "start_timeout_s": Setting(float, 120.0, 1.0, 3600.0, help="supervisord start + READY of a stage"),
        "stop_timeout_s": Setting(float, 30.0, 1.0, 600.0),
        "encode_timeout_s": Setting(float, 600.0, 1.0, 86400.0),
        "denoise_timeout_s": Setting(float, 6 * 3600.0, 1.0, 7 * 86400.0),
        "decode_timeout_s": Setting(float, 1800.0, 1.0, 86400.0),
        "sample_interval_s": Setting(float, 0.2, 0.01, 10.0, help="supervisord/RSS sampling while a stage works"),
        "hang_timeout_s": Setting(float, 120.0, 0.0, 86400.0, help="a scheduler/executor silent to heartbeats this "
                                  "long is restarted through supervisord (0: never); keep it below branch_timeout_s"),
        "timing_plot_timeout_s": Setting(float, 120.0, 0.0, 3600.0, help="the child process that draws each job's "
                                         "timing.png (3.3 s under load: bench/bench_timing_plot.py); 0: no plot"),
    },
    "http": {                                  # the HTTP front (orchestrator/http/settings.py)
        "host": Setting(str, "127.0.0.1", length=(1, 255), help="listen address; not loopback needs token_file"),
        "port": Setting(int, 8188, 0, 65535, help="0: any free port (written to RUN/http.json)"),
        "token_file": _path_setting("a 0600 file holding the bearer token (relative to the config file)"),
        "max_body_kb": Setting(int, 256, 1, 65536, help="larger request bodies get 413"),
        "request_timeout_s": Setting(float, 5.0, 0.1, 120.0, help="one request to the daemon; no answer: 503"),
        "poll_s": Setting(float, 0.25, 0.05, 10.0, help="how often running jobs are looked at"),
    },
}
# rules between keys of one table: stage -> [(key, rule)]; a rule takes the table with defaults filled in and says
# what is wrong ("" when fine)
STAGE_RULES: dict[str, list[tuple[str, Callable[[dict], str]]]] = {
    "vae": [("tile_min", lambda t: "" if t["tile_min"] <= t["tile_max"] else "tile_min must not exceed tile_max"),
            ("vae_pack", lambda t: "" if t["backend"] == "torch" or t.get("vae_pack") else f"backend {t['backend']!r} "
             "decodes a VAE pack; set vae_pack = DIR (anima-models pack-vae)")],
    "executor": [("policy", _policy_problem)],
    "encoder": [("pack", lambda t: "" if t["backend"] != "onnx" or t.get("pack") else 'backend "onnx" needs the '
                 'encoder pack folder (pack = "DIR", written by `anima-models export-encoder`)')],
}


def _type_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({"str": "string", "int": "integer", "bool": "boolean", "list": "array"}.get(k.__name__,
                       k.__name__) for k in kinds)


def check_setting(s: Setting, value: Any) -> tuple[Any, str]:
    """(the value, as the code uses it: a float for float settings) and what is wrong with it ("" when fine)."""
    if s.kind is object:                           # a backend's own setting of no declared type: it checks it
        return value, ""
    kinds = s.kind if isinstance(s.kind, tuple) else (s.kind,)
    accepted = kinds + ((int,) if float in kinds else ())
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, accepted):
        return value, f"expected {_type_name(s.kind)}, got {type(value).__name__} ({value!r:.80})"
    if isinstance(value, float) and value != value:
        return value, "NaN is not a value"
    if s.kind is float:
        value = float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if (s.low is not None and value < s.low) or (s.high is not None and value > s.high):
            return value, f"{value} is out of range [{s.low}, {s.high}]"
    if isinstance(value, str):
        if not s.length[0] <= len(value) <= s.length[1] or "\x00" in value:
            return value, f"expected {s.length[0]}..{s.length[1]} characters without NUL"
    if isinstance(value, list):
        if not s.length[0] <= len(value) <= s.length[1]:
            return value, f"expected {s.length[0]}..{s.length[1]} items, got {len(value)}"
        bad = [v for v in value if isinstance(v, bool) or not isinstance(v, s.items)]
        if bad:
            return value, f"items must be {_type_name(s.items)}, got {bad[0]!r:.80}"
    if s.choices is not None and value not in s.choices:
        return value, f"{value!r:.80} is not one of {', '.join(map(str, s.choices))}"
    problem = s.check(value) if s.check is not None else ""
    return value, problem


def backend_settings(stage: str, table: dict, backend: str) -> dict[str, Setting]:
    """The keys a stage's model backend declares beyond STAGE_SETTINGS (its class attribute SETTINGS: names, passed
    on unchecked to its constructor, which checks them; or name -> Setting): the executor's backend is the top-level
    `backend`, the VAE's its own `backend`. Looked up only for a key the table does not know (no import otherwise)."""
    name = table.get("backend", "torch") if stage == "vae" else backend if stage == "executor" else None
    if not isinstance(name, str):
        return {}
    from models.backends import backend_class, backend_names
    if name not in backend_names():
        return {}
    cls = backend_class(name)
    declared = getattr(cls, "SETTINGS", ())
    if isinstance(declared, dict):
        return dict(declared)
    import inspect
    params = inspect.signature(cls.__init__).parameters
    out = {}
    for key in declared:                           # typed by the constructor's default (bool, int, float or str)
        default = params[key].default if key in params else None
        kind = type(default) if type(default) in (bool, int, float, str) else object
        out[key] = Setting(kind, help=f"backend {name}: {key} (its constructor checks the value)")
    return out


def check_stage_table(stage: str, table: Any, where: str, backend: str = "onnx") -> dict[str, Any]:
    """A `[stage.NAME]` table checked against STAGE_SETTINGS (plus the settings its backend declares, see
    backend_settings): the given values (floats as floats), defaults not filled in; ConfigError naming
    `where`stage.NAME.KEY."""
    w = f"{where}stage.{stage}"
    if stage not in STAGE_SETTINGS or not isinstance(table, dict):
        raise ConfigError(f"{w}: expected a table for one of {', '.join(STAGE_SETTINGS)}")
    schema, out = STAGE_SETTINGS[stage], {}
    if set(table) - set(schema):
        schema = schema | backend_settings(stage, table, backend)
    for key, value in table.items():
        if key not in schema:
            raise ConfigError(f"{w}.{key}: unknown setting; known: {', '.join(schema)}")
        out[key], problem = check_setting(schema[key], value)
        if problem:
            raise ConfigError(f"{w}.{key}: {problem}")
    full = {k: s.default for k, s in schema.items() if s.default is not None} | out
    for key, rule in STAGE_RULES.get(stage, ()):
        problem = rule(full)
        if problem:
            raise ConfigError(f"{w}.{key}: {problem}")
    return out
