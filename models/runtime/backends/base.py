"""The interface every branch backend implements (load -> init -> infer -> release, one context per instance), and
what callers ask a backend class instead of testing its name. The lifecycle around a backend (timing, policies:
prefetch, dual_core, resident, interleave) is models/runtime/lifecycle.py; the names are models/runtime/backends/__init__.py."""
from __future__ import annotations

from typing import Optional

import numpy as np


class BackendError(RuntimeError):
    """A backend could not load, initialise or run a branch model; the message names the file or input."""


class BranchBackend:
    """What every branch backend implements (for the executor, the VAE stage and the in-process runner alike).
    One instance = one context: one model at a time.

    load(path): read the model file (no compute); init(): build the runtime context; infer(inputs) -> outputs
    (dicts of name -> numpy array, names as in models.dit.partition); release(): free the context and the bytes;
    context_mb(): memory the loaded and initialised context costs (MiB), asked right after init(), None = unknown.
    Capabilities the lifecycle policies are checked against (models/board/policy.py: check_policy) are class attributes.
    """
    name = "abstract"
    max_contexts: Optional[int] = None   # contexts one process can hold loaded at once (None: memory is the limit)
    parallel_contexts = 1                # contexts that can infer at the same time (dual_core needs 2)
    takes_core_mask = False              # the constructor takes core_mask= (NPU backends: a context keeps its mask)
    needs_compiled_pack = False          # runs the .rknn files a pack was compiled to (anima-models compile)
    device = "cpu"                       # what it computes on, as clients are told: cpu | npu (simulated or modelled
                                         # NPUs count as one: the job's figures are an NPU's)

    # ---- what callers ask the class instead of testing its name -------------------------------------------------
    @classmethod
    def auto_policy(cls, ctx):
        """What `policy = "auto"` means on this backend (ctx: models.board.policy.AutoContext) -> a Policy, a policy
        string, or None: the documented safe choice (models.board.policy.safe_auto)."""
        return None

    @classmethod
    def host_pacer(cls, pack_dir, settings: dict):
        """What holds the scheduler's host ops of a job on `pack_dir` to this backend's pace (`settings`: the
        [stage.executor] table) -> an object with op(t0) and describe(), or None: host ops at this machine's pace."""
        return None

    @classmethod
    def report_section(cls, pack_dir, settings: dict) -> Optional[dict]:
        """What a job's report keeps apart from the time measured here (report.json's `board` block is computed from
        it), or None: every figure of the job is measured."""
        return None

    @classmethod
    def runtime_problem(cls, settings: dict) -> str:
        """"" when what this backend runs on is installed here (`settings`: its stage's table), else what is missing
        and how to install it: asked when a stage starts, so a missing runtime stops it then, not at its first
        model."""
        return ""

    @classmethod
    def trace_fields(cls) -> dict:
        """Fields this backend adds to each line of the executor's trace."""
        return {}

    def context_mb(self) -> Optional[float]:
        return None

    def load(self, path) -> None:
        raise NotImplementedError

    def init(self) -> None:
        raise NotImplementedError

    def infer(self, inputs: dict) -> dict:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError


def checked_input(path, inputs: dict, name: str, dtype, shape: tuple) -> np.ndarray:
    """inputs[name] as an array of the model's shape and dtype (None: any), or a BackendError naming the file."""
    if name not in inputs:
        raise BackendError(f"{path}: missing input {name!r} (wants {list(shape)})")
    a = np.asarray(inputs[name])
    if tuple(a.shape) != tuple(shape):
        raise BackendError(f"{path}: input {name!r} has shape {list(a.shape)}, expected {list(shape)}")
    if dtype is not None and a.dtype != dtype:
        raise BackendError(f"{path}: input {name!r} has dtype {a.dtype}, expected {np.dtype(dtype)}")
    return a
