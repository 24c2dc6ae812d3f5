"""A bundle as the board takes it (`orchestrator init --bundle`, `orchestrator doctor`): models.setup.bundle's checks of
every part, plus the one thing only the board can check, its NPU runtime against the toolkit that compiled the packs."""
from __future__ import annotations

from models.setup.bundle import Bundle, BundleError, read_bundle


def runtime_problem(bundle: Bundle) -> str:
    """"" when this machine's rknn-toolkit-lite2 can run the bundle (a CPU bundle needs none), else what is wrong
    and the fix."""
    if bundle.backend != "rknn":
        return ""
    from models.runtime.backends.base import BackendError
    from models.runtime.backends.rknn import lite_module, runtime_mismatch
    try:
        api = lite_module()
    except BackendError as e:
        return f"{e}; the bundle needs rknn-toolkit-lite2 {bundle.toolkit}"
    problem = runtime_mismatch(bundle.toolkit, api)
    return f"the bundle was compiled with rknn-toolkit2 {bundle.toolkit}, but {problem}" if problem else ""


def board_bundle(path, hashes: bool = True) -> Bundle:
    """The bundle at `path`, every part checked (with `hashes`, every file's sha256) and its runtime present; a
    BundleError naming what is wrong and the fix."""
    bundle = read_bundle(path, hashes=hashes)
    problem = runtime_problem(bundle)
    if problem:
        raise BundleError(f"{bundle.dir}: {problem}")
    return bundle
