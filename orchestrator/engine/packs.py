"""The model packs as the daemon sees them: each pack's geometry from its manifest (no weights read), one per size."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
    lora_rank: int = 0        # R of a LoRA-ready pack (its branches take LoRAs per job); 0: a plain pack
    int8: tuple = ()          # a W8A8 pack's INT8 layers (fc1, qkv, q ...), calibrated without LoRAs; () for FP16
    sampling: dict | None = None   # the model's settings for jobs that set none (models/packs/sampling.py)

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
    from models.records.manifest import quant_info, sampling_info
    from models.packs.pack import load_pack
    p = load_pack(pack_dir, check=False)
    q = quant_info(p.manifest)
    g, c = p.geometry, p.config
    return PackInfo(dir=Path(pack_dir).resolve(), width=g.width, height=g.height, latent_channels=c.latent_channels,
                    latent_h=g.latent_h, latent_w=g.latent_w, tokens=g.tokens, text_tokens=g.text_tokens,
                    context_dim=c.context_dim, hidden=c.width, head_dim=c.head_dim, blocks=c.blocks, io_dtype=p.io_dtype,
                    source_sha256=str(p.source.get("sha256", "")), source_name=str(p.source.get("name", "")),
                    lora_rank=g.lora_rank, int8=tuple(q["int8"]) if q else (), sampling=sampling_info(p.manifest))


def read_packs(pack_dirs) -> dict[tuple[int, int], PackInfo]:
    """{(width, height): PackInfo} of every pack, the default (first) first; PackError (a ValueError) when two packs
    serve one size (a job picks its pack by size) or a manifest is unreadable."""
    from models.packs.pack import PackError
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


def pack_sizes(pipeline_toml: Path) -> list[tuple[int, int]] | None:
    """The (width, height) of every pack a pipeline.toml names (a run folder's `pipeline_toml`), the default first;
    None without the file or packs."""
    if not pipeline_toml.exists():
        return None
    from stages.config import load_config
    cfg = load_config(pipeline_toml)
    return list(read_packs(cfg.packs)) or None


def vae_pack_sizes(cfg) -> list[tuple[int, int]] | None:
    """The (width, height) of every VAE pack a pipeline config's local VAE stage decodes (manifests only); None when
    it decodes any size (the torch VAE) or runs elsewhere. A pack that cannot be read is left out: the VAE stage
    says what is wrong with it when it starts, and a job of its size is refused at submit meanwhile."""
    vae = cfg.stage_settings("vae")
    if vae.get("backend", "torch") == "torch" or cfg.is_remote("vae"):
        return None
    from models.packs.pack import PackError
    from models.vae.pack import load_vae_pack
    dirs = vae.get("vae_pack") or []
    sizes = []
    for d in [dirs] if isinstance(dirs, str) else dirs:
        try:
            p = load_vae_pack(Path(cfg.path).parent / str(d), check=False)
        except PackError:
            continue
        sizes.append((p.width, p.height))
    return sizes


def pack_model_files(cfg) -> dict[str, str]:
    """The file names the encoder pack and the VAE packs were made from (their manifests' sources: what a ComfyUI
    client names in CLIPLoader and VAELoader), for the stages that run packs here; a pack that cannot be read, or a
    stage that runs elsewhere or on model files (torch), adds nothing."""
    from models.records.manifest import ManifestError, manifest_json
    base, out = Path(cfg.path).parent, {}
    enc, vae = cfg.stage_settings("encoder"), cfg.stage_settings("vae")
    picks = []
    if enc.get("backend", "torch") != "torch" and enc.get("pack") and not cfg.is_remote("encoder"):
        picks.append(("text_encoder", enc["pack"], ("sources", "text_encoder", "name")))
    dirs = vae.get("vae_pack") or []
    if vae.get("backend", "torch") != "torch" and dirs and not cfg.is_remote("vae"):
        picks += [("vae", d, ("source", "name")) for d in ([dirs] if isinstance(dirs, str) else dirs)]
    for key, folder, path in picks:
        try:
            entry = manifest_json(base / str(folder))
            for part in path:
                entry = entry[part]
        except (ManifestError, KeyError, TypeError):
            continue
        if isinstance(entry, str) and entry and key not in out:    # the VAE packs of several sizes share one file
            out[key] = entry
    return out
