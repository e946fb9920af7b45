"""No import cycles anywhere in the package, lazy (function-level) imports included.

Every module of ``bayeslayer`` is imported with importlib (so the graph below is of modules that
exist and import), and its source is parsed for every ``import`` of a bayeslayer module at module
level or inside a function or class (tests/import_graph.py).  Any cycle in that graph fails, named
module by module.
"""

from __future__ import annotations

import importlib

import pytest

from .import_graph import PACKAGE, cycles, import_graph, module_name, module_paths


def test_the_walker_covers_the_whole_package():
    graph = import_graph()
    names = {module_name(p) for p in module_paths()}
    assert set(graph) == names and len(names) > 60
    for sub in ("ops", "ops.triton", "design", "layers", "models", "data", "experiments", "training",
                "evaluation"):
        assert f"bayeslayer.{sub}" in graph
    # lazy imports are edges: state_budget's command line imports the harness inside a function
    assert "bayeslayer.experiments.common.harness" in graph["bayeslayer.experiments.state_budget"]


@pytest.mark.parametrize("path", module_paths(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_every_module_imports(path):
    name = module_name(path)
    if path.name == "__main__.py":
        pytest.skip("importing a __main__ module runs its program; its imports are in the graph")
    importlib.import_module(name)


def test_the_cycle_finder_names_a_cycle_and_sees_lazy_imports():
    """Not vacuous: a lazy import that closes a loop (here one added to the real graph) is reported."""
    graph = import_graph()
    assert cycles(graph) == []
    graph["bayeslayer.ops.prepare"].add("bayeslayer.ops.chunk")  # chunk → prepare exists
    found = cycles(graph)
    assert len(found) == 1 and found[0][0] == found[0][-1]
    assert {"bayeslayer.ops.prepare", "bayeslayer.ops.chunk"} <= set(found[0])


def test_no_import_cycle_in_the_package():
    found = cycles(import_graph())
    assert not found, "import cycle(s):\n" + "\n".join(" -> ".join(c) for c in found)

