"""The orchestrator's view of the pipeline: settings from the config, the pack's geometry, the job arena's layout."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.runfolder import RunFolder
from stages.settings import OrchestratorSettings  # noqa: F401 - [stage.orchestrator]: the config schema's record

ARENA_MARGIN_BYTES = 1 << 20      # slack on top of the computed layout (alignment, small extras)


@dataclass(frozen=True)
class PackInfo:
    """What the orchestrator needs from a pack's manifest (no weights are read)."""

    dir: Path
    width: int                # image pixels
    height: int
    latent_channels: int      # C = 16
    latent_h: int             # H / 8
    latent_w: int
    tokens: int               # L image tokens
    text_tokens: int          # S: 512, or more for a long-context pack
    context_dim: int          # Dc
    hidden: int               # D
    head_dim: int             # hd
    blocks: int               # DiT blocks (3 branch calls each per computed step)
    io_dtype: str             # "f16" | "f32"
    source_sha256: str
    source_name: str

    @property
    def size(self) -> tuple[int, int]:
        return (self.width, self.height)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return (self.latent_channels, self.latent_h, self.latent_w)

    @property
    def context_shape(self) -> tuple[int, int]:
        return (self.text_tokens, self.context_dim)


def read_pack(pack_dir: str | Path) -> PackInfo:
    """Manifest only (load_pack without hashing the files; the scheduler checks them when it loads the pack)."""
    from models.pack import load_pack
    p = load_pack(pack_dir, check=False)
    g, c = p.geometry, p.config
    return PackInfo(dir=Path(pack_dir).resolve(), width=g.width, height=g.height, latent_channels=c.latent_channels,
                    latent_h=g.latent_h, latent_w=g.latent_w, tokens=g.tokens, text_tokens=g.text_tokens,
                    context_dim=c.context_dim, hidden=c.width, head_dim=c.head_dim, blocks=c.blocks, io_dtype=p.io_dtype,
                    source_sha256=str(p.source.get("sha256", "")), source_name=str(p.source.get("name", "")))


def read_packs(pack_dirs) -> dict[tuple[int, int], PackInfo]:
    """{(width, height): PackInfo} of every pack, the default (first) first; PackError (a ValueError) when two packs
    serve one size (a job picks its pack by size) or a manifest is unreadable."""
    from models.pack import PackError
    packs: dict[tuple[int, int], PackInfo] = {}
    for d in pack_dirs:
        try:
            info = read_pack(d)
        except (PackError, OSError) as e:
            raise PackError(f"model pack {d}: {e}") from None
        if info.size in packs:
            raise PackError(f"model packs {packs[info.size].dir} and {info.dir} are both {info.width}x{info.height}; "
                             "keep one pack per image size")
        packs[info.size] = info
    return packs


def pack_sizes(rf: RunFolder) -> list[tuple[int, int]] | None:
    """The (width, height) of every pack in RUN/pipeline.toml, the default first; None without a config or packs."""
    if not rf.pipeline_toml.exists():
        return None
    from stages.config import load_config
    cfg = load_config(rf.pipeline_toml)
    return list(read_packs(cfg.packs)) or None


@dataclass(frozen=True)
class ArenaPlan:
    """Byte sizes of the job arena's parts: contexts and latent (owned here), and the scheduler's scratch region."""

    context_bytes: int        # one context [S, Dc] f32
    latent_bytes: int         # [C, H/8, W/8] f32
    scratch_bytes: int        # branch inputs/outputs for both CFG passes, carved by the scheduler

    @property
    def total(self) -> int:
        return 2 * self.context_bytes + self.latent_bytes + self.scratch_bytes + ARENA_MARGIN_BYTES


def arena_plan(pack: PackInfo) -> ArenaPlan:
    """Sizes from the pack's geometry. The scratch region holds, in the pack's io dtype, per CFG pass: xn and y
    [L, D], the pass's context [S, Dc] and its mask [S]; once: RoPE cos and sin [L, hd/2]; plus an f32 copy of x
    [L, D] for slack."""
    io = 2 if pack.io_dtype == "f16" else 4
    L, D, S, Dc, hd = pack.tokens, pack.hidden, pack.text_tokens, pack.context_dim, pack.head_dim
    per_pass = (2 * L * D + S * Dc + S) * io
    scratch = 2 * per_pass + 2 * L * (hd // 2) * io + L * D * 4
    scratch += 64 * 16                           # alignment of ~16 slots
    return ArenaPlan(context_bytes=S * Dc * 4,
                     latent_bytes=pack.latent_channels * pack.latent_h * pack.latent_w * 4,
                     scratch_bytes=scratch)


def settings_from_config(cfg) -> OrchestratorSettings:
    return cfg.settings("orchestrator")
