"""Model backends of the executor and the VAE stage: `onnx` and `rknn-sim` come from models.branch_runtime; `rknn`
(the board) and `board-sim` (the executor on a modelled board: real outputs, paced to the reference board's phase
times) live here."""
from __future__ import annotations

import inspect

from models.branch_runtime import BACKENDS as MODEL_BACKENDS
from models.branch_runtime import backend_class as model_backend_class

# the board backend, imported only when asked for (models/ must not import stages/)
STAGE_BACKENDS = {"rknn": "stages.backends.rknn:RknnLiteBackend",
                  "board-sim": "stages.backends.board_sim:BoardSimBackend"}


def backend_names() -> list:
    return sorted({*MODEL_BACKENDS, *STAGE_BACKENDS})


def backend_class(name: str):
    """A backend name -> its class: "rknn" and "board-sim" from here, every other name from models.branch_runtime."""
    if name in STAGE_BACKENDS:
        import importlib
        module, cls = STAGE_BACKENDS[name].split(":")
        return getattr(importlib.import_module(module), cls)
    if name not in MODEL_BACKENDS:
        raise ValueError(f"backend {name!r}: choose one of {backend_names()}")
    return model_backend_class(name)


def make_backend(name: str, **kwargs):
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
    models.lifecycle.context_factory with the same `backend_kwargs`)."""
    cls = backend_class(name)
    return cls(**backend_kwargs(cls, threads, settings, exclude))

