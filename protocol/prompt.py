"""The prompt as one typed record, from every way in to the sampler.

`PromptFile` is what a prompt.json file (or a ComfyUI graph, an A1111 request, the page, `generate`) asks for: the
fronts build it, SUBMIT carries it, the daemon resolves it into a `PromptSpec` (the seed drawn, Spectrum as its
settings, `output` an absolute path; orchestrator/engine/prompt_spec.py) and the job store keeps that. Every error
names the field and the allowed values in prompt.json's words (docs/prompts.md)."""
from typing import Annotated, ClassVar, Literal

from models.images.crop import MAX_CROP_SIDE
from models.lora.choice import MAX_LORAS, LoraChoice
from models.sampling.sampler import (DEFAULT_SAMPLER, DEFAULT_SCHEDULER, SAMPLER_NAMES, SCHEDULER_NAMES,
                                     cfg_passes, spectrum_refusal)
from models.sampling.bounds import CFG, STEPS, Cfg, Steps
from models.sampling.img2img import DENOISE_STEPS, LatentPlan, passes_through
from models.sampling.latent_mix import MAX_OFFSET
from models.sampling.latent_ops import LATENT_SCALE, UPSCALE_METHODS, LatentOpError, schedule_steps, upscale_size
from models.sampling.schedules import DEFAULT_SHIFT
from models.sampling.spectrum import SpectrumSettings
from models.sampling.step_cache import CacheSettings
from models.base.schema import Float, Int, Items, Meta, Record, SchemaError, Text, Wording, record_in
from models.text.prompt_weights import PromptWeightError, check_prompt

MAX_FILE_BYTES = 64 * 1024      # a prompt file larger than this is refused before parsing
MAX_PROMPT_CHARS = 4000         # per prompt (the text encoder keeps at most 512 tokens anyway)
MAX_STEPS = STEPS.hi            # models/sampling/bounds.py: one record of the sampling bounds
MAX_CFG = CFG.hi
MAX_SIDE = 4096                 # pixels
SEED_LIMIT = 2 ** 64            # seeds are 0 <= seed < 2^64
DEFAULT_STEPS = 30
DEFAULT_CFG = 4.0
SAMPLING_FIELDS = ("steps", "cfg", "sampler", "scheduler")   # a pack's recorded settings fill these when unset
DEFAULT_SAMPLING = {"steps": DEFAULT_STEPS, "cfg": DEFAULT_CFG, "sampler": DEFAULT_SAMPLER,
                    "scheduler": DEFAULT_SCHEDULER}        # a pack that records none
MAX_BATCH = 8                   # images per job (batch-1 packs run them one after another)
MAX_NOISE_INDEX = 4095          # an image's place in ComfyUI's batch noise (DenoiseParams.noise_index)
MAX_FROM_BATCH = 64             # batch_index + batch: the images of a batch a job may pick from (RepeatLatentBatch's)
MAX_HIRES_SCALE = 4.0           # hires `scale`: each latent side times at most this
MAX_INT_DIGITS = 40             # a JSON integer longer than this is never a valid value (seeds are < 2^64: 20 digits)
MAX_OUTPUT_CHARS = 4096
MAX_INPUT_REF_CHARS = 1024      # an upload's name as LoadImage gives it: 'sub/NAME.png [input]'
_UPLOAD_NAME = "an uploaded image's name as LoadImage gives it ('NAME.png', 'sub/NAME.png [input]')"
_NON_EMPTY_PATH = "a non-empty path string"


class PromptError(SchemaError):
    """A prompt.json problem; `field` is the dotted field name ('' for the file as a whole)."""

    def __init__(self, field: str, message: str, code: str = "bad_field"):
        super().__init__(field, message, code)
        ValueError.__init__(self, f"prompt.json: field '{field}': {message}" if field else f"prompt.json: {message}")


class _LongInt:
    """A JSON integer with more than MAX_INT_DIGITS digits, kept unconverted: int() of a few thousand digits raises
    ValueError (Python's int-from-string limit) before any field could be named; the field check names it instead."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


class PromptWording(Wording):
    """prompt.json's words: JSON's type names, the allowed range in every message."""

    JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
                  type(None): "null", _LongInt: "integer"}

    def json_type(self, v) -> str:
        return self.JSON_TYPES.get(type(v), type(v).__name__)

    def type(self, p):
        given, got = [e for e in p.expected if e != "null"], self.json_type(p.value)
        lo, hi = p.meta.get("ge", p.meta.get("gt")), p.meta.get("le")
        if "description" in p.meta:
            return f"must be {p.meta['description']}, got {got} {p.value!r:.80}"
        if given == ["integer"]:
            if isinstance(p.value, _LongInt):
                return f"must be in {lo}..{hi}, got an integer of {p.value.digits} digits"
            return f"must be an integer in {lo}..{hi}, got {got} {p.value!r:.80}"
        if given == ["number"]:
            return f"must be a number in [{lo}, {hi}], got {got} {p.value!r:.80}"
        if given == ["choice"]:
            return self.choice(p)
        if given == ["boolean"]:
            return f"must be true or false, got {got}"
        if sorted(given) == ["boolean", "struct"]:
            return f"must be true, false or an object of {self.noun(p)}s, got {got}"
        if given == ["array"]:
            return f"must be an array, got {got}"
        if given == ["struct"]:
            return f"must be an object of {self.noun(p)}s, got {got}"
        if given == ["string"]:
            return f"must be a string, got {got}"
        return f"must be {' or '.join(given)}, got {got}"

    @staticmethod
    def noun(p) -> str:
        return record_in(p.declared).KEY_NOUN

    def range(self, p):
        if "gt" in p.meta and not p.value > p.meta["gt"]:
            return f"must be greater than {p.meta['gt']:g}"
        if self.number(p.value, p.declared) != str(p.value) or isinstance(p.value, float):
            return f"must be in {self.bounds(p.meta)}, got {float(p.value)}"
        return f"must be in {p.meta.get('ge')}..{p.meta.get('le')}, got {p.value}"

    def nonfinite(self, p):
        return f"must be in {self.bounds(p.meta)}, got {p.value}"

    def length(self, p):
        lo = p.meta.get("min_length", 0)
        if p.unit != "characters":
            return f"holds {p.count} {p.unit}; at most {p.meta.get('max_length')}" if p.count > lo else \
                f"must hold at least {lo} {p.unit}"
        if p.count < lo:
            return "must not be empty"
        return f"is {p.count} characters long; the limit is {p.meta.get('max_length')}"

    def nul(self, p):
        return "must not contain NUL characters"

    def choice(self, p):
        return f"must be one of {', '.join(repr(a) for a in p.choices)}, got {p.value!r:.80}"

    def missing(self, p):
        return "is required"

    def unknown(self, path, p):
        key = str(p.key).encode("utf-8", "backslashreplace").decode("ascii", "replace")[:80]
        return (f"{path}.{key}" if path else key), \
            f"unknown {p.record.KEY_NOUN}; allowed: {', '.join(p.expected)}", "unknown_field"


PROMPT = PromptWording()


def _unicode(name: str, v: str) -> None:
    """JSON escapes can spell lone surrogates (\\ud800) that are not Unicode text: the encoder and every message
    codec would fail on them later, in the middle of a job."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(name, f"holds a lone surrogate (U+{ord(v[e.start]):04X} at character {e.start}), "
                                "which is not valid Unicode text") from None


def _text(name: str, v: str, *, required: bool) -> None:
    _unicode(name, v)
    if required and not v.strip():
        raise PromptError(name, "must not be empty")
    try:
        check_prompt(v)
    except PromptWeightError as e:
        raise PromptError(name, str(e)) from None


Side = Int(16, MAX_SIDE)
MAX_COND_ENTRIES = 8            # conditionings per CFG side (each is one more DiT pass per step while active)
MAX_COND_STRENGTH = 10.0        # ComfyUI's ConditioningSetAreaStrength bound


class CondAverage(Record, frozen=True):
    """ComfyUI's ConditioningAverage of an entry: its Qwen3 states blended with `text`'s, `weight` x its own + (1 -
    weight) x `text`'s (ComfyUI's conditioning_to_strength; `text`'s states cut or zero-padded to the entry's length);
    the entry's own T5 ids and weights feed the LLM adapter (docs/prompts.md)."""

    KEY_NOUN: ClassVar[str] = "setting"

    text: Text(MAX_PROMPT_CHARS)
    weight: Float(0.0, 1.0) = 1.0


class CondEntry(Record, frozen=True):
    """One conditioning of `positive` or `negative`: `text` encoded, then optionally ComfyUI's ConditioningAverage
    (`average`) and ConditioningZeroOut (`zero_out`: the Qwen3 states zeroed before the blend; the LLM adapter still
    runs on them with the text's T5 ids, so the context is not zero); and how the sampler uses it: a model pass of
    its own whose output counts with `strength` (ComfyUI's default 1.0) while the step's sigma lies in its window
    `start`..`end` (percent of the schedule, ConditioningSetTimestepRange). docs/prompts.md."""

    KEY_NOUN: ClassVar[str] = "setting"

    text: Text(MAX_PROMPT_CHARS)
    strength: Float(0.0, MAX_COND_STRENGTH) = 1.0
    start: Float(0.0, 1.0) = 0.0
    end: Float(0.0, 1.0) = 1.0
    zero_out: bool = False
    average: CondAverage | None = None

    @property
    def plain(self) -> bool:
        """True when the entry is its text encoded as it is (what `prompt` / `negative_prompt` say)."""
        return not self.zero_out and self.average is None

    @property
    def whole(self) -> bool:
        """True when the entry counts at strength 1 over the whole schedule (no pass of its own is needed)."""
        return self.strength == 1.0 and self.start == 0.0 and self.end == 1.0


def mixes(entries) -> bool:
    """Whether a side's entries (CondEntry records or their dicts; None: the plain prompt) need a model pass each, as
    ComfyUI's ConditioningCombine / SetTimestepRange / SetAreaStrength run them: more than one, or one with its own
    strength or window. One whole entry is the side's context as it is (with its zero_out / average)."""
    if not entries:
        return False
    def get(e, k, d):
        return e.get(k, d) if isinstance(e, dict) else getattr(e, k)
    return len(entries) > 1 or any((get(e, "strength", 1.0), get(e, "start", 0.0), get(e, "end", 1.0)) !=
                                   (1.0, 0.0, 1.0) for e in entries)


def _check_mixing(f) -> None:
    """A job whose entries each take a model pass (`mixes`): a second pass samples with the same entries; no
    EasyCache."""
    sides = [side for side in ("positive", "negative") if mixes(getattr(f, side))]
    if not sides:
        return
    h = f.hires
    own = [(name, text) for name, text in (("prompt", h and h.prompt), ("negative_prompt", h and h.negative_prompt))
           if text is not None]
    if own:
        # the second pass samples with the first pass's conditionings (the same nodes in a ComfyUI graph); a prompt of
        # its own would give it other entries than prompt.json can say
        raise PromptError(f"hires.{own[0][0]}", "with several conditionings (positive / negative entries that each "
                                                "take a model pass) the second pass takes the first pass's: leave "
                                                "hires.prompt and hires.negative_prompt out")
    if f.cache is not None and f.cache.kind == "easycache":
        # LazyCache acts on the CFG-combined prediction, after the entries' mix: it runs as with one conditioning
        raise PromptError("cache", "EasyCache with several conditionings is not supported: ComfyUI's EasyCache "
                                   "keeps an output difference per conditioning and decides from the first one of "
                                   "its model batch (which changes as windows open and close), not tracked here; "
                                   "use LazyCache (kind \"lazycache\") or leave \"cache\" out")


class HiresSettings(Record, frozen=True):
    """prompt.json's `hires`: after the first denoise the latent upscaled as ComfyUI's LatentUpscaleBy (`scale`) or
    LatentUpscale (`width` and `height`, pixels) with `method`, then sampled again from it on the pack of the new
    size: `steps` (0: the job's), `denoise` (docs/workflows.md). Without scale, width and height the second pass
    samples the first pass's latent as it is (a second KSampler chained on the first's LATENT: split sampling with
    KSamplerAdvanced's window, `start_step` ... `leftover_noise`, docs/latent-sampling.md)."""

    KEY_NOUN: ClassVar[str] = "setting"

    scale: Float(1.0, MAX_HIRES_SCALE) | None = None
    width: Side | None = None
    height: Side | None = None
    method: Literal[UPSCALE_METHODS + ("lanczos",)] = "nearest-exact"
    # "latent": the latent upscaled (LatentUpscale[By]); "pixel": the first pass decoded, the image scaled as
    # ComfyUI's ImageScale[By] (`method`, lanczos too, bislerp not) and encoded again (VAEEncode)
    space: Literal["latent", "pixel"] = "latent"
    steps: Int(0, MAX_STEPS) = 0
    denoise: Float(0.0, 1.0) = 0.5
    # the second KSampler's own settings; None: the job's (A1111's hr_prompt / hr_negative_prompt, hr_sampler_name,
    # hr_scheduler; a ComfyUI graph's second KSampler and its CLIPTextEncode nodes)
    prompt: Text(MAX_PROMPT_CHARS) | None = None
    negative_prompt: Text(MAX_PROMPT_CHARS) | None = None
    sampler: Literal[SAMPLER_NAMES] | None = None
    scheduler: Literal[SCHEDULER_NAMES] | None = None
    cfg: Cfg | None = None
    seed: Int(0, SEED_LIMIT - 1) | None = None
    # the second KSamplerAdvanced's window, as the job's own start_step ... leftover_noise
    start_step: Int(0, 10_000) | None = None
    end_step: Int(0, 10_000) | None = None
    add_noise: bool = True
    leftover_noise: bool = False
    # the first pass's image kept too (base.png, base_1.png ...), as a ComfyUI graph's SaveImage on its VAEDecode
    keep_base: bool = False

    @property
    def upscaled(self) -> bool:
        """False for a second pass on the first latent as it is (no scale, width or height: no upscale node)."""
        return self.scale is not None or self.width is not None

    def size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) in pixels of the second pass for a first pass of width x height: LatentUpscale[By]'s whole
        latent cells, for the pixel path too (the graph front refuses an ImageScale[By] whose size differs)."""
        h, w = upscale_size((height // LATENT_SCALE, width // LATENT_SCALE), self.width or 0, self.height or 0,
                            None if self.scale is None else float(self.scale))
        return w * LATENT_SCALE, h * LATENT_SCALE


class CropSettings(Record, frozen=True):
    """prompt.json's `crop`: the final image cut as ComfyUI's ImageCrop after VAEDecode (models/images/crop.py: x and y
    clamped to the image, the box cut where the image ends), each of the batch's images."""

    KEY_NOUN: ClassVar[str] = "setting"

    width: Int(1, MAX_CROP_SIDE) = 512
    height: Int(1, MAX_CROP_SIDE) = 512
    x: Int(0, MAX_CROP_SIDE) = 0
    y: Int(0, MAX_CROP_SIDE) = 0


class MixSettings(Record, frozen=True):
    """What latent_mix and init_mix share: ComfyUI's LatentComposite (`kind` "composite": `x`, `y`, `feather` in
    pixels, floored to latent cells of 8) or LatentBlend (`kind` "blend": `factor`) of two latents
    (models/sampling/latent_mix.py); each adds which latent `onto` names (samples_to / samples1)."""

    KEY_NOUN: ClassVar[str] = "setting"

    kind: Literal["composite", "blend"]
    x: Int(0, MAX_OFFSET) = 0
    y: Int(0, MAX_OFFSET) = 0
    feather: Int(0, MAX_OFFSET) = 0
    factor: Float(0.0, 1.0) = 0.5


class LatentMix(MixSettings, frozen=True):
    """prompt.json's `latent_mix`: after an img2img job's first pass, its latent mixed with the init image's (the VAE
    encode the pass started from) before VAEDecode or, with a latent-space hires, before the second pass; `onto`
    "result" is the pass's latent, "image" the init image's."""

    onto: Literal["result", "image"] = "result"


def _check_mix(f) -> None:
    """latent_mix: the init image's latent to mix with, one pass, and only its kind's settings."""
    m = f.latent_mix
    if m is None:
        return
    if f.init_image is None:
        raise PromptError("latent_mix", "combines the pass's latent with the init image's VAE latent; there is no "
                                        "init_image")
    if f.hires is not None and f.hires.space == "pixel":
        raise PromptError("latent_mix", "runs between the passes on the latent path (or before VAEDecode): with "
                                        "hires.space \"pixel\" it is not supported")
    _kind_fields("latent_mix", m)


class InitMix(MixSettings, frozen=True):
    """prompt.json's `init_mix`: an img2img job's start latent made before its first pass from two encoded uploads,
    as a ComfyUI graph's LatentComposite / LatentBlend of two VAEEncodes before the KSampler: `init_image`'s latent
    and `image`'s (another upload, or the same, brought to the job's size as init_image is); `onto` "init_image" or
    "image"."""

    image: Annotated[str, Meta(min_length=1, max_length=MAX_INPUT_REF_CHARS, description=_UPLOAD_NAME)]
    onto: Literal["init_image", "image"] = "init_image"


def _kind_fields(field: str, m) -> None:
    """A composite takes x, y and feather, a blend only its factor (latent_mix's and init_mix's rule)."""
    if m.kind == "blend":
        for name in ("x", "y", "feather"):
            if getattr(m, name):
                raise PromptError(f"{field}.{name}", "places a composite; \"kind\": \"blend\" takes only "
                                                     "\"factor\" (and \"onto\")")
    elif m.factor != 0.5:
        raise PromptError(f"{field}.factor", "weighs a blend; \"kind\": \"composite\" takes x, y and feather")


def _check_init_mix(f) -> None:
    """init_mix: an init_image to mix with, no mask (its noise mask is not carried through the mix here), no
    latent_mix beside it (whose "image" latent would be ambiguous)."""
    m = f.init_mix
    if m is None:
        return
    if f.init_image is None:
        raise PromptError("init_mix", "mixes init_image's VAE latent with another upload's before the first pass; "
                                      "there is no init_image")
    if f.mask is not None:
        raise PromptError("init_mix", "with a mask is not supported yet (the noise mask a mixed start latent "
                                      "carries); leave out one of them")
    if f.latent_mix is not None:
        raise PromptError("init_mix", "with latent_mix is not supported yet (which VAE latent the second mix "
                                      "takes); leave out one of them")
    _unicode("init_mix.image", m.image)
    if "\x00" in m.image:
        raise PromptError("init_mix.image", "must not contain NUL characters")
    _kind_fields("init_mix", m)


class PromptFile(Record, frozen=True):
    """What a prompt.json file may hold (docs/prompts.md); omitted or null seed: drawn at random; omitted or null
    width/height: the pack's; spectrum: true, false or an object of settings (omitted or null: on, except for the
    samplers it does not fit, models/sampling/sampler.py; asked for with one of those, refused naming the sampler);
    loras: [{name, strength, clip_strength}] (docs/lora.md)."""

    WORDING: ClassVar = PROMPT
    ERROR: ClassVar = PromptError
    SPECTRUM_AS_ASKED: ClassVar[bool] = True    # `spectrum` is what the file asked (a PromptSpec's is settled)

    prompt: Text(MAX_PROMPT_CHARS) | None = None     # required unless `positive` says it
    negative_prompt: Text(MAX_PROMPT_CHARS) = ""
    # the sampler's conditioning inputs as entries (ConditioningZeroOut, ConditioningAverage: docs/prompts.md);
    # None: `prompt` / `negative_prompt` encoded as they are
    positive: Items(CondEntry, MAX_COND_ENTRIES, 1) | None = None
    negative: Items(CondEntry, MAX_COND_ENTRIES, 1) | None = None
    seed: Int(0, SEED_LIMIT - 1) | None = None
    # omitted or null: the settings the job's pack records for its model (models/packs/sampling.py), else
    # DEFAULT_SAMPLING (resolve_prompt fills them)
    steps: Steps | None = None
    cfg: Cfg | None = None
    width: Side | None = None            # None: the pack's resolution (filled by `with_resolution`)
    height: Side | None = None
    sampler: Literal[SAMPLER_NAMES] | None = None
    scheduler: Literal[SCHEDULER_NAMES] | None = None
    spectrum: bool | SpectrumSettings | None = None     # omitted or null: on, where the sampler allows it
    output: Annotated[str, Meta(min_length=1, max_length=MAX_OUTPUT_CHARS, description=_NON_EMPTY_PATH)] | None = None
    overwrite: bool = False              # an existing `output` file is replaced (else kept, and the job says so)
    loras: Items(LoraChoice, MAX_LORAS) = ()   # names under MODELS/loras/, checked against the pack at submit
    cache: CacheSettings | None = None   # ComfyUI's EasyCache / LazyCache (docs/prompts.md); null: none
    # img2img / inpaint (docs/workflows.md): uploads in RUN/input|temp|output, read and kept in the job at submit
    init_image: Annotated[str, Meta(min_length=1, max_length=MAX_INPUT_REF_CHARS, description=_UPLOAD_NAME)] | None \
        = None
    mask: Annotated[str, Meta(min_length=1, max_length=MAX_INPUT_REF_CHARS, description=_UPLOAD_NAME)] | None = None
    # None: A1111's rule (white, or a translucent mask's alpha, is repainted); a channel: ComfyUI's LoadImageMask
    # of it (LoadImage's MASK is "alpha": 1 - alpha is repainted), the rule a ComfyUI graph's mask follows
    mask_channel: Literal["alpha", "red", "green", "blue"] | None = None
    # ComfyUI's VAEEncodeForInpaint: the pixels under the mask grey (0.5) before encoding, the mask grown by this
    # as the noise mask; None: the image encoded as it is (VAEEncode)
    grow_mask_by: Int(0, 64) | None = None
    # A1111's inpainting_fill 2 / 3: the masked part of the init latent replaced by the seed's noise ("noise") or by
    # zeros ("nothing") before sampling; None: the encoded image as it is
    latent_fill: Literal["noise", "nothing"] | None = None
    resize_mode: Int(0, 2) | None = None       # an init image/mask of another size: A1111's modes; None: refused
    denoise: Float(0.0, 1.0) = 1.0             # KSampler's denoise: the part of the schedule sampled
    # how denoise counts steps: ComfyUI's KSampler (all `steps`) or A1111's img2img (int(denoise x steps) + 1)
    denoise_steps: Literal[DENOISE_STEPS] = "comfyui"
    # KSamplerAdvanced's window (docs/latent-sampling.md)
    start_step: Int(0, 10_000) | None = None   # start_at_step
    end_step: Int(0, 10_000) | None = None     # end_at_step
    add_noise: bool = True
    leftover_noise: bool = False               # return_with_leftover_noise (with end_step)
    # images from one seed as ComfyUI's EmptyLatentImage batch_size samples them (docs/workflows.md)
    batch: Int(1, MAX_BATCH) = 1
    # ComfyUI's LatentFromBatch past a batch's first image: the job's first image's place in the seed's batch noise
    # (its images batch_index .. batch_index + batch - 1, each its own draw as prepare_noise gives them), within
    # the first MAX_FROM_BATCH images of it (a RepeatLatentBatch's most)
    batch_index: Int(0, MAX_FROM_BATCH - 1) = 0
    hires: HiresSettings | None = None         # hires fix: a second pass at a larger size (docs/workflows.md)
    crop: CropSettings | None = None           # ImageCrop of the final image (docs/workflows.md)
    # LatentComposite / LatentBlend of the pass's latent with the init image's, before VAEDecode (docs/prompts.md)
    latent_mix: LatentMix | None = None
    # LatentComposite / LatentBlend of init_image's latent and another upload's, the first pass's start
    # (docs/prompts.md)
    init_mix: InitMix | None = None

    def __post_init__(self):
        _check_conds(self)
        _check_mixing(self)
        for side in ("width", "height"):
            v = getattr(self, side)
            if v is not None and v % 16:
                raise PromptError(side, f"must be a multiple of 16 (8x VAE downsampling x 2x2 patches), got {v}")
        spectrum_on = self.spectrum if isinstance(self.spectrum, (bool, type(None))) else self.spectrum.enabled
        if spectrum_on and self.sampler is not None:
            _spectrum_fits("spectrum", self.sampler)
        if self.cache is not None and spectrum_on:
            raise PromptError("cache", f"{self.cache.node} and Spectrum both decide which model calls to skip: leave "
                                       "\"spectrum\" out (a cache turns it off) or set it false")
        _check_inputs(self)
        _check_hires(self)
        _check_mix(self)
        _check_init_mix(self)
        if self.batch_index + self.batch > MAX_FROM_BATCH:
            raise PromptError("batch_index", f"batch_index + batch must be at most {MAX_FROM_BATCH} (the images of "
                                             f"a batch a job picks from), got {self.batch_index} + {self.batch}")
        _check_window("start_step", self.start_step, self.end_step, self.steps, self.sampler, self.scheduler,
                      self.denoise, self.denoise_steps)
        if self.output is not None:
            if not self.output.strip():
                raise PromptError("output", f"must be {_NON_EMPTY_PATH}, got string {self.output!r}")
            if "\x00" in self.output:
                raise PromptError("output", "must not contain NUL characters")
            _unicode("output", self.output)

    def cond(self, side: str) -> CondEntry:
        """The conditioning of the sampler's `side` ("positive" | "negative"): the entry, or the plain text."""
        entries = getattr(self, side)
        if entries is not None:
            return entries[0]
        return CondEntry(text=self.prompt if side == "positive" else self.negative_prompt)

    def sampling_set(self) -> bool:
        """True when steps, cfg, sampler and scheduler are all set (a resolved spec's always are)."""
        return all(getattr(self, k) is not None for k in SAMPLING_FIELDS)

    def negative_ignored(self) -> bool:
        """True when no pass of the job runs at a cfg other than 1: ComfyUI then runs no unconditional pass
        (comfy/samplers.py), so a negative prompt changes nothing and is not encoded."""
        cfgs = [self.cfg] + ([self.cfg if self.hires.cfg is None else self.hires.cfg] if self.hires else [])
        return all(c is not None and cfg_passes(c) == 1 for c in cfgs)

    def sampling_filled(self, recorded: dict | None = None) -> dict:
        """{steps, cfg, sampler, scheduler} as the job runs them: its own where set, else the pack's `recorded`
        settings, else DEFAULT_SAMPLING."""
        base = {**DEFAULT_SAMPLING, **(recorded or {})}
        return {k: base[k] if getattr(self, k) is None else getattr(self, k) for k in SAMPLING_FIELDS}


def _check_conds(f) -> None:
    """The texts of prompt / negative_prompt and of the entries; an entry list says its side's text (`prompt`, when
    also given, must be its first entry's text: one text per side)."""
    for side, name in (("positive", "prompt"), ("negative", "negative_prompt")):
        entries, text = getattr(f, side), getattr(f, name) or ""
        if entries is None:
            if getattr(f, name) is None:
                raise PromptError(name, "is required")
            _text(name, text, required=side == "positive")
            continue
        _text(name, text, required=False)
        for k, e in enumerate(entries):
            _text(f"{side}[{k}].text", e.text, required=side == "positive")
            if e.average is not None:
                _text(f"{side}[{k}].average.text", e.average.text, required=False)
        if text and text != entries[0].text:
            raise PromptError(name, f"differs from {side}[0].text; give the text once (in {side}[0].text)")


def _check_hires(f) -> None:
    h = f.hires
    if h is None:
        return
    if (h.scale is not None and h.width is not None) or (h.width is None) != (h.height is None):
        raise PromptError("hires", "needs either scale, or both width and height (neither: the second pass samples "
                                   "the first latent as it is)")
    if h.space == "pixel" and not h.upscaled:
        raise PromptError("hires.space", "the pixel path scales the decoded image: give scale, or width and height")
    if not h.denoise > 0:
        raise PromptError("hires.denoise", f"must be in (0, 1] (0 would sample nothing), got {float(h.denoise)}")
    _check_schedule("hires.denoise", h.steps or f.steps, h.denoise)       # the second pass counts as ComfyUI's
    if h.space == "latent" and h.method == "lanczos":
        raise PromptError("hires.method", "lanczos scales pixels (ImageScale): set \"space\": \"pixel\", or pick a "
                                          "latent method")
    if h.space == "pixel" and h.method == "bislerp":
        raise PromptError("hires.method", "bislerp scales latents (LatentUpscale): set \"space\": \"latent\", or "
                                          "pick a pixel method")
    for name in ("prompt", "negative_prompt"):
        if getattr(h, name) is not None:
            _text(f"hires.{name}", getattr(h, name), required=False)
    spectrum_on = f.spectrum if isinstance(f.spectrum, (bool, type(None))) else f.spectrum.enabled
    # asked for with a second-pass sampler it does not fit: refused (left to its default, it is off for that pass)
    if f.SPECTRUM_AS_ASKED and spectrum_on and h.sampler is not None:
        _spectrum_fits("hires.sampler", h.sampler)
    _check_window("hires.start_step", h.start_step, h.end_step, h.steps or f.steps, h.sampler or f.sampler,
                  h.scheduler or f.scheduler, h.denoise)


def _spectrum_fits(field: str, sampler: str) -> None:
    """Spectrum asked for (or on by default) with a sampler it does not fit: refused naming the sampler."""
    why = spectrum_refusal(sampler)
    if why:
        raise PromptError(field, f"{why}; set \"spectrum\": false for it (docs/samplers.md)")


def _check_window(field: str, start, end, steps, sampler, scheduler, denoise, denoise_steps="comfyui") -> None:
    """A KSamplerAdvanced window that leaves no step of its schedule refused (ComfyUI would return the latent
    untouched); checked once steps, sampler and scheduler are known (a resolved spec's always are)."""
    if start is None or None in (steps, sampler, scheduler):
        return
    plan = LatentPlan(denoise=float(denoise), denoise_steps=denoise_steps, start_step=start, last_step=end)
    if passes_through(sampler, scheduler, steps, DEFAULT_SHIFT, plan):
        raise PromptError(field, f"start_at_step {start} leaves no step of the {steps}-step schedule to sample")


def _check_schedule(field: str, steps: int, denoise) -> None:
    """The full schedule a partial denoise builds, bounded before anything builds it (latent_ops.schedule_steps).
    Unset steps (a file that leaves them to its pack's record) are checked once the spec is resolved."""
    if steps is None:
        return
    try:
        schedule_steps(steps, float(denoise))
    except LatentOpError as e:
        raise PromptError(field, str(e)) from None


def _check_inputs(f) -> None:
    if not f.denoise > 0:
        raise PromptError("denoise", f"must be in (0, 1] (0 would sample nothing), got {float(f.denoise)}")
    if f.denoise_steps == "comfyui":                # A1111's count samples the schedule of `steps` itself
        _check_schedule("denoise", f.steps, f.denoise)
    if f.mask is not None and f.init_image is None:
        raise PromptError("mask", "needs an init_image to inpaint")
    if f.mask_channel is not None and f.mask is None:
        raise PromptError("mask_channel", "says how to read a mask; there is no mask")
    if f.grow_mask_by is not None and f.mask is None:
        raise PromptError("grow_mask_by", "grows the inpaint mask; there is no mask")
    if f.latent_fill is not None and f.mask is None:
        raise PromptError("latent_fill", "fills the masked part of the latent; there is no mask")
    for name in ("init_image", "mask"):
        v = getattr(f, name)
        if v is not None:
            _unicode(name, v)
            if "\x00" in v:
                raise PromptError(name, "must not contain NUL characters")


class PromptSpec(PromptFile, frozen=True):
    """A checked job prompt: the file's fields with the seed drawn when it had none (recorded), Spectrum as its
    settings record and `output` an absolute path (of a .png file or of a directory; None: the job folder)."""

    SPECTRUM_AS_ASKED: ClassVar[bool] = False
    prompt: Text(MAX_PROMPT_CHARS) = ""      # the positive's text (resolve_prompt sets it from `positive`)
    steps: Int(1, MAX_STEPS) = DEFAULT_STEPS
    cfg: Float(1.0, MAX_CFG) = DEFAULT_CFG
    sampler: Literal[SAMPLER_NAMES] = DEFAULT_SAMPLER
    scheduler: Literal[SCHEDULER_NAMES] = DEFAULT_SCHEDULER
    spectrum: SpectrumSettings = SpectrumSettings()
    seed: Int(0, SEED_LIMIT - 1) = 0
    seed_random: bool = False           # True when the file had no seed and one was drawn (recorded for the report)

    @classmethod
    def from_dict(cls, d: dict) -> "PromptSpec":
        """Rebuild a spec stored by `to_dict` (job.json); re-validates every field."""
        return cls.from_data(d)

    def with_sizes(self, sizes) -> "PromptSpec":
        """`fit_size` filled in (a copy, checked as any new record)."""
        width, height = fit_size(self, sizes)
        return self.replace(width=width, height=height)

    def with_resolution(self, width: int, height: int) -> "PromptSpec":
        """`with_sizes` for one pack."""
        return self.with_sizes([(width, height)])


def fit_size(f: PromptFile, sizes) -> tuple[int, int]:
    """The (width, height) a record runs at: its own, an omitted side from the first size that fits (the default pack
    first); a size that has no model pack is refused, naming the sizes that have one, and so is a second pass whose
    size has none. `sizes`: (width, height) pairs."""
    sizes = [tuple(s) for s in sizes]
    fits = [(w, h) for w, h in sizes if f.width in (None, w) and f.height in (None, h)]
    if not fits:
        name = "width" if f.width is not None else "height"
        want = f"{f.width if f.width is not None else '*'}x{f.height if f.height is not None else '*'}"
        have = ", ".join(f"{w}x{h}" for w, h in sizes) or "none"
        raise PromptError(name, f"{want} has no model pack; the sizes with a pack: {have}")
    if f.hires is not None:                     # the second pass runs on the pack of its size
        try:
            second = f.hires.size(*fits[0])
        except LatentOpError as e:
            raise PromptError("hires", str(e)) from None
        if second not in sizes:
            have = ", ".join(f"{w}x{h}" for w, h in sizes)
            raise PromptError("hires", f"the second pass at {second[0]}x{second[1]} has no model pack; the sizes "
                                       f"with a pack: {have}")
    return fits[0]


def check_sampled(spec: PromptSpec) -> None:
    """The record's rules that read steps, sampler and scheduler, for a spec whose unset ones were filled after the
    record was checked (resolve_prompt: the pack's recorded settings, else the defaults); the others cannot change."""
    if spec.spectrum.enabled:
        _spectrum_fits("spectrum", spec.sampler)
    if spec.denoise_steps == "comfyui":
        _check_schedule("denoise", spec.steps, spec.denoise)
    h = spec.hires
    if h is not None:
        _check_schedule("hires.denoise", h.steps or spec.steps, h.denoise)
        _check_window("hires.start_step", h.start_step, h.end_step, h.steps or spec.steps, h.sampler or spec.sampler,
                      h.scheduler or spec.scheduler, h.denoise)
    _check_window("start_step", spec.start_step, spec.end_step, spec.steps, spec.sampler, spec.scheduler,
                  spec.denoise, spec.denoise_steps)
