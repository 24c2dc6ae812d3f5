"""The branch backends, by name: the one registry every place that lists, validates or builds a backend reads (the
executor's `backend`, the VAE stage's `[stage.vae] backend`, `anima-models forward/verify/decode --backend`).

    onnx        ONNX Runtime on the CPU (onnx.py)
    rknn-sim    rknn-toolkit2 builds each branch and runs it in its simulator (rknn_sim.py)
    rknn        the RK3588 NPU through rknn-toolkit-lite2 (rknn.py; on x86 only against the labelled stand-in)
    board-sim   ONNX Runtime outputs, every phase paced to the MODELLED board (board_sim.py, models/board/)

The interface they implement is base.py. A class is imported only when its name is asked for (rknn-sim reaches
rknn-toolkit2's environment; this module imports nothing heavy, so a config can be checked without any of them).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from models.base.lazy import import_target


@dataclass(frozen=True)
class BackendEntry:
    target: str              # "module:Class"
    vae_packs: bool          # runs a VAE pack's graphs (board-sim models the DiT branches only)


BACKENDS = {
    "onnx": BackendEntry("models.runtime.backends.onnx:OnnxBackend", vae_packs=True),
    "rknn-sim": BackendEntry("models.runtime.backends.rknn_sim:RknnSimBackend", vae_packs=True),
    "rknn": BackendEntry("models.runtime.backends.rknn:RknnLiteBackend", vae_packs=True),
    "board-sim": BackendEntry("models.runtime.backends.board_sim:BoardSimBackend", vae_packs=False),
}


def backend_names() -> list:
    """Every backend name, sorted (what a DiT branch runs on)."""
    return sorted(BACKENDS)


def vae_pack_backends() -> tuple:
    """The backends that run a VAE pack, in the registry's order."""
    return tuple(n for n, e in BACKENDS.items() if e.vae_packs)


def backend_class(name: str):
    """A backend name -> its class (imported now); ValueError naming the choices, or why it cannot be imported."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}: choose one of {backend_names()}")
    module = BACKENDS[name].target.partition(":")[0]
    try:
        return import_target(BACKENDS[name].target)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"backend {name!r} is not available here ({module}: {e})") from None


def make_backend(name: str, **kwargs):
    """An instance of the named backend; kwargs (e.g. threads) go to its constructor."""
    return backend_class(name)(**kwargs)


def backend_kwargs(cls, threads: int | None, settings: dict, exclude=()) -> dict:
    """Constructor arguments for a backend class from a stage's settings: `threads`, plus every key its constructor
    names (core_mask, lite, ... for the board backends); keys in `exclude` are the stage's own, never passed on."""
    params = inspect.signature(cls.__init__).parameters
    kw = {"threads": threads} if threads and "threads" in params else {}
    kw.update({k: v for k, v in settings.items() if k in params and k not in exclude and k != "threads"})
    return kw


def make_branch_backend(name: str, threads: int | None, settings: dict, exclude=()):
    """A backend instance by name with a stage's settings (the executor's lifecycle makes its own through
    models.runtime.lifecycle.context_factory with the same `backend_kwargs`)."""
    cls = backend_class(name)
    return cls(**backend_kwargs(cls, threads, settings, exclude))
