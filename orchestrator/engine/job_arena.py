"""One job's arena: the contexts and the latent (the orchestrator's slots), then the scheduler's scratch region, sized
by the scratch plan the scheduler carves it with (models/packs/scratch.py)."""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from models.records.manifest import MANIFEST
from models.packs.pack import Pack, load_pack
from models.packs.sharded import shard_count
from models.packs.scratch import scratch_plan
from protocol import messages as m
from protocol.arena import ALIGN_BYTES, Arena
from protocol.tensors import TensorDesc


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class ArenaPlan:
    """Byte sizes of the job arena's parts: contexts and latent (owned here), and the scheduler's scratch region."""

    context_bytes: int        # one context [S, Dc] f32
    latent_bytes: int         # [C, H/8, W/8] f32
    scratch_bytes: int        # branch inputs/outputs for every CFG pass, carved by the scheduler
    image_bytes: int = 0      # img2img: the init image [3, H, W] f32 (then an init latent and a noise mask too)

    @property
    def total(self) -> int:
        """Every slot at an aligned offset (protocol.arena.SlotAllocator), the scratch region starting aligned."""
        latents = 3 if self.image_bytes else 1
        return 2 * _aligned(self.context_bytes) + latents * _aligned(self.latent_bytes) + \
            _aligned(self.image_bytes) + self.scratch_bytes


def arena_plan(pack, img2img: bool = False) -> ArenaPlan:
    """Sizes for a models.packs.pack.Pack (its manifest suffices: no weights are read); `img2img`: with the init
    image, init latent and noise mask slots."""
    g, c = pack.geometry, pack.config
    scratch = scratch_plan(c, g, pack.dtype, len(m.PASS_NAMES), shard_count(pack.manifest)).nbytes(ALIGN_BYTES)
    return ArenaPlan(context_bytes=g.text_tokens * c.context_dim * 4,
                     latent_bytes=c.latent_channels * g.latent_h * g.latent_w * 4, scratch_bytes=scratch,
                     image_bytes=3 * g.latent_h * g.latent_w * 64 * 4 if img2img else 0)


@dataclass(frozen=True)
class JobArena:
    arena: Arena
    cond: TensorDesc          # [S, Dc] f32
    uncond: TensorDesc        # [S, Dc] f32
    latent: TensorDesc        # [C, H/8, W/8] f32
    scratch: m.Region         # for DENOISE.scratch
    image: TensorDesc | None = None         # img2img: [3, H, W] f32 in [-1, 1], VAE_ENCODE's input
    init_latent: TensorDesc | None = None   # [C, H/8, W/8] f32, VAE_ENCODE's output and DENOISE's init_latent
    noise_mask: TensorDesc | None = None    # [C, H/8, W/8] f32 in [0, 1], DENOISE's noise_mask


# packs read for their arenas (manifest only, as load_pack(check=False) checks it), kept by folder and the manifest's
# stat: the arena's sizes come from the manifest alone, and reading it again (every member's path resolved, the host
# header read) took ~0.1 s of the daemon per job. The stages load their pack themselves, files and all.
_ARENA_PACKS: OrderedDict = OrderedDict()
ARENA_PACKS_KEPT = 8


def arena_pack(pack_dir) -> Pack:
    """The pack of `pack_dir` for an arena: read again when its manifest changed (PackError as load_pack's)."""
    try:
        st = os.stat(Path(pack_dir) / MANIFEST)
    except OSError:
        return load_pack(pack_dir, check=False)           # gone: load_pack's error names it
    key = (str(pack_dir), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    pack = _ARENA_PACKS.get(key)
    if pack is None:
        pack = _ARENA_PACKS[key] = load_pack(pack_dir, check=False)
        while len(_ARENA_PACKS) > ARENA_PACKS_KEPT:
            _ARENA_PACKS.popitem(last=False)
    return pack


def create_job_arena(name: str, pack, img2img: bool = False) -> JobArena:
    """The segment (ArenaError when /dev/shm has no room) with the orchestrator's slots carved and the rest handed
    over as the scratch region; `img2img`: the init image, init latent and noise mask slots too."""
    arena = Arena.create(name, arena_plan(pack, img2img).total)
    g, c = pack.geometry, pack.config
    ctx_shape, lat_shape = (g.text_tokens, c.context_dim), (c.latent_channels, g.latent_h, g.latent_w)
    try:
        cond, uncond = arena.alloc("cond", "f32", ctx_shape), arena.alloc("uncond", "f32", ctx_shape)
        latent = arena.alloc("latent", "f32", lat_shape)
        extra = {}
        if img2img:
            extra = {"image": arena.alloc("image", "f32", (3, g.latent_h * 8, g.latent_w * 8)),
                     "init_latent": arena.alloc("init_latent", "f32", lat_shape),
                     "noise_mask": arena.alloc("noise_mask", "f32", lat_shape)}
    except BaseException:
        arena.close()                     # the owner's close unlinks: no segment left behind
        raise
    start, nbytes = arena.slots.remaining()
    return JobArena(arena, cond, uncond, latent, m.Region(offset=start, nbytes=nbytes), **extra)
