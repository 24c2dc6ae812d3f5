"""models/'s subpackages (docs/architecture.md, "Module map"): no module stands loose at the top; each concern is a
subpackage a newcomer finds by its name. (Cycles between subpackages are the house check's: the import graph here
also counts the by-name links the module map allows.)"""
from __future__ import annotations

from tests.test_layout_rules import import_graph


def loose_modules(graph: dict) -> set[str]:
    return {m for m in graph if m.startswith("models.") and m.count(".") == 1 and not _is_package(m, graph)}


def _is_package(module: str, graph: dict) -> bool:
    return any(other.startswith(module + ".") for other in graph)


def test_no_module_loose_at_the_top_of_models():
    graph = import_graph()
    assert {"models.base.durable", "models.records.manifest", "models.setup.bundle", "models.commands.cli"} <= set(graph)
    assert not loose_modules(graph), f"modules loose at the top of models/: {sorted(loose_modules(graph))}"


def test_the_rule_finds_a_loose_module_and_not_a_package():
    graph = {"models.durable": set(), "models.base": set(), "models.base.schema": set(), "models": set()}
    assert loose_modules(graph) == {"models.durable"}
