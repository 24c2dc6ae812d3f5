"""The run's LoRAs as the orchestrator sees them: the names under the models folder's loras/, and a job's `loras`
checked at submit against every model part the job runs, so a file that cannot be applied is refused before anything
is queued (the stages check again when they load it: a file may change in between).

What a LoRA may name is read from the run's own files, headers and manifests only (no weights, no torch): the DiT's
layers from each pack's config, the LLM adapter's and Qwen3's from the encoder pack's manifest (`[stage.encoder]
backend = "onnx"`) or the models folder's DiT and text-encoder headers (torch).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from models.records.manifest import ManifestError, encoder_weight_shapes
from models.lora import LoraError, TargetTable, plan_loras
from models.lora.choice import MAX_LORAS
from models.lora.plan import open_lora
from models.setup.models_dir import LORAS_DIR, ModelsDirError, list_loras, lora_relative

log = logging.getLogger(__name__)


class LoraRefused(ValueError):
    """A job's LoRA that cannot be applied; `field` is its place in prompt.json (loras[0].name, ...)."""

    def __init__(self, field: str, message: str):
        self.field, self.detail = field, message
        super().__init__(f"{field}: {message}")


def _encoder_tables(config) -> tuple:
    """({adapter key: shape}, {Qwen3 key: shape}) the encoder stage holds, from the encoder pack's manifest or the
    models folder's file headers; (None, None) when neither says."""
    settings = config.stage_settings("encoder")
    if settings.get("backend") == "onnx" and settings.get("pack"):
        pack = Path(config.path).parent / Path(str(settings["pack"])).expanduser()
        try:
            return encoder_weight_shapes(pack, ("adapter", "qwen3"))
        except ManifestError as e:
            log.info("encoder pack %s: its weights are not listed (%s); its LoRA layers are checked when it runs",
                     pack, e)
            return None, None
    try:
        from models.dit.checkpoint import strip_prefix
        from models.setup.models_dir import resolve_models
        from models.base.safetensors_io import SafeTensorsFile
        paths = resolve_models(config.models_dir, {k: settings[k] for k in ("dit", "text_encoder") if k in settings},
                               need=("dit", "text_encoder"))
        dit, te = SafeTensorsFile(paths.dit), SafeTensorsFile(paths.text_encoder)
        adapter = {strip_prefix(k): dit.shape(k) for k in dit.keys() if strip_prefix(k).startswith("llm_adapter.")}
        return adapter, {k: te.shape(k) for k in te.keys()}
    except (ValueError, OSError) as e:
        log.info("the encoder's model files are unknown here (%s); its LoRA layers are checked when it runs", e)
        return None, None


FRESH_S = 2.0                   # a folder changed this recently may change again within its mtime's resolution


class LoraListing:
    """The names under MODELS/loras/ as they are now (list_loras), listed again whenever loras/ or a folder in it
    changed: the key is every folder's mtime, a handful of stat calls per look rather than a walk of every file. A
    folder changed within FRESH_S of the last listing is not trusted to show a second change in its mtime (a coarse
    clock), so the list is made again until it settles."""

    def __init__(self, models_dir):
        self.models_dir = models_dir
        self._key, self._names, self._trusted = None, [], False
        self._lock = threading.Lock()

    def _folders(self) -> tuple | None:
        """(path, mtime_ns) of loras/ and each folder under it (links not followed, as list_loras does not);
        None when there is no loras/ folder."""
        if self.models_dir is None:
            return None
        root = os.path.join(os.path.expanduser(os.fspath(self.models_dir)), LORAS_DIR)
        out, stack = [], [root]
        while stack:
            path = stack.pop()
            try:
                out.append((path, os.stat(path, follow_symlinks=False).st_mtime_ns))
                with os.scandir(path) as entries:
                    stack += [e.path for e in entries if e.is_dir(follow_symlinks=False)]
            except OSError:
                if path == root:
                    return None
        return tuple(sorted(out))

    def names(self) -> list:
        with self._lock:
            key = self._folders()
            if key is None:
                self._key, self._names, self._trusted = None, [], False
                return []
            if key != self._key or not self._trusted:
                now = time.time_ns()
                self._names = list_loras(self.models_dir)
                self._key = key
                self._trusted = all(now - mtime > FRESH_S * 1e9 for _, mtime in key)
            return list(self._names)


class RunLoras:
    """LoRA names and checks for one run folder's config and packs."""

    def __init__(self, config, packs: dict):
        self.config, self.packs = config, packs           # packs: (width, height) -> orchestrator.engine.packs.PackInfo
        self._tables: dict = {}
        self.listing = LoraListing(config.models_dir)

    @property
    def models_dir(self):
        return self.config.models_dir

    def names(self) -> list:
        """The LoRAs a job may name (ComfyUI's list: paths under loras/), as the folder is now."""
        return self.listing.names()

    def table(self, size) -> TargetTable:
        """Every layer a LoRA may name in a job of this size (its pack's DiT, the encoder's adapter and Qwen3)."""
        if size not in self._tables:
            from models.dit.config import expected_dit_shapes
            from models.packs.pack import load_pack
            dit = dict(expected_dit_shapes(load_pack(self.packs[size].dir, check=False).config))
            adapter, te = _encoder_tables(self.config)
            if adapter:
                dit.update(adapter)
            table = TargetTable(dit, te)
            if adapter is None:                           # not known here: the encoder checks its own names
                table.has["adapter"] = False
            self._tables[size] = table
        return self._tables[size]

    def told(self, err: Exception) -> str:
        """An error's text as a client sees it: LoRA files named under loras/, not by the server's paths."""
        return lora_relative(self.models_dir, str(err))

    def _refuse_on_int8(self, plan, size) -> None:
        """A W8A8 pack's INT8 layers were calibrated (and smoothed) on the checkpoint's own activations: a LoRA that
        changes any DiT layer (branch or host) shifts them; refused naming the pack's INT8 layers and the LoRA. A
        LoRA of the encoder only is left alone (it changes the context, which no INT8 layer reads)."""
        info = self.packs[size]
        int8 = getattr(info, "int8", ())
        for i, rep in enumerate(plan.report() if int8 else ()):
            dit = {p: n for p, n in rep["layers"].items() if p in ("branch", "host") and n}
            if dit:
                raise LoraRefused(f"loras[{i}]", f"model pack {info.dir} ({size[0]}x{size[1]}) is INT8 (W8A8 "
                                  f"{', '.join(int8)}, calibrated without LoRAs) and LoRA {rep['name']} changes "
                                  f"{sum(dit.values())} of its DiT layers; use a FP16 pack of this size for LoRAs "
                                  "(or bake the LoRA into the checkpoint, then calibrate and pack that)")

    def check(self, choices, size, lora_rank: int, overflow: str = "refuse") -> tuple:
        """A job's `loras` ([models.lora.choice.LoraChoice]) -> ([LoraUse] with resolved paths, the plan's report),
        or LoraRefused naming the entry: a name outside loras/ or of no file, a file that is not a LoRA this model
        takes (truncated, other adapter types, another model's, wrong shapes, unknown keys), a stacked rank over the
        pack's (unless overflow is 'svd'), branch layers for a pack that takes no LoRA (naming it and the ways out)."""
        if len(choices) > MAX_LORAS:
            raise LoraRefused("loras", f"{len(choices)} LoRAs; at most {MAX_LORAS} per job")
        uses, files = [], []
        for i, choice in enumerate(choices):
            try:
                use = choice.use(self.models_dir)
            except ModelsDirError as err:
                raise LoraRefused(f"loras[{i}].name", self.told(err)) from None
            try:
                use.check()
                files.append(open_lora(use.path))
            except LoraError as err:
                raise LoraRefused(f"loras[{i}]", self.told(err)) from None
            uses.append(use)
        if not uses:
            return [], []
        try:
            plan = plan_loras(uses, self.table(size), files=files)
            self._refuse_on_int8(plan, size)
            plan.check_rank(lora_rank, overflow, where=f"model pack {self.packs[size].dir} ({size[0]}x{size[1]}): ")
        except LoraError as err:
            bad = next((i for i, f in enumerate(files) if f.path in str(err)), None)
            raise LoraRefused(f"loras[{bad}]" if bad is not None else "loras", self.told(err)) from None
        return uses, plan.report()
