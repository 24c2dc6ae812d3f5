"""The pipeline config's schema: every key of the file typed, bounded and documented in one set of records
(models/base/schema.py), PipelineFile at the top and a record per `[stage.NAME]` table (STAGE_TABLES); rules between keys
of one table are the record's `__post_init__`; a model backend may declare keys of its own (its SETTINGS class
attribute). stages.config reads the file into these records; OrchestratorSettings and HttpSettings are the
orchestrator's and the HTTP front's settings as they are."""
import inspect
import os
import types
from typing import Annotated, Any, ClassVar, Literal

from models.base.schema import Float, Int, Meta, Record, SchemaError, Text, Wording, convert
from protocol.messages import HEARTBEAT_INTERVAL_S, LIVENESS
from protocol.sockets import REQUEST_RETRIES, REQUEST_TIMEOUT_S

STAGES = ("encoder", "scheduler", "executor", "vae")
ENDPOINT_NAMES = STAGES + ("events",)
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A bad config file or value; the message names the file and the key."""


class ConfigWording(Wording):
    """The config file's words: TECHNICAL's, without null (TOML has none), and with a list item of the wrong type
    named at its list (`items must be string, got 3`) unless the item's Meta describes what it must be."""

    def say(self, path, p):
        if p.kind == "type":                    # TOML has no null: None is "not set"
            p = p._replace(expected=tuple(e for e in p.expected if e != "null") or p.expected)
        if p.kind == "type" and path.endswith("]") and "description" not in p.meta:
            names = " or ".join(dict.fromkeys(self.TYPE_NAMES[e] for e in p.expected))
            return path[:path.rindex("[")], f"items must be {names}, got {p.value!r:.80}", "bad_field"
        return super().say(path, p)

    def type(self, p):
        if "description" in p.meta:
            return f"expected {p.meta['description']}, got {type(p.value).__name__}"
        return super().type(p)


CONFIG = ConfigWording()


def _described(tp, what: str):
    return Annotated[tp, Meta(description=what)]


PathText = Text(4096, 1)                         # a file or folder; relative paths resolve from the config file
KeyFile = _described(PathText, "a key file path")
Threads = Int(1, 256)
CoreMask = Text(64, 1) | Int(0, 2**63 - 1)       # rknn: a word (auto, 0, 1, 2, 0_1, 0_1_2) or RKNNLite's integer


class Table(Record, frozen=True):
    """Base of a `[stage.NAME]` table's record: None is "not set" (the code then uses another value)."""

    KEY_NOUN: ClassVar[str] = "setting"
    WORDING: ClassVar = CONFIG

    def given(self) -> dict[str, Any]:
        """The keys with a value (set in the file, or a default), as plain data."""
        return {k: v for k, v in self.to_dict().items() if v is not None}


def _core_mask(value) -> str:
    from models.runtime.backends.core_mask import CORE_MASKS, core_mask_word   # the one table of core masks
    if isinstance(value, int):
        return ""
    try:
        core_mask_word(value)
    except ValueError:
        return f"choose one of {', '.join(CORE_MASKS)} or an integer"
    return ""


def _rule(field: str, problem: str) -> None:
    if problem:
        raise SchemaError(field, problem)


class BackendSettings(Table, frozen=True):
    """The model backends' constructor arguments (models.runtime.backends.backend_kwargs passes those a backend names)."""

    core_mask: CoreMask | None = None          # rknn: NPU core(s)
    lite: Literal["real", "standin"] | None = None   # rknn: RKNNLite provider
    venv: PathText | None = None               # rknn-sim: the rknn-toolkit2 environment (default .venv-rknn)
    target: Text(64, 1) | None = None          # rknn-sim: the simulated target platform (rk3588)
    log_dir: PathText | None = None            # rknn-sim: where the toolkit's logs go

    def __post_init__(self):
        if self.core_mask is not None:
            _rule("core_mask", _core_mask(self.core_mask))


class EncoderSettings(Table, frozen=True):
    """[stage.encoder]"""

    threads: Threads | None = None             # threads of this stage (default: the top-level threads)
    backend: Text(64, 1) = "torch"             # torch (model files) or onnx (an encoder pack)
    pack: PathText | None = None               # backend onnx: the encoder pack folder (anima-models export-encoder)
    dit: PathText | None = None                # the DiT file holding the LLM adapter (default: from models_dir)
    text_encoder: PathText | None = None       # Qwen3 text encoder file
    qwen_tokenizer: PathText | None = None     # Qwen tokenizer folder
    t5_tokenizer: PathText | None = None       # T5 tokenizer file or folder

    def __post_init__(self):
        if self.backend != "torch":                          # the default: no import needed to know it
            from models.text.conditioning import BACKENDS    # the text encoder's compute backends live there
            _rule("backend", "" if self.backend in BACKENDS else
                  f"{self.backend!r:.80} is not one of {', '.join(BACKENDS)}")
        _rule("pack", "" if self.backend != "onnx" or self.pack else 'backend "onnx" needs the encoder pack folder '
              '(pack = "DIR", written by `anima-models export-encoder`)')


class SchedulerSettings(Table, frozen=True):
    """[stage.scheduler]"""

    branch_timeout_s: Float(1.0, 86400.0) = 600.0   # a live executor is waited for this long per branch call


class ExecutorSettings(BackendSettings, frozen=True):
    """[stage.executor]; the backend (the top-level `backend`) may declare more keys (backend_settings)."""

    # lifecycle policy: auto, or terms joined by + (models/board/policy.py), or a table; checked with resident_mb and
    # dual_masks
    policy: Text(4096) | dict[str, Any] = "auto"
    resident_mb: Float(0.0, float(2**40)) | None = None     # MiB budget of resident contexts
    dual_masks: Annotated[list[CoreMask], Meta(min_length=2, max_length=2)] | None = None  # dual_core's two masks
    threads: Threads | None = None
    trace: PathText | None = None              # append one JSON line per branch call (relative to the config file)
    # a board's own cost figures (bench/board.py --calibrate OUT.toml; relative to the config file): board-sim's
    # pace and auto's choice on board-sim and rknn
    board_cost: PathText | None = None
    dual_core: bool | None = None              # refused, naming where it goes: dual_core is a term of `policy`
    backend: Text(64) | None = None            # refused, naming where it goes: the file's top-level `backend`

    def __post_init__(self):
        BackendSettings.__post_init__(self)
        _rule("backend", "" if self.backend is None else f"the executor's backend is a top-level key: put backend = "
              f"\"{self.backend:.40}\" above every [stage.…] table (the VAE's own is [stage.vae] backend)")
        for mask in self.dual_masks or ():
            _rule("dual_masks", _core_mask(mask))
        _rule("dual_core", "" if self.dual_core is None else 'dual_core is a lifecycle policy now: policy = '
              '"dual_core" (or "prefetch+dual_core"); dual_masks stays a setting')
        from models.board.policy import policy_problem             # the policy grammar lives there (backend checked later)
        _rule("policy", policy_problem(self.policy, self.given()))


class VaeSettings(BackendSettings, frozen=True):
    """[stage.vae]; a backend that runs VAE packs may declare more keys (backend_settings)."""

    backend: Text(64, 1) = "torch"             # torch (the VAE file) or a model backend running VAE packs
    vae: PathText | None = None                # torch: the VAE file (default: from models_dir)
    # the other backends: a VAE pack folder (anima-models pack-vae), or a list, one per image size
    vae_pack: PathText | list[PathText] | None = None
    # the other backends, VAE_ENCODE: a VAE encoder pack folder, or a list, one per image size (none: no encoding)
    vae_encoder_pack: PathText | list[PathText] | None = None
    threads: Threads | None = None
    max_latent: Int(1, 4096) = 512             # DECODE: largest latent h and w (prompts allow 4096 px)
    tile_min: Int(1, 4096) = 16                # DECODE: smallest tile side in latent pixels
    tile_max: Int(1, 4096) = 128               # DECODE: largest tile side, and the largest untiled latent
    # DECODE: the tile stride (tile minus overlap) is at least this fraction of the tile (work < 1/fraction² of
    # untiled)
    min_stride_fraction: Float(0.05, 1.0) = 0.25

    def __post_init__(self):
        BackendSettings.__post_init__(self)
        if self.backend != "torch":                          # the default: no import needed to know it
            from models.runtime.backends import vae_pack_backends    # torch (the VAE file) or a backend running VAE packs
            names = ("torch", *vae_pack_backends())
            _rule("backend", "" if self.backend in names else f"{self.backend!r:.80} is not one of {', '.join(names)}")
        packs = [self.vae_pack] if isinstance(self.vae_pack, str) else self.vae_pack
        _rule("vae_pack", "" if packs is None or 1 <= len(packs) <= 64 else
              "expected a VAE pack folder, or a list of 1..64 of them (one per image size)")
        enc = [self.vae_encoder_pack] if isinstance(self.vae_encoder_pack, str) else self.vae_encoder_pack
        _rule("vae_encoder_pack", "" if enc is None or 1 <= len(enc) <= 64 else
              "expected a VAE encoder pack folder, or a list of 1..64 of them (one per image size)")
        _rule("tile_min", "" if self.tile_min <= self.tile_max else "tile_min must not exceed tile_max")
        _rule("vae_pack", "" if self.backend == "torch" or self.vae_pack else f"backend {self.backend!r} decodes a "
              "VAE pack; set vae_pack = DIR (anima-models pack-vae)")


class OrchestratorSettings(Table, frozen=True):
    """[stage.orchestrator]: the orchestrator daemon's settings."""

    max_queue: Int(1, 10_000) = 16             # queued + running jobs
    min_free_mb: Float(0.0, 1e7) = 64.0        # free disk needed in the run folder to accept a job
    stage_retries: Int(0, 20) = 3              # restarts of one stage absorbed per job before it fails
    start_timeout_s: Float(1.0, 3600.0) = 120.0    # supervisord start + READY of a stage
    stop_timeout_s: Float(1.0, 600.0) = 30.0
    encode_timeout_s: Float(1.0, 86400.0) = 600.0
    denoise_timeout_s: Float(1.0, 7 * 86400.0) = 6 * 3600.0
    decode_timeout_s: Float(1.0, 86400.0) = 1800.0
    sample_interval_s: Float(0.01, 10.0) = 0.2     # supervisord/RSS sampling while a stage works
    # a scheduler/executor silent to heartbeats this long is restarted through supervisord (0: never); keep it
    # below branch_timeout_s
    hang_timeout_s: Float(0.0, 86400.0) = 120.0
    # the child process that draws each job's timing.png (3.3 s under load: bench/bench_timing_plot.py); 0: no plot
    timing_plot_timeout_s: Float(0.0, 3600.0) = 120.0
    # prompts' contexts kept in RUN/cache/cond (orchestrator/engine/cond_cache.py), least recently used dropped first; 0: off
    cond_cache_mb: Float(0.0, 1e6) = 256.0
    # the encoder and VAE left up between uses (orchestrator/engine/keep_up.py): auto (the board model's per-RAM policy:
    # never beside the DiT while it denoises on 8 GB), never, idle (up while nothing denoises), always
    keep_up: Literal["auto", "never", "idle", "always"] = "auto"


class HttpSettings(Table, frozen=True):
    """[stage.http]: the HTTP front's settings (orchestrator/http/settings.py adds the checks that keep it safe)."""

    host: Text(255, 1) = "127.0.0.1"           # listen address; not loopback needs token_file
    port: Int(0, 65535) = 8188                 # 0: any free port (written to RUN/http.json)
    token_file: PathText | None = None         # a 0600 file holding the bearer token (relative to the config file)
    max_body_kb: Int(1, 65536) = 256           # larger request bodies get 413
    max_upload_mb: Int(1, 1024) = 32           # an image upload or an img2img request may be this large
    max_uploads_mb: Int(0, 2**20) = 2048       # RUN/input, temp and output together; past it 507 (0: no limit)
    request_timeout_s: Float(0.1, 120.0) = 5.0     # one request to the daemon; no answer: 503
    poll_s: Float(0.05, 10.0) = 0.25           # how often running jobs are looked at
    # a connection's request headers must arrive, and an idle keep-alive connection is closed, this long after it
    # opened or after its last response (aiohttp's keep-alive timer; its own default, an hour, let slow-header and
    # silent connections hold the front's sockets)
    idle_timeout_s: Float(1.0, 600.0) = 15.0
    body_timeout_s: Float(1.0, 600.0) = 30.0   # a request body must arrive within this; else 408


# [stage.NAME] -> its record: the one table of every per-stage setting (docs/architecture.md, "Settings")
STAGE_TABLES: dict[str, type[Table]] = {"encoder": EncoderSettings, "scheduler": SchedulerSettings,
                                        "executor": ExecutorSettings, "vae": VaeSettings,
                                        "orchestrator": OrchestratorSettings, "http": HttpSettings}


def backend_settings(stage: str, table: dict, backend: str) -> dict[str, Any]:
    """The keys a stage's model backend declares beyond its record (its class attribute SETTINGS: names, passed on
    to its constructor, which checks them, typed by the constructor's default (bool, int, float or str; else any
    value); or name -> type): the executor's backend is the top-level `backend`, the VAE's its own `backend`.
    Looked up only for a key the record does not know (no import otherwise)."""
    name = table.get("backend", "torch") if stage == "vae" else backend if stage == "executor" else None
    if not isinstance(name, str):
        return {}
    from models.runtime.backends import backend_class, backend_names
    if name not in backend_names():
        return {}
    cls = backend_class(name)
    declared = getattr(cls, "SETTINGS", ())
    if isinstance(declared, dict):
        return dict(declared)
    params = inspect.signature(cls.__init__).parameters
    out = {}
    for key in declared:
        default = params[key].default if key in params else None
        kind = type(default) if type(default) in (bool, int, float, str) else Any
        out[key] = _FINITE if kind is float else kind
    return out


_FINITE = Float(-1.7976931348623157e308, 1.7976931348623157e308)    # any finite number


_WITH_BACKEND: dict[tuple, type[Table]] = {}


def _table_class(stage: str, table: dict, backend: str) -> type[Table]:
    """The record of `[stage.NAME]`: STAGE_TABLES' own, or (a key it does not know) one that adds the keys the
    stage's backend declares."""
    base = STAGE_TABLES[stage]
    if not set(table) - set(base.__struct_fields__):
        return base
    extra = backend_settings(stage, table, backend)
    if not extra:
        return base
    key = (base, tuple(sorted(extra.items(), key=lambda kv: kv[0])))
    cls = _WITH_BACKEND.get(key)
    if cls is None:
        annotations = {k: tp | None for k, tp in extra.items()}
        cls = _WITH_BACKEND[key] = types.new_class(
            f"{base.__name__}With", (base,), {"frozen": True},
            lambda ns: ns.update({"__annotations__": annotations, **{k: None for k in annotations}}))
    return cls


def check_stage_table(stage: str, table: Any, where: str, backend: str = "onnx") -> Table:
    """A `[stage.NAME]` table as its record (plus the settings its backend declares, see backend_settings);
    ConfigError naming `where`stage.NAME.KEY."""
    w = f"{where}stage.{stage}"
    if stage not in STAGE_TABLES:
        raise ConfigError(f"{w}: expected a table for one of {', '.join(STAGE_TABLES)}")
    cls = _table_class(stage, table if isinstance(table, dict) else {}, backend)
    try:
        return convert(table, cls, wording=CONFIG)
    except SchemaError as e:
        raise ConfigError(f"{where}{e.under(f'stage.{stage}')}") from None


# ---- the file's top level and its other tables -------------------------------------------------------------------

class _Section(Record, frozen=True):
    KEY_NOUN: ClassVar[str] = "key(s)"
    UNKNOWN_AT_TABLE: ClassVar[bool] = True
    WORDING: ClassVar = CONFIG


class Endpoints(_Section, frozen=True):
    """[endpoints]: default ipc://RUN/sock/NAME.sock; tcp://host:port for remote stages."""

    KEY_NOUN: ClassVar[str] = "stage(s)"
    encoder: PathText | None = None
    scheduler: PathText | None = None
    executor: PathText | None = None
    vae: PathText | None = None
    events: PathText | None = None             # the orchestrator's event sink (PROGRESS, DYING, READY)

    def __post_init__(self):
        from protocol.sockets import EndpointError, parse_endpoint
        for name in ENDPOINT_NAMES:
            value = getattr(self, name)
            try:
                if value is not None:
                    parse_endpoint(value)
            except EndpointError as e:
                raise SchemaError(name, str(e)) from None


class Timeouts(_Section, frozen=True):
    """[timeouts]"""

    request_s: Float(0.01, 3600.0) = REQUEST_TIMEOUT_S      # Lazy Pirate reply timeout
    retries: Int(0, 100) = REQUEST_RETRIES                  # resends before giving up
    heartbeat_s: Float(0.05, 60.0) = HEARTBEAT_INTERVAL_S
    liveness: Int(1, 100) = LIVENESS


class Security(_Section, frozen=True):
    """[security]: CURVE for tcp endpoints (key files relative to the config file; absolute once read)."""

    allow_plaintext_loopback: bool = False
    allow_wildcard_bind: bool = False          # a tcp stage binds exactly its endpoint's address; true allows *:PORT
    server_key: KeyFile | None = None          # key pair of stages this file binds on tcp
    client_key: KeyFile | None = None          # key pair used to reach tcp stages
    allowed_clients: list[KeyFile] = []        # public keys a tcp stage accepts
    servers: dict[str, Any] = {}               # [security.servers]: stage name = its public key file

    def __post_init__(self):
        for name, item in self.servers.items():
            if name not in STAGES or not isinstance(item, str) or not item or "\x00" in item:
                raise SchemaError(f"servers.{name}", f"expected a stage name ({', '.join(STAGES)}) = key file path")


class Stages(_Section, frozen=True):
    """[stage.NAME] tables: each one checked as its record (check_stage_table; a backend's keys depend on it)."""

    KEY_NOUN: ClassVar[str] = "stage"
    UNKNOWN_AT_TABLE: ClassVar[bool] = False
    encoder: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    executor: dict[str, Any] | None = None
    vae: dict[str, Any] | None = None
    orchestrator: dict[str, Any] | None = None
    http: dict[str, Any] | None = None


class PipelineFile(_Section, frozen=True):
    """The pipeline config file (stages/config.py shows one); relative paths resolve from its folder."""

    run_dir: PathText | None = None            # default: the config file's folder
    pack_dir: PathText | None = None           # the default model pack (a job that names no size gets its size)
    packs: list[_described(PathText, "a pack folder path")] = []   # more packs, one per image size
    models_dir: PathText | None = None
    backend: Text(64, 1) = "onnx"              # executor backend
    threads: Threads | None = None             # default: the machine's CPUs
    log_level: Text(16, 1) = "info"            # debug | info | warning | error (any case)
    endpoints: Endpoints = Endpoints()
    timeouts: Timeouts = Timeouts()
    security: Security = Security()
    stage: Stages = Stages()

    def __post_init__(self):
        from models.runtime.backends import backend_names           # the executor's backends live there ("rknn-sim" is one)
        _rule("backend", "" if self.backend in backend_names() else
              f"{self.backend!r:.80} is not one of {', '.join(backend_names())}")
        _rule("log_level", "" if self.log_level.lower() in LOG_LEVELS else
              f"{self.log_level.lower()!r} is not one of {', '.join(LOG_LEVELS)}")

    @property
    def cpu_threads(self) -> int:
        return self.threads if self.threads is not None else (os.cpu_count() or 1)
