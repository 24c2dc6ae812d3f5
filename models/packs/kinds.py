"""The packs a model backend runs, by their manifest's kind: a DiT pack (models.packs.pack) or a VAE pack
(models.vae.pack), each read by its own loader. Apart from both so that neither imports the other."""
from __future__ import annotations

from pathlib import Path

from models.base.lazy import import_target
from models.records.manifest import MANIFEST, ManifestError, manifest_json
from models.packs.pack import PACK_KIND, PackError

# manifest "kind" -> "module:loader" of the packs whose branches a model backend runs (DiT branches, VAE models)
PACK_LOADERS = {PACK_KIND: "models.packs.pack:load_pack", "anima-vae-pack": "models.vae.pack:load_vae_pack",
                "anima-vae-encoder-pack": "models.vae.encoder_pack:load_vae_encoder_pack"}


def load_branch_pack(pack_dir, check: bool = True):
    """A DiT pack (Pack) or a VAE pack (models.vae.pack.VaePack), by its manifest's kind, read by that kind's loader
    (which keeps every file name inside the pack folder); `.manifest["branches"]` lists its models either way."""
    mpath = Path(pack_dir) / MANIFEST
    try:
        kind = manifest_json(pack_dir).get("kind", PACK_KIND)
    except ManifestError:
        kind = PACK_KIND                           # the DiT loader says what is wrong with it
    if kind not in PACK_LOADERS:
        raise PackError(f"{mpath}: a {str(kind)[:80]!r} folder, not one of the packs a backend runs "
                        f"({', '.join(PACK_LOADERS)})")
    return import_target(PACK_LOADERS[kind])(pack_dir, check=check)
