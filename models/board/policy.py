"""Branch lifecycle policies: what stays loaded, what loads ahead, how the two CFG passes use the NPU.

A policy is parsed once from `[stage.executor] policy` (a string of terms joined by `+`, or a table) into a
`Policy`, checked against the backend's capabilities, and handed to `models.runtime.lifecycle.Lifecycle`:

    on-demand       load, init, infer both passes, release; nothing stays loaded (least memory)
    prefetch[N]     the next N branches load and init on a helper thread while this one infers; releases run there
                    too, so neither is on the critical path when the inference is long enough (N+1 contexts)
    dual_core       the two CFG passes at once on two contexts (two NPU cores): twice the memory
    resident        contexts stay loaded while their summed cost (the backend's context_mb) fits `resident_mb`;
                    the 84 branches run in a fixed cycle, so the first ones that fit are pinned, the rest on demand
    interleave      one request per CFG pass: the host ops of one pass run while the other pass infers
    shards          a sharded pack's N shards of a branch (anima-models pack --shards N) infer at once on N contexts
                    (N NPU cores; with dual_core 2 x N contexts over the cores); without it they infer in turn

Combinations: any of them with each other except `interleave+dual_core` (interleave wants one pass on the NPU while
the host works on the other; dual_core wants both passes on the NPU at once). Every policy gives results bitwise equal
to on-demand: the same graphs run on the same inputs, only when models load changes.

`auto` is resolved by a chooser: the one the caller building the lifecycle passes to resolve_policy, else the
backend class's own (`auto_policy`, e.g. the board backends weigh the board's memory on the modelled board's
timeline), else the documented safe choice `SAFE_AUTO` below.
"""
import dataclasses
import re
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Optional, Union

from models.base.schema import Meta, Record, SchemaError, Wording

MAX_PREFETCH = 4           # deeper than this only costs memory: the lifecycle of one branch (~0.2-0.5 s on the board)
                           # hides behind two branches of inference
TERMS = ("on-demand", "prefetch", "dual_core", "resident", "interleave", "shards")
TABLE_KEYS = ("prefetch", "dual_core", "resident_mb", "interleave", "shards")
DEFAULT_DUAL_MASKS = ("0", "1")


class PolicyError(ValueError):
    """A policy that cannot be parsed, or that this backend cannot run; the message names the key and the reason."""


class _PolicyWording(Wording):
    """A policy field's words: its title, the value, what it must be (the field's Meta)."""

    def say(self, path, p):
        return path, f"{p.meta.get('title', path)} {p.value!r} must be {p.meta.get('description', 'valid')}", p.kind


class Policy(Record, frozen=True):
    WORDING: ClassVar = _PolicyWording()

    # branches prepared ahead (0: none)
    prefetch: Annotated[int, Meta(ge=0, le=MAX_PREFETCH, title="prefetch depth",
                                  description=f"an integer in [0, {MAX_PREFETCH}]")] = 0
    dual_core: bool = False            # both CFG passes at once on two contexts
    # > 0: pin contexts while their summed context_mb fits
    resident_mb: Annotated[float, Meta(ge=0.0, lt=float(2**40), title="resident_mb",
                                       description="a number of MiB >= 0")] = 0.0
    interleave: bool = False           # one request per CFG pass, host ops of one pass during the other's inference
    # core masks of the two dual_core contexts (backends with core masks)
    dual_masks: Annotated[tuple[str, ...], Meta(min_length=2, max_length=2, title="dual_masks",
                                                description="exactly two core masks")] = DEFAULT_DUAL_MASKS
    shards: bool = False               # a sharded pack's shards at once, one context each

    @classmethod
    def _build(cls, *args, **kw):
        masks = kw.get("dual_masks")
        if isinstance(masks, (list, tuple)) and all(isinstance(x, (str, int)) and not isinstance(x, bool)
                                                    for x in masks):
            kw["dual_masks"] = tuple(str(x) for x in masks)         # RKNNLite's integers as the config's words
        try:
            return super()._build(*args, **kw)
        except SchemaError as e:
            raise PolicyError(e.detail) from None

    def __post_init__(self):
        if self.interleave and self.dual_core:
            raise PolicyError("interleave and dual_core do not combine: interleave runs one CFG pass on the NPU while "
                              "the host works on the other, dual_core runs both passes on the NPU at once")

    @property
    def resident(self) -> bool:
        return self.resident_mb > 0

    @property
    def name(self) -> str:
        """Canonical text form, parsed back to the same policy (resident_mb travels separately)."""
        terms = []
        if self.resident:
            terms.append("resident")
        if self.prefetch:
            terms.append("prefetch" if self.prefetch == 1 else f"prefetch{self.prefetch}")
        if self.dual_core:
            terms.append("dual_core")
        if self.interleave:
            terms.append("interleave")
        if self.shards:
            terms.append("shards")
        return "+".join(terms) or "on-demand"

    def branches_in_flight(self) -> int:
        """Branches loaded at once besides resident ones: the current one, the prefetched ones and one being
        released in the background."""
        return 1 + self.prefetch + (1 if self.prefetch else 0)

    def contexts_in_flight(self, shards: int = 1) -> int:
        """Contexts loaded at once besides resident ones: every branch in flight's, doubled by dual_core, times a
        sharded pack's shards (each shard its own context)."""
        per = 2 if self.dual_core else 1
        return per * self.branches_in_flight() * max(1, int(shards))


_TERM_RE = re.compile(r"^(on-demand|prefetch(\d*)|dual_core|resident|interleave|shards)$")


def parse_policy(value: Union[str, dict, Policy], settings: Optional[dict] = None) -> Policy:
    """A policy string ("prefetch2+dual_core") or table ({"prefetch": 2, "dual_core": true}) -> Policy.

    `settings` is the rest of `[stage.executor]`: `resident_mb` (for the `resident` term) and `dual_masks`. "auto"
    is not parsed here: see resolve_policy."""
    settings = settings or {}
    if isinstance(value, Policy):
        return value
    masks = settings.get("dual_masks", DEFAULT_DUAL_MASKS)
    if not isinstance(masks, (list, tuple)) or not all(isinstance(x, (str, int)) for x in masks):
        raise PolicyError(f"dual_masks {masks!r}: expected a list of two core masks such as [\"0\", \"1\"]")
    if isinstance(value, dict):
        unknown = set(value) - set(TABLE_KEYS)
        if unknown:
            raise PolicyError(f"policy table: unknown key(s) {sorted(unknown)}; known: {', '.join(TABLE_KEYS)}")
        pre = value.get("prefetch", 0)
        pre = int(pre) if isinstance(pre, bool) else pre
        for key in ("dual_core", "interleave", "shards"):
            if not isinstance(value.get(key, False), bool):
                raise PolicyError(f"policy.{key}: expected true or false, got {value[key]!r}")
        return Policy(prefetch=pre, dual_core=value.get("dual_core", False),
                      resident_mb=value.get("resident_mb", 0.0), interleave=value.get("interleave", False),
                      dual_masks=tuple(masks), shards=value.get("shards", False))
    if not isinstance(value, str):
        raise PolicyError(f"policy: expected a string such as \"prefetch+dual_core\" or a table, got {value!r}")
    text = value.strip().lower().replace("-", "_").replace("on_demand", "on-demand")
    if text == "auto":
        raise PolicyError("policy 'auto' must be resolved with resolve_policy(), not parse_policy()")
    terms = [t.strip() for t in text.split("+")]
    kw: dict[str, Any] = {"dual_masks": tuple(masks)}
    seen: set = set()
    for t in terms:
        mt = _TERM_RE.match(t)
        if not mt:
            raise PolicyError(f"policy {value!r}: unknown term {t!r}; terms: {', '.join(TERMS)} (prefetch2 = depth 2) "
                              "joined by '+', or 'auto'")
        key = "prefetch" if t.startswith("prefetch") else t
        if key in seen:
            raise PolicyError(f"policy {value!r}: {key!r} given twice")
        seen.add(key)
        if key == "prefetch":
            kw["prefetch"] = int(mt.group(2) or 1)
        elif key == "resident":
            budget = settings.get("resident_mb")
            if budget is None or isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
                raise PolicyError(f"policy {value!r}: 'resident' needs resident_mb = <MiB budget for resident "
                                  f"contexts> in [stage.executor] (got {budget!r})")
            kw["resident_mb"] = float(budget)
        elif key in ("dual_core", "interleave", "shards"):
            kw[key] = True
    if "on-demand" in seen and seen & {"prefetch", "resident"}:
        raise PolicyError(f"policy {value!r}: on-demand contradicts prefetch/resident (it combines with dual_core "
                          "and interleave only)")
    return Policy(**kw)


def policy_problem(value, settings: Optional[dict] = None) -> str:
    """What is wrong with a configured policy, "" when it parses ("auto" always does): for checking a config file
    when it is read, before any backend is known (the backend's capabilities are checked when the executor starts)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return ""
    try:
        parse_policy(value, settings)
    except PolicyError as e:
        return str(e)
    return ""


# ---- the backend's side --------------------------------------------------------------------------------------------

def check_policy(policy: Policy, backend_class) -> Policy:
    """PolicyError when the backend cannot run the policy (capabilities are BranchBackend class attributes)."""
    name = getattr(backend_class, "name", backend_class.__name__)
    most = getattr(backend_class, "max_contexts", None)
    if (policy.dual_core or policy.shards) and getattr(backend_class, "parallel_contexts", 1) < 2:
        raise PolicyError(f"policy {policy.name!r}: backend {name!r} cannot run two contexts at the same time "
                          f"({'dual_core' if policy.dual_core else 'shards'} needs several)")
    need = policy.contexts_in_flight() + (1 if policy.resident else 0)
    if most is not None and need > most:
        raise PolicyError(f"policy {policy.name!r} holds up to {need} contexts at once; backend {name!r} holds "
                          f"{most} (use on-demand or interleave)")
    return policy


# ---- auto ------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AutoContext:
    """What an `auto` chooser may look at."""
    backend: str                     # backend name ("onnx", "rknn", "board-sim", ...)
    backend_class: Any
    settings: dict                   # the whole [stage.executor] table (board RAM, resident_mb, ...)
    packs: tuple = ()                # the configured packs (model sizes, resolutions), the default first


# A chooser takes an AutoContext and returns a Policy, a policy string, or None (no opinion: safe_auto).
Chooser = Callable[[AutoContext], Any]
SAFE_AUTO = "prefetch"          # without a chooser: prefetch when the backend can hold its contexts, else on-demand


def safe_auto(ctx: AutoContext) -> Policy:
    """The documented fallback: prefetch (depth 1) if the backend can hold the two contexts it needs, else
    on-demand. Memory: one extra context (the reference board's 155 MiB per context fits any board)."""
    try:
        return check_policy(parse_policy(SAFE_AUTO), ctx.backend_class)
    except PolicyError:
        return Policy()


def resolve_policy(value: Union[str, dict, Policy, None], backend: str, backend_class, settings: Optional[dict] = None,
                   packs=(), chooser: Optional[Chooser] = None) -> Policy:
    """The configured policy (default "auto") -> a checked Policy for this backend. `auto` asks `chooser`, else the
    backend class's own (`BranchBackend.auto_policy`), else safe_auto."""
    settings = dict(settings or {})
    value = "auto" if value is None else value
    if isinstance(value, str) and value.strip().lower() == "auto":
        ctx = AutoContext(backend, backend_class, settings, tuple(Path(p) for p in packs))
        chooser = chooser or getattr(backend_class, "auto_policy", None)
        chosen = chooser(ctx) if chooser is not None else None
        policy = parse_policy(safe_auto(ctx) if chosen is None else chosen, settings)
    else:
        policy = parse_policy(value, settings)
    return check_policy(policy, backend_class)
