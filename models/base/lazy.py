"""THE way a module is imported by name: `import_target("package.module:attr")` (or a bare module name).

Tables name what they run as such strings (the backends, the pack loaders, the `anima-models` subcommands, the bundle
writers, models.vae's exports) so that a module is imported only when it is used: a board stage never pays for torch,
onnx or transformers it does not call. tests/test_layout_rules.py reads every such string as an import, so a table
entry is held to the layers like an import statement."""
from __future__ import annotations

import importlib
from typing import Any


def import_target(target: str) -> Any:
    """"pkg.mod:attr" -> that attribute of the imported module; "pkg.mod" -> the module. ImportError and
    AttributeError pass through for the caller to word."""
    module, _, attr = target.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod
