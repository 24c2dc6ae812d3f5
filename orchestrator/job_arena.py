"""The layout of one job's arena: the contexts and the latent (the orchestrator's slots), the scheduler's scratch."""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.packs import PackInfo

ARENA_MARGIN_BYTES = 1 << 20      # slack on top of the computed layout (alignment, small extras)


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
