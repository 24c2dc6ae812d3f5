"""VAE config from tensor shapes, expected shapes, and the original (Wan 2.1) <-> diffusers key mapping."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

# Wan 2.1 / Qwen-Image structure constants that the checkpoint cannot tell (they describe the encoder's temporal
# downsampling, which the single-image decoder never runs): used only to write synthetic files.
DEFAULT_DIM_MULT = (1, 2, 4, 4)
DEFAULT_NUM_RES_BLOCKS = 2                  # encoder blocks per stage; the decoder has one more per stage
DEFAULT_TEMPORAL_DOWN = (False, True, True)  # per encoder downsample; the decoder's upsamples are the reverse
IMAGE_CHANNELS = 3

# Original-layout names of a residual block's tensors, and their diffusers names.
RES_ORIG_TO_DIFF = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight",
                    "residual.2.bias": "conv1.bias", "residual.3.gamma": "norm2.gamma",
                    "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
                    "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
RES_DIFF_TO_ORIG = {v: k for k, v in RES_ORIG_TO_DIFF.items()}
MIDDLE_ORIG_TO_DIFF = {"0": "resnets.0", "1": "attentions.0", "2": "resnets.1"}
MIDDLE_DIFF_TO_ORIG = {v: k for k, v in MIDDLE_ORIG_TO_DIFF.items()}
TOP_ORIG_TO_DIFF = {"conv1": "quant_conv", "conv2": "post_quant_conv"}
TOP_DIFF_TO_ORIG = {v: k for k, v in TOP_ORIG_TO_DIFF.items()}
SIDE_ORIG_TO_DIFF = {"conv1": "conv_in", "head.0": "norm_out", "head.2": "conv_out"}
SIDE_DIFF_TO_ORIG = {v: k for k, v in SIDE_ORIG_TO_DIFF.items()}


class VAEKeyError(ValueError):
    """The file's tensors do not describe a Qwen-Image / Wan 2.1 VAE decoder; the message names the key."""


@dataclass(frozen=True)
class VAEConfig:
    z_dim: int                  # latent channels (16)
    base_dim: int               # channels of the last stage, the head's input (96)
    dim_mult: tuple             # stage multipliers, encoder order (1, 2, 4, 4)
    num_res_blocks: int         # encoder residual blocks per stage (2); decoder stages have num_res_blocks + 1
    out_channels: int = IMAGE_CHANNELS

    @property
    def mid_dim(self) -> int:
        return self.base_dim * self.dim_mult[-1]                   # 384

    @property
    def decoder_dims(self) -> list:
        """Channels entering the decoder stages, then each stage's output: [384, 384, 384, 192, 96]."""
        return [self.base_dim * m for m in (self.dim_mult[-1],) + tuple(self.dim_mult[::-1])]

    @property
    def per_stage(self) -> int:
        """Layers per decoder stage in the flat `decoder.upsamples` list: residual blocks + one upsample."""
        return self.num_res_blocks + 2

    @property
    def upscale(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)                        # 8

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dim_mult"] = list(self.dim_mult)
        return d


# ---------------------------------------------------------------------------------------------------------------
# Layer plan and expected shapes (original layout)

def decoder_plan(cfg: VAEConfig) -> list:
    """The flat `decoder.upsamples` list: ("res", cin, cout) or ("up", dim, dim // 2), in order."""
    dims, plan = cfg.decoder_dims, []
    n = len(dims) - 1
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        if i > 0:
            cin //= 2                                               # the previous upsample halved the channels
        for _ in range(cfg.num_res_blocks + 1):
            plan.append(("res", cin, cout))
            cin = cout
        if i != n - 1:
            plan.append(("up", cout, cout // 2))
    return plan


def _res_shapes(p: str, cin: int, cout: int, out: dict) -> None:
    out[p + "residual.0.gamma"] = (cin, 1, 1, 1)
    out[p + "residual.2.weight"] = (cout, cin, 3, 3, 3)
    out[p + "residual.2.bias"] = (cout,)
    out[p + "residual.3.gamma"] = (cout, 1, 1, 1)
    out[p + "residual.6.weight"] = (cout, cout, 3, 3, 3)
    out[p + "residual.6.bias"] = (cout,)
    if cin != cout:
        out[p + "shortcut.weight"] = (cout, cin, 1, 1, 1)
        out[p + "shortcut.bias"] = (cout,)


def _middle_shapes(p: str, c: int, out: dict) -> None:
    _res_shapes(p + "0.", c, c, out)
    out[p + "1.norm.gamma"] = (c, 1, 1)
    out[p + "1.to_qkv.weight"] = (3 * c, c, 1, 1)
    out[p + "1.to_qkv.bias"] = (3 * c,)
    out[p + "1.proj.weight"] = (c, c, 1, 1)
    out[p + "1.proj.bias"] = (c,)
    _res_shapes(p + "2.", c, c, out)


def decoder_shapes(cfg: VAEConfig, temporal_up=None) -> dict:
    """{original key: shape} for `conv2` and the decoder; `time_conv` keys only where temporal_up says so."""
    z, out = cfg.z_dim, {}
    out["conv2.weight"] = (z, z, 1, 1, 1)
    out["conv2.bias"] = (z,)
    out["decoder.conv1.weight"] = (cfg.mid_dim, z, 3, 3, 3)
    out["decoder.conv1.bias"] = (cfg.mid_dim,)
    _middle_shapes("decoder.middle.", cfg.mid_dim, out)
    ups = 0
    for idx, (kind, a, b) in enumerate(decoder_plan(cfg)):
        p = f"decoder.upsamples.{idx}."
        if kind == "res":
            _res_shapes(p, a, b, out)
            continue
        out[p + "resample.1.weight"] = (b, a, 3, 3)
        out[p + "resample.1.bias"] = (b,)
        if temporal_up is not None and temporal_up[ups]:
            out[p + "time_conv.weight"] = (a * 2, a, 3, 1, 1)
            out[p + "time_conv.bias"] = (a * 2,)
        ups += 1
    out["decoder.head.0.gamma"] = (cfg.base_dim, 1, 1, 1)
    out["decoder.head.2.weight"] = (cfg.out_channels, cfg.base_dim, 3, 3, 3)
    out["decoder.head.2.bias"] = (cfg.out_channels,)
    return out


def encoder_plan(cfg: VAEConfig) -> list:
    """The flat `encoder.downsamples` list: ("res", cin, cout) or ("down", dim, dim), in order (stage i of the
    encoder ends with a downsample except the last; the downsample is ZeroPad2d(0, 1, 0, 1) + a 3x3 stride-2 conv)."""
    dims = [cfg.base_dim * m for m in (1,) + tuple(cfg.dim_mult)]
    plan, n = [], len(dims) - 1
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        for _ in range(cfg.num_res_blocks):
            plan.append(("res", cin, cout))
            cin = cout
        if i != n - 1:
            plan.append(("down", cout, cout))
    return plan


def encoder_shapes(cfg: VAEConfig, temporal_down=DEFAULT_TEMPORAL_DOWN) -> dict:
    """{original key: shape} for the encoder half and `conv1` (the quant conv: mean and logvar, 2 z_dim out);
    `time_conv` keys only where temporal_down says so (None: none, as the single-image encoder reads them)."""
    c0, z2 = cfg.base_dim, 2 * cfg.z_dim
    out = {"encoder.conv1.weight": (c0, cfg.out_channels, 3, 3, 3), "encoder.conv1.bias": (c0,)}
    downs = 0
    for idx, (kind, cin, cout) in enumerate(encoder_plan(cfg)):
        p = f"encoder.downsamples.{idx}."
        if kind == "res":
            _res_shapes(p, cin, cout, out)
            continue
        out[p + "resample.1.weight"] = (cout, cout, 3, 3)
        out[p + "resample.1.bias"] = (cout,)
        if temporal_down is not None and temporal_down[downs]:
            out[p + "time_conv.weight"] = (cout, cout, 3, 1, 1)
            out[p + "time_conv.bias"] = (cout,)
        downs += 1
    _middle_shapes("encoder.middle.", cfg.mid_dim, out)
    out["encoder.head.0.gamma"] = (cfg.mid_dim, 1, 1, 1)
    out["encoder.head.2.weight"] = (z2, cfg.mid_dim, 3, 3, 3)
    out["encoder.head.2.bias"] = (z2,)
    out["conv1.weight"] = (z2, z2, 1, 1, 1)
    out["conv1.bias"] = (z2,)
    return out


def full_shapes(cfg: VAEConfig, temporal_down=DEFAULT_TEMPORAL_DOWN) -> dict:
    """Every tensor of a real `qwen_image_vae.safetensors` (original layout): encoder, conv1, conv2, decoder."""
    out = encoder_shapes(cfg, temporal_down)
    out.update(decoder_shapes(cfg, tuple(temporal_down[::-1])))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Config detection (original-layout names)

def _need(shapes: dict, key: str, ndim: int = None) -> tuple:
    if key not in shapes:
        raise VAEKeyError(f"missing tensor {key!r}")
    s = tuple(shapes[key])
    if ndim is not None and len(s) != ndim:
        raise VAEKeyError(f"tensor {key!r} has shape {list(s)}, expected {ndim} dimensions")
    return s


def detect_config(shapes: dict) -> VAEConfig:
    """VAEConfig from original-layout decoder shapes: z from `conv2`, stages from `decoder.upsamples.N`."""
    z = _need(shapes, "conv2.weight", 5)[0]
    head = _need(shapes, "decoder.head.2.weight", 5)
    base, out_ch = head[1], head[0]
    rx = re.compile(r"^decoder\.upsamples\.(\d+)\.(residual|resample)\.")
    kinds = {}
    for k in shapes:
        m = rx.match(k)
        if m:
            kinds[int(m.group(1))] = m.group(2)
    if not kinds:
        raise VAEKeyError("missing tensors decoder.upsamples.N.*: no decoder stages")
    n_layers = max(kinds) + 1
    first_up = next((i for i in range(n_layers) if kinds.get(i) == "resample"), n_layers)
    per_stage = first_up + 1                                       # residual blocks + the upsample
    if first_up < 1 or (n_layers + 1) % per_stage:
        raise VAEKeyError(f"decoder.upsamples has {n_layers} layers with the first upsample at {first_up}: "
                          "not a Wan 2.1 decoder layout")
    stages = (n_layers + 1) // per_stage
    mult = []
    for s in reversed(range(stages)):                              # encoder order: smallest first
        cout = _need(shapes, f"decoder.upsamples.{s * per_stage}.residual.6.weight", 5)[0]
        if cout % base:
            raise VAEKeyError(f"decoder.upsamples.{s * per_stage} has {cout} channels, not a multiple of {base}")
        mult.append(cout // base)
    return VAEConfig(z_dim=z, base_dim=base, dim_mult=tuple(mult), num_res_blocks=first_up - 1, out_channels=out_ch)


def check_decoder_shapes(cfg: VAEConfig, shapes: dict, want_shapes: dict = None) -> None:
    """Every decoder tensor (or every one of `want_shapes`) present with the shape the config implies (time_conv
    optional and unchecked)."""
    for key, want in (want_shapes if want_shapes is not None else decoder_shapes(cfg)).items():
        got = _need(shapes, key)
        if tuple(got) != tuple(want):
            raise VAEKeyError(f"tensor {key!r} has shape {list(got)}, expected {list(want)} for config {cfg.to_dict()}")


# ---------------------------------------------------------------------------------------------------------------
# Key mapping between the two layouts

def to_diffusers(key: str, per_stage: int) -> str:
    """Original (Wan 2.1) key -> diffusers `AutoencoderKLQwenImage` key; `per_stage` = CONFIG.per_stage."""
    parts = key.split(".")
    if parts[0] in TOP_ORIG_TO_DIFF:
        return TOP_ORIG_TO_DIFF[parts[0]] + "." + ".".join(parts[1:])
    side, rest = parts[0], ".".join(parts[1:])
    if side not in ("encoder", "decoder"):
        raise VAEKeyError(f"not a VAE key: {key!r}")
    for o, d in SIDE_ORIG_TO_DIFF.items():
        if rest.startswith(o + "."):
            return f"{side}.{d}.{rest[len(o) + 1:]}"
    m = re.match(r"^middle\.(\d)\.(.+)$", rest)
    if m:
        leaf = m.group(2)
        return f"{side}.mid_block.{MIDDLE_ORIG_TO_DIFF[m.group(1)]}.{RES_ORIG_TO_DIFF.get(leaf, leaf)}"
    m = re.match(r"^(downsamples|upsamples)\.(\d+)\.(.+)$", rest)
    if not m:
        raise VAEKeyError(f"not a VAE key: {key!r}")
    idx, leaf = int(m.group(2)), m.group(3)
    leaf = RES_ORIG_TO_DIFF.get(leaf, leaf)
    if m.group(1) == "downsamples":
        return f"{side}.down_blocks.{idx}.{leaf}"
    stage, j = divmod(idx, per_stage)
    if j == per_stage - 1:
        return f"{side}.up_blocks.{stage}.upsamplers.0.{leaf}"
    return f"{side}.up_blocks.{stage}.resnets.{j}.{leaf}"


def diffusers_per_stage(keys) -> int:
    """Layers per decoder stage in a diffusers file: resnets in `up_blocks.0` + 1."""
    rx = re.compile(r"^decoder\.up_blocks\.0\.resnets\.(\d+)\.")
    js = {int(m.group(1)) for k in keys if (m := rx.match(k))}
    if not js:
        raise VAEKeyError("missing tensors decoder.up_blocks.0.resnets.N.*: no decoder stages")
    return max(js) + 2


def to_original(key: str, per_stage: int) -> str:
    """diffusers `AutoencoderKLQwenImage` key -> original (Wan 2.1) key."""
    parts = key.split(".")
    if parts[0] in TOP_DIFF_TO_ORIG:
        return TOP_DIFF_TO_ORIG[parts[0]] + "." + ".".join(parts[1:])
    side, rest = parts[0], ".".join(parts[1:])
    if side not in ("encoder", "decoder"):
        raise VAEKeyError(f"not a diffusers VAE key: {key!r}")
    for d, o in SIDE_DIFF_TO_ORIG.items():
        if rest.startswith(d + "."):
            return f"{side}.{o}.{rest[len(d) + 1:]}"
    m = re.match(r"^mid_block\.(resnets\.\d|attentions\.0)\.(.+)$", rest)
    if m and m.group(1) in MIDDLE_DIFF_TO_ORIG:
        leaf = m.group(2)
        return f"{side}.middle.{MIDDLE_DIFF_TO_ORIG[m.group(1)]}.{RES_DIFF_TO_ORIG.get(leaf, leaf)}"
    m = re.match(r"^down_blocks\.(\d+)\.(.+)$", rest)
    if m:
        leaf = m.group(2)
        return f"{side}.downsamples.{m.group(1)}.{RES_DIFF_TO_ORIG.get(leaf, leaf)}"
    m = re.match(r"^up_blocks\.(\d+)\.(resnets\.(\d+)|upsamplers\.0)\.(.+)$", rest)
    if not m:
        raise VAEKeyError(f"not a diffusers VAE key: {key!r}")
    stage, leaf = int(m.group(1)), m.group(4)
    j = int(m.group(3)) if m.group(3) is not None else per_stage - 1
    return f"{side}.upsamples.{stage * per_stage + j}.{RES_DIFF_TO_ORIG.get(leaf, leaf)}"
