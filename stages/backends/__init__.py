"""Executor backends: `onnx` and `rknn-sim` come from models.branch_runtime; `rknn` (the board) lives here."""
from __future__ import annotations

from models.branch_runtime import BACKENDS as MODEL_BACKENDS
from models.branch_runtime import backend_class as model_backend_class

# the board backend, imported only when asked for (models/ must not import stages/)
STAGE_BACKENDS = {"rknn": "stages.backends.rknn:RknnLiteBackend"}


def backend_names() -> list:
    return sorted({*MODEL_BACKENDS, *STAGE_BACKENDS})


def backend_class(name: str):
    """A backend name -> its class: "rknn" from here, every other name from models.branch_runtime."""
    if name in STAGE_BACKENDS:
        import importlib
        module, cls = STAGE_BACKENDS[name].split(":")
        return getattr(importlib.import_module(module), cls)
    if name not in MODEL_BACKENDS:
        raise ValueError(f"backend {name!r}: choose one of {backend_names()}")
    return model_backend_class(name)


def make_backend(name: str, **kwargs):
    return backend_class(name)(**kwargs)
