"""The ComfyUI node table: every node class a graph may use, declared once.

Each NodeSpec says what ComfyUI's INPUT_TYPES says of the node (its inputs in order, their types, defaults, bounds and
choices; its outputs) and how it maps onto a job (`job`: the prompt.json fields its inputs carry). Its readers:
`/object_info` (object_info below), the validation with ComfyUI's `node_errors` and both directions of the graph <->
job mapping (orchestrator/http/comfy_graph.py), the UI workflow in a PNG (orchestrator/http/comfy_workflow.py).

Defaults, bounds and choices are ComfyUI's (nodes.py, comfy_extras/) except where this pipeline supports less or
chooses its own: the KSamplers' steps and cfg (prompt.json's bounds and defaults), ModelSamplingAuraFlow's shift (one
value), UNETLoader's weight_dtype (default only), the latent sizes and batch (the model packs', prompt.json's batch),
LatentFromBatch's batch_index (-16384..16384 as the newest ComfyUI's, a negative counting from the end). A bound changed here changes what `/object_info` shows and what validation refuses.
`bench/comfy_node_specs.py --comfyui-src CHECKOUT` lists every input where the table and a ComfyUI checkout differ.

A node's `job` fields are named for where the node sits in a job's graph (`PLACES`): CLIPTextEncode carries `prompt`,
which at the negative place is `negative_prompt` and at a hires fix's second positive `hires.prompt`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from models.images.crop import MAX_CROP_SIDE
from models.images.decode import CHANNELS
from models.lora.plan import MAX_STRENGTH
from models.sampling import latent_ops as lo
from models.sampling.bounds import CFG, STEPS
from models.sampling.sampler import DEFAULT_SCHEDULER, DEFAULT_SHIFT, SAMPLER_NAMES, SCHEDULER_NAMES
from models.sampling.spectrum import SpectrumSettings
from models.sampling.step_cache import NODE_NAMES as CACHE_NODES, CacheSettings
from models.dit.partition import TEXT_TOKENS
from protocol.prompt import MAX_COND_STRENGTH
from orchestrator.engine.prompt_spec import DEFAULT_CFG, DEFAULT_STEPS, MAX_BATCH, MAX_CFG, MAX_SIDE, MAX_STEPS, SEED_LIMIT

CLIP_TYPES = ("stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart", "cosmos",
              "lumina2", "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image", "hunyuan_image", "flux2", "ovis",
              "longcat_image", "cogvideox", "lens", "pixeldit", "ideogram4", "boogu", "krea2", "joyimage", "mage")
ANIMA_CLIP_TYPE = "stable_diffusion"     # what ComfyUI's Anima template gives CLIPLoader; the others are other models'
LINK_TYPES = ("MODEL", "CLIP", "VAE", "CONDITIONING", "LATENT", "IMAGE", "MASK")

# prompt.json fields -> the inputs that carry them (a node's `job`), shared by nodes of one kind
PASS_FIELDS = {"steps": "steps", "cfg": "cfg", "sampler": "sampler_name", "scheduler": "scheduler"}   # + seed
SIZE_FIELDS = {"width": "width", "height": "height", "batch": "batch_size"}
LORA_INPUTS = {"name": "lora_name", "strength": "strength_model", "clip_strength": "strength_clip"}
CACHE_FIELDS = {name: name for name in ("reuse_threshold", "start_percent", "end_percent", "verbose")}


@dataclass(frozen=True)
class InputSpec:
    """One input of a node as ComfyUI's INPUT_TYPES describes it."""

    name: str
    type: str                           # INT | FLOAT | STRING | COMBO | a link type (LINK_TYPES)
    default: Any = None
    options: dict = field(default_factory=dict)     # ComfyUI's input options: min, max, step, multiline, tooltip ...
    choices: tuple | None = None        # COMBO values; None: not checked (a list this server does not know)
    optional: bool = False

    @property
    def is_link(self) -> bool:
        return self.type in LINK_TYPES

    @property
    def is_widget(self) -> bool:
        """A value typed into the node (ComfyUI's `widgets_values` in a UI workflow, in input order)."""
        return not self.is_link


@dataclass(frozen=True)
class NodeSpec:
    """A node class this server accepts: its ComfyUI description and the part of the job it maps to (`role`)."""

    class_type: str
    display_name: str
    category: str
    role: str                           # unet, clip, vae, text, latent, shift, sampler, decode, save
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    output_node: bool = False
    description: str = ""
    job: dict[str, str] = field(default_factory=dict)    # prompt.json field -> the input that carries it (PLACES)
    refusals: dict[str, str] = field(default_factory=dict)   # a field it does not carry -> where its refusal lands

    def input(self, name: str) -> InputSpec | None:
        return next((i for i in self.inputs if i.name == name), None)

    def job_values(self, values: dict) -> dict:
        """graph -> job: the fields this node carries, from its checked input values ({input: value})."""
        return {f: values[name] for f, name in self.job.items() if name in values}

    def graph_inputs(self, fields: dict, **inputs) -> dict:
        """job -> graph: the node's inputs from the fields it carries ({field: value}; others ignored) and the
        `inputs` given as they are (links, values no field holds), in INPUT_TYPES order."""
        given = {**{name: fields[f] for f, name in self.job.items() if f in fields}, **inputs}
        order = [i.name for i in self.inputs if i.name in given]
        return {name: given[name] for name in order + [n for n in given if n not in order]}


@dataclass(frozen=True)
class ModelNames:
    """File names the loaders may name (ComfyUI's COMBO lists); an empty tuple means "not known here, not checked"."""

    unet: tuple[str, ...] = ()
    clip: tuple[str, ...] = ()
    vae: tuple[str, ...] = ()
    lora: tuple[str, ...] = ()          # MODELS/loras/ (models.setup.models_dir.list_loras)
    sizes: tuple[tuple[int, int], ...] = ()   # (width, height) of every model pack, the default first


def _combo(name, choices, default=None, **options) -> InputSpec:
    choices = tuple(choices) if choices else None
    return InputSpec(name, "COMBO", default if default is not None else (choices[0] if choices else None),
                     dict(options), choices)


def _setting(record, name: str, step: float | None = None, **extra) -> InputSpec:
    """A node input for one field of a settings record: its type, default and bounds read from the record (one
    place for them), a bound the value must stay above shown as the first step past it; `extra` options."""
    import msgspec.inspect
    t = next(f.type for f in msgspec.inspect.type_info(record).fields if f.name == name)
    default = getattr(record(), name)
    if isinstance(t, msgspec.inspect.BoolType):
        return InputSpec(name, "BOOLEAN", default, dict(extra))
    lo = t.ge if t.ge is not None else t.gt + (step or 1)
    options = dict(min=lo, max=t.le) | (dict(step=step) if step and isinstance(t, msgspec.inspect.FloatType) else {})
    options |= extra
    return InputSpec(name, "FLOAT" if isinstance(t, msgspec.inspect.FloatType) else "INT", default, options)


def _spectrum_node() -> NodeSpec:
    """Spectrum as ComfyUI offers its step caches: a model patch of its own. A graph without it samples every step
    (ComfyUI's picture); with it, the job forecasts steps as prompt.json's `spectrum` does (its defaults)."""
    steps = {"w": 0.01, "lam": 0.01, "window": 0.1, "flex": 0.01, "stop": 0.01}
    return NodeSpec("AnimaSpectrum", "Spectrum (forecast steps)", "advanced/model", "spectrum",
                    (InputSpec("model", "MODEL"),
                     *(_setting(SpectrumSettings, name, steps.get(name))
                       for name in ("w", "m", "lam", "window", "flex", "warmup", "stop"))),
                    ("MODEL",), ("MODEL",),
                    description="Forecasts steps instead of computing them (fewer model calls, a picture close to "
                                "the full run's; docs/samplers.md). Without this node a graph computes every step.",
                    job={name: name for name in ("w", "m", "lam", "window", "flex", "warmup", "stop")})


def _cache_nodes() -> tuple[NodeSpec, ...]:
    """ComfyUI's EasyCache and LazyCache model patches, their inputs, defaults and bounds (comfy_extras/
    nodes_easycache.py); prompt.json's `cache` (models/sampling/step_cache.py reproduces them)."""
    what = {"easycache": "Reuses each CFG pass's output change when the input barely moved (ComfyUI's EasyCache).",
            "lazycache": "Reuses the CFG-combined prediction's change when the input barely moved (ComfyUI's "
                         "LazyCache)."}
    return tuple(NodeSpec(name, name, "advanced/debug", "cache",
                          (InputSpec("model", "MODEL"),
                           *(_setting(CacheSettings, name, 0.01)
                             for name in ("reuse_threshold", "start_percent", "end_percent", "verbose"))),
                          ("MODEL",), ("MODEL",), description=what[kind], job=CACHE_FIELDS)
                 for kind, name in CACHE_NODES.items())


def _seed_input(name: str) -> InputSpec:
    return InputSpec(name, "INT", 0, dict(min=0, max=SEED_LIMIT - 1, control_after_generate=True))


def _pass_inputs() -> tuple[InputSpec, ...]:
    """The inputs both samplers share, in ComfyUI's order after the seed: steps to latent_image."""
    return (InputSpec("steps", "INT", DEFAULT_STEPS, dict(min=STEPS.lo, max=MAX_STEPS)),
            InputSpec("cfg", "FLOAT", DEFAULT_CFG, dict(min=CFG.lo, max=MAX_CFG, step=0.1, round=0.01)),
            _combo("sampler_name", SAMPLER_NAMES), _combo("scheduler", SCHEDULER_NAMES, DEFAULT_SCHEDULER),
            InputSpec("positive", "CONDITIONING"), InputSpec("negative", "CONDITIONING"),
            InputSpec("latent_image", "LATENT"))


def _sampler_nodes() -> tuple[NodeSpec, ...]:
    """KSampler and KSamplerAdvanced, with the ranges of this pipeline's one sampling pass."""
    return (
        NodeSpec("KSampler", "KSampler", "sampling", "sampler",
                 (InputSpec("model", "MODEL"),
                  _seed_input("seed"), *_pass_inputs(),
                  InputSpec("denoise", "FLOAT", 1.0, dict(min=0.0, max=1.0, step=0.01))),
                 ("LATENT",), ("LATENT",), job={**PASS_FIELDS, "seed": "seed", "denoise": "denoise"}),
        NodeSpec("KSamplerAdvanced", "KSampler (Advanced)", "sampling", "sampler",
                 (InputSpec("model", "MODEL"), _combo("add_noise", ("enable", "disable"), advanced=True),
                  _seed_input("noise_seed"), *_pass_inputs(),
                  InputSpec("start_at_step", "INT", 0, dict(min=0, max=10000, advanced=True)),
                  InputSpec("end_at_step", "INT", 10000, dict(min=0, max=10000, advanced=True)),
                  _combo("return_with_leftover_noise", ("disable", "enable"), advanced=True)),
                 ("LATENT",), ("LATENT",),
                 # a second pass's denoise is the step it starts at (comfy_graph._second_sampler): its refusal there
                 job={**PASS_FIELDS, "seed": "noise_seed", "add_noise": "add_noise", "start_step": "start_at_step",
                      "end_step": "end_at_step", "leftover_noise": "return_with_leftover_noise"},
                 refusals={"denoise": "start_at_step"}),
    )


def image_nodes(images: tuple[str, ...] = ()) -> tuple[NodeSpec, ...]:
    """LoadImage and LoadImageMask (their `image` choices: the input folder's images; () here, where a graph's name is
    checked as an upload name and read at submit, as ComfyUI's VALIDATE_INPUTS accepts "sub/NAME.png [input]"), and
    the nodes that make a latent from an image: VAEEncode and SetLatentNoiseMask (docs/workflows.md)."""
    image = InputSpec("image", "COMBO", None, {"image_upload": True}, tuple(images) or None)
    return (NodeSpec("LoadImage", "Load Image", "image", "image", (image,), ("IMAGE", "MASK"), ("IMAGE", "MASK"),
                     description="An upload (/upload/image) as IMAGE and its MASK = 1 - alpha.",
                     # the job is the upload's size (ComfyUI encodes it as it is): a size refusal lands here
                     job={"init_image": "image"}, refusals={"width": "image", "height": "image"}),
            NodeSpec("LoadImageMask", "Load Image (as Mask)", "mask", "mask",
                     (image, InputSpec("channel", "COMBO", None, {}, CHANNELS)), ("MASK",), ("MASK",),
                     description="One channel of an upload as a MASK (alpha inverted: 1 - alpha).",
                     job={"mask": "image", "mask_channel": "channel"}),
            NodeSpec("VAEEncode", "VAE Encode", "latent", "encode",
                     (InputSpec("pixels", "IMAGE"), InputSpec("vae", "VAE")), ("LATENT",), ("LATENT",),
                     description="The job's init image, encoded by the VAE stage (img2img)."),
            NodeSpec("VAEEncodeForInpaint", "VAE Encode (for Inpainting)", "latent/inpaint", "inpaint_encode",
                     (InputSpec("pixels", "IMAGE"), InputSpec("vae", "VAE"), InputSpec("mask", "MASK"),
                      InputSpec("grow_mask_by", "INT", 6, dict(min=0, max=64, step=1))), ("LATENT",), ("LATENT",),
                     description="Inpaint: the masked pixels grey before encoding, the mask grown as the noise mask.",
                     job={"grow_mask_by": "grow_mask_by"}),
            NodeSpec("SetLatentNoiseMask", "Set Latent Noise Mask", "latent/inpaint", "noise_mask",
                     (InputSpec("samples", "LATENT"), InputSpec("mask", "MASK")), ("LATENT",), ("LATENT",),
                     description="Inpaint: the latent resampled where the mask is 1, kept where it is 0."))


def conditioning_transform_nodes() -> tuple[NodeSpec, ...]:
    """ComfyUI's ConditioningZeroOut and ConditioningAverage (nodes.py) between a CLIPTextEncode and a sampler input:
    prompt.json's `positive` / `negative` entry (`zero_out`, `average`: docs/prompts.md). On Anima both act on the
    Qwen3 states the LLM adapter reads; the adapter still runs with the text's T5 ids."""
    cond = "CONDITIONING"
    return (NodeSpec("ConditioningZeroOut", "Conditioning Zero Out", "model/conditioning/transform", "zero_out",
                     (InputSpec("conditioning", cond),), (cond,), (cond,),
                     description="The text's Qwen3 states zeroed (the LLM adapter still reads the text's T5 ids, so "
                                 "the context is not zero)."),
            NodeSpec("ConditioningAverage", "Conditioning (Average)", "model/conditioning/transform", "average",
                     (InputSpec("conditioning_to", cond), InputSpec("conditioning_from", cond),
                      InputSpec("conditioning_to_strength", "FLOAT", 1.0, dict(min=0.0, max=1.0, step=0.01))),
                     (cond,), (cond,),
                     description="conditioning_to's Qwen3 states x strength + conditioning_from's x (1 - strength) "
                                 "(cut or zero-padded to conditioning_to's length), with conditioning_to's T5 ids.",
                     job={"weight": "conditioning_to_strength"}))


MAX_RESOLUTION = 16384          # ComfyUI's nodes.MAX_RESOLUTION: the upscale nodes' width/height bound
PIXEL_METHODS = ("nearest-exact", "bilinear", "area", "bicubic", "lanczos")     # ImageScale's upscale_method


def hires_batch_nodes() -> tuple[NodeSpec, ...]:
    """ComfyUI's upscale nodes (a hires fix's second pass: LatentUpscale[By] on the latent, ImageScale[By] on the
    decoded pixels) and batch nodes, with nodes.py's exact inputs, choices and ranges (docs/workflows.md)."""
    side = lambda step: dict(min=0, max=MAX_RESOLUTION, step=step)    # noqa: E731
    scale = lambda default: InputSpec("scale_by", "FLOAT", default, dict(min=0.01, max=8.0, step=0.01))  # noqa: E731
    crop = _combo("crop", lo.CROP_METHODS)
    latent, image = InputSpec("samples", "LATENT"), InputSpec("image", "IMAGE")
    to_size = {"method": "upscale_method", "width": "width", "height": "height"}      # hires.method ... (PLACES)
    by = {"method": "upscale_method", "scale": "scale_by"}
    by_size = {"width": "scale_by", "height": "scale_by"}          # the second size, asked by scale_by
    return (
        NodeSpec("LatentUpscale", "Upscale Latent", "latent", "upscale",
                 (latent, _combo("upscale_method", lo.UPSCALE_METHODS), InputSpec("width", "INT", 512, side(8)),
                  InputSpec("height", "INT", 512, side(8)), crop), ("LATENT",), ("LATENT",),
                 description="A hires fix: the first pass's latent upscaled, sampled again by a second KSampler.",
                 job=to_size, refusals={"scale": "width"}),
        NodeSpec("LatentUpscaleBy", "Upscale Latent By", "latent", "upscale",
                 (latent, _combo("upscale_method", lo.UPSCALE_METHODS), scale(1.5)), ("LATENT",), ("LATENT",),
                 description="A hires fix: the first pass's latent upscaled by scale_by (1..4 here).",
                 job=by, refusals=by_size),
        NodeSpec("ImageScale", "Upscale Image", "image/upscaling", "upscale",
                 (image, _combo("upscale_method", PIXEL_METHODS), InputSpec("width", "INT", 512, side(1)),
                  InputSpec("height", "INT", 512, side(1)), crop), ("IMAGE",), ("IMAGE",),
                 description="A pixel hires fix: the first pass decoded, scaled, encoded again (VAEEncode).",
                 job=to_size, refusals={"scale": "width"}),
        NodeSpec("ImageScaleBy", "Upscale Image By", "image/upscaling", "upscale",
                 (image, _combo("upscale_method", PIXEL_METHODS), scale(1.0)), ("IMAGE",), ("IMAGE",),
                 description="A pixel hires fix: the first pass decoded, scaled by scale_by, encoded again.",
                 job=by, refusals=by_size),
        NodeSpec("RepeatLatentBatch", "Repeat Latent Batch", "latent/batch", "batch",
                 (latent, InputSpec("amount", "INT", 1, dict(min=1, max=64))), ("LATENT",), ("LATENT",),
                 description=f"The latent repeated: a batch (at most {MAX_BATCH} images per job).",
                 job={"batch": "amount"}),
        NodeSpec("LatentFromBatch", "Latent From Batch", "latent/batch", "batch",
                 (latent, InputSpec("batch_index", "INT", 0, dict(min=-MAX_RESOLUTION, max=MAX_RESOLUTION)),
                  InputSpec("length", "INT", 1, dict(min=1, max=64))), ("LATENT",), ("LATENT",),
                 description="Images of a batch, keeping their noise (a negative index counts from the end; past "
                             "either end, the first or last image).",
                 job={"batch": "length", "batch_index": "batch_index"}),
    )


def latent_mix_nodes() -> tuple[NodeSpec, ...]:
    """ComfyUI's LatentComposite and LatentBlend (nodes.py; its inputs, defaults and bounds) between an img2img
    KSampler and VAEDecode, mixing its latent with the VAEEncode it started from (prompt.json's `latent_mix`;
    models/sampling/latent_mix.py)."""
    offset = lambda name: InputSpec(name, "INT", 0, dict(min=0, max=MAX_RESOLUTION, step=8))   # noqa: E731
    return (NodeSpec("LatentComposite", "Latent Composite", "model/latent", "latent_mix",
                     (InputSpec("samples_to", "LATENT"), InputSpec("samples_from", "LATENT"), offset("x"),
                      offset("y"), offset("feather")), ("LATENT",), ("LATENT",),
                     description="samples_from pasted onto samples_to at x, y (pixels // 8), its edges feathered. On "
                                 "Anima's [B, 16, 1, h, w] latent ComfyUI's x moves it down and a y of 8 or more "
                                 "pastes nothing; the same here.",
                     job={"x": "x", "y": "y", "feather": "feather"}),
            NodeSpec("LatentBlend", "Latent Blend", "experimental", "latent_mix",
                     (InputSpec("samples1", "LATENT"), InputSpec("samples2", "LATENT"),
                      InputSpec("blend_factor", "FLOAT", 0.5, dict(min=0.0, max=1.0, step=0.01))),
                     ("LATENT",), ("LATENT",), description="samples1 x blend_factor + samples2 x (1 - blend_factor).",
                     job={"factor": "blend_factor"}))


def _crop_node() -> NodeSpec:
    """ComfyUI's ImageCrop (comfy_extras/nodes_images.py; its inputs, defaults and bounds): the decoded image cut, x and
    y clamped to the image, the box cut where the image ends (prompt.json's `crop`)."""
    side = lambda name, default, low: InputSpec(name, "INT", default, dict(min=low, max=MAX_CROP_SIDE, step=1))  # noqa
    return NodeSpec("ImageCrop", "Crop Image (DEPRECATED)", "image/transform", "crop",
                    (InputSpec("image", "IMAGE"), side("width", 512, 1), side("height", 512, 1), side("x", 0, 0),
                     side("y", 0, 0)), ("IMAGE",), ("IMAGE",),
                    description="The final image cut (x and y at most its last column and row; the box ends where "
                                "the image does).", job={k: k for k in ("width", "height", "x", "y")})


def _size_inputs(sizes, default: int) -> tuple[InputSpec, ...]:
    """An empty latent's width, height and batch_size. With the packs' sizes known: the default pack's size, bounded
    by the sizes' extents at the step between them (ComfyUI's INT widgets cannot list pairs: a graph's pair without a
    pack is refused naming the sizes), and the sizes in the tooltip."""
    if not sizes:
        side = [dict(min=16, max=MAX_SIDE, step=16)] * 2
        defaults = (default, default)
    else:
        have = "sizes with a model pack: " + ", ".join(f"{w}x{h}" for w, h in sizes)
        side = []
        for axis in (0, 1):
            vals = sorted({s[axis] for s in sizes})
            step = math.gcd(*(v - vals[0] for v in vals)) or 16
            side.append(dict(min=vals[0], max=vals[-1], step=step, tooltip=have))
        defaults = sizes[0]
    return (InputSpec("width", "INT", defaults[0], side[0]), InputSpec("height", "INT", defaults[1], side[1]),
            InputSpec("batch_size", "INT", 1, dict(min=1, max=MAX_BATCH)))


COND = InputSpec("conditioning", "CONDITIONING")
CONCAT_REFUSAL = (f"ConditioningConcat makes a context longer than {TEXT_TOKENS} text tokens, and the model packs "
                  f"are built for {TEXT_TOKENS} text tokens: combine the prompts with ConditioningCombine (a model pass "
                  "each) or write them as one prompt")


def conditioning_mix_nodes() -> tuple[NodeSpec, ...]:
    """The conditioning nodes between CLIPTextEncode and a KSampler (orchestrator/http/comfy_conditioning.py walks them):
    ConditioningCombine, ConditioningSetTimestepRange, ConditioningSetAreaStrength as nodes.py declares them, and
    ConditioningConcat (known, so that a graph with it is refused saying why, CONCAT_REFUSAL; not in /object_info)."""
    pct, cat = dict(min=0.0, max=1.0, step=0.001), "model/conditioning/transform"
    return (
        NodeSpec("ConditioningCombine", "Conditioning (Combine)", cat, "combine",
                 (InputSpec("conditioning_1", "CONDITIONING"), InputSpec("conditioning_2", "CONDITIONING")),
                 ("CONDITIONING",), ("CONDITIONING",),
                 description="Both conditionings, each its own model pass per step, their outputs averaged."),
        NodeSpec("ConditioningSetTimestepRange", "ConditioningSetTimestepRange", cat, "cond_range", (COND, InputSpec("start", "FLOAT", 0.0, dict(pct)),
                                InputSpec("end", "FLOAT", 1.0, dict(pct))), ("CONDITIONING",), ("CONDITIONING",),
                 description="The conditioning used only between start and end (fractions of the schedule).",
                 job={"start": "start", "end": "end"}),
        NodeSpec("ConditioningSetAreaStrength", "Conditioning (Set Area Strength)", cat, "cond_strength",
                 (COND, InputSpec("strength", "FLOAT", 1.0, dict(min=0.0, max=MAX_COND_STRENGTH, step=0.01))),
                 ("CONDITIONING",), ("CONDITIONING",),
                 description="The conditioning's weight when its model pass is averaged with others'.",
                 job={"strength": "strength"}),
        NodeSpec("ConditioningConcat", "Conditioning (Concat)", cat, "concat",
                 (InputSpec("conditioning_to", "CONDITIONING"), InputSpec("conditioning_from", "CONDITIONING")),
                 ("CONDITIONING",), ("CONDITIONING",), description=f"Refused here: {CONCAT_REFUSAL}."),
    )


def node_table(names: ModelNames = ModelNames()) -> dict[str, NodeSpec]:
    """The node classes `POST /prompt` accepts, with the ranges this pipeline supports (what `/object_info` shows)."""
    strength = dict(min=-MAX_STRENGTH, max=MAX_STRENGTH, step=0.01)
    return {n.class_type: n for n in (
        NodeSpec("UNETLoader", "Load Diffusion Model", "advanced/loaders", "unet",
                 (_combo("unet_name", names.unet), _combo("weight_dtype", ("default",), advanced=True)),
                 ("MODEL",), ("MODEL",), description="The Anima DiT this server runs (one model pack per size)."),
        NodeSpec("CLIPLoader", "Load CLIP", "advanced/loaders", "clip",
                 (_combo("clip_name", names.clip), _combo("type", CLIP_TYPES),
                  InputSpec("device", "COMBO", "default", {"advanced": True}, ("default", "cpu"), optional=True)),
                 ("CLIP",), ("CLIP",), description="The Qwen3 text encoder of the models folder."),
        NodeSpec("VAELoader", "Load VAE", "loaders", "vae", (_combo("vae_name", names.vae),), ("VAE",), ("VAE",)),
        NodeSpec("LoraLoader", "Load LoRA (Model and CLIP)", "model/loaders", "lora",
                 (InputSpec("model", "MODEL"), InputSpec("clip", "CLIP"), _combo("lora_name", names.lora),
                  InputSpec("strength_model", "FLOAT", 1.0, dict(strength)),
                  InputSpec("strength_clip", "FLOAT", 1.0, dict(strength))),
                 ("MODEL", "CLIP"), ("MODEL", "CLIP"),
                 description="A LoRA of MODELS/loras/ on the DiT and the text encoder (applied per job).",
                 job=dict(LORA_INPUTS)),
        NodeSpec("LoraLoaderModelOnly", "Load LoRA", "model/loaders", "lora",
                 (InputSpec("model", "MODEL"), _combo("lora_name", names.lora),
                  InputSpec("strength_model", "FLOAT", 1.0, dict(strength))),
                 ("MODEL",), ("MODEL",), description="A LoRA of MODELS/loras/ on the DiT (applied per job).",
                 job={k: v for k, v in LORA_INPUTS.items() if k != "clip_strength"}),
        NodeSpec("CLIPTextEncode", "CLIP Text Encode (Prompt)", "conditioning", "text",
                 (InputSpec("text", "STRING", "", {"multiline": True, "dynamicPrompts": True}),
                  InputSpec("clip", "CLIP")), ("CONDITIONING",), ("CONDITIONING",), job={"prompt": "text"}),
        NodeSpec("EmptyLatentImage", "Empty Latent Image", "latent", "latent",
                 _size_inputs(names.sizes, 512), ("LATENT",), ("LATENT",),
                 description="The image size: one with a model pack (GET /anima/info lists them).", job=SIZE_FIELDS),
        NodeSpec("EmptySD3LatentImage", "EmptySD3LatentImage", "latent/sd3", "latent",
                 _size_inputs(names.sizes, 1024), ("LATENT",), ("LATENT",),
                 description="The image size: one with a model pack (GET /anima/info lists them).", job=SIZE_FIELDS),
        NodeSpec("ModelSamplingAuraFlow", "ModelSamplingAuraFlow", "advanced/model", "shift",
                 (InputSpec("model", "MODEL"),
                  InputSpec("shift", "FLOAT", DEFAULT_SHIFT, dict(min=DEFAULT_SHIFT, max=DEFAULT_SHIFT, step=0.01))),
                 ("MODEL",), ("MODEL",), description=f"Optional; the pipeline samples with shift {DEFAULT_SHIFT}."),
        _spectrum_node(),
        *_cache_nodes(),
        *_sampler_nodes(),
        *conditioning_transform_nodes(),
        *image_nodes(),
        *hires_batch_nodes(),
        *conditioning_mix_nodes(),
        *latent_mix_nodes(),
        NodeSpec("VAEDecode", "VAE Decode", "latent", "decode",
                 (InputSpec("samples", "LATENT"), InputSpec("vae", "VAE")), ("IMAGE",), ("IMAGE",)),
        _crop_node(),
        NodeSpec("SaveImage", "Save Image", "image", "save",
                 (InputSpec("images", "IMAGE"), InputSpec("filename_prefix", "STRING", "ComfyUI")),
                 output_node=True, description="The job's PNG (GET /view?filename=image.png&subfolder=JOB&type=output)."),
        NodeSpec("PreviewImage", "Preview Image", "image", "save", (InputSpec("images", "IMAGE"),), output_node=True,
                 description="The job's PNG, as SaveImage shows it (the board keeps every image in the job folder)."),
    )}


REFUSED_ROLES = ("concat",)     # in the table for a clear refusal on its node, not offered by /object_info


def object_info(table: dict[str, NodeSpec]) -> dict:
    """`GET /object_info`: every accepted node class in ComfyUI's shape (COMBO inputs as [[choices], {options}])."""
    out = {}
    for n in table.values():
        if n.role in REFUSED_ROLES:
            continue
        groups: dict[str, dict] = {"required": {}, "optional": {}}
        for i in n.inputs:
            opts = dict(i.options)
            if i.default is not None and not i.is_link:
                opts["default"] = i.default
            kind = list(i.choices or ()) if i.type == "COMBO" else i.type
            groups["optional" if i.optional else "required"][i.name] = [kind, opts] if opts else [kind]
        groups = {k: v for k, v in groups.items() if v or k == "required"}
        out[n.class_type] = {
            "input": groups, "input_order": {k: list(v) for k, v in groups.items()},
            "output": list(n.outputs), "output_is_list": [False] * len(n.outputs), "output_name": list(n.output_names),
            "name": n.class_type, "display_name": n.display_name, "description": n.description,
            "python_module": "nodes", "category": n.category, "output_node": n.output_node}
    return out


# ---------------------------------------------------------------- where a node sits in a job

# a job graph's place (comfy_graph.GraphJob.nodes' roles) -> the prefix of the fields its node carries there, in the
# order a refused field is looked for (an EmptyLatentImage's batch before a RepeatLatentBatch's)
PLACES = {"positive": "", "negative": "negative_", "sampler": "", "latent": "", "image": "", "mask": "",
          "encode": "", "spectrum": "spectrum.", "cache": "cache.", "upscale": "hires.", "hires_sampler": "hires.",
          "hires_positive": "hires.", "hires_negative": "hires.negative_", "crop": "crop.",
          "latent_mix": "latent_mix.", "init_mix": "init_mix.", "mix_image": "init_mix.",
          # a sampler input's ConditioningAverage and the CLIPTextEncode it averages with (conditioning_from)
          "positive_average": "positive[0].average.", "negative_average": "negative[0].average.",
          "positive_from": "positive[0].average.", "negative_from": "negative[0].average."}
NUMBERED_PLACES = {"lora": "loras[{}].", "batch": ""}        # lora0, lora1 ...; batch0 ...


def place_prefix(place: str) -> str | None:
    """The prefix of the fields a node carries at `place`; None for a place that carries none (loaders, decode)."""
    if place in PLACES:
        return PLACES[place]
    kind = place.rstrip("0123456789")
    if kind in NUMBERED_PLACES and place[len(kind):]:
        return NUMBERED_PLACES[kind].format(place[len(kind):])
    return None


def carried(place: str, node: NodeSpec) -> dict[str, str]:
    """{prompt.json field: input} of a node at `place` in a job's graph, with the fields whose refusals land on it.
    LoadImage at the mask place is the mask (its MASK output: 1 - alpha of the same upload)."""
    prefix = place_prefix(place)
    if prefix is None:
        return {}
    fields = {**node.refusals, **node.job}
    if place.endswith("_from"):                 # conditioning_from's CLIPTextEncode: the average's text
        fields = {"text": "text"}
    if place == "mask" and "init_image" in fields:
        fields = {"mask": fields["init_image"], "mask_channel": fields["init_image"]}
    if place == "mix_image" and "init_image" in fields:      # init_mix's other LoadImage: init_mix.image
        fields = {"image": fields["init_image"]}
    return {prefix + f: name for f, name in fields.items()}


def places_in_order(nodes: dict[str, str]) -> list[tuple[str, str]]:
    """A job's (place, node id) pairs in PLACES' order, the numbered places after them."""
    rank = {p: k for k, p in enumerate(PLACES)}
    return sorted(nodes.items(), key=lambda kv: rank.get(kv[0], len(rank)))
