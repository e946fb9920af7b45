"""No import cycles anywhere in the package, lazy (function-level) imports and parent packages included,
and no import that runs up the package's layers.

Every module of ``bayeslayer`` is imported with importlib (so the graph below is of modules that
exist and import), and its source is parsed for every ``import`` of a bayeslayer module at module
level or inside a function or class, with an edge to every package ``__init__`` that import runs
(tests/import_graph.py).  Any cycle in that graph fails, named module by module; so does any edge
from a room to a room above it (:data:`LAYERS`: ``ops`` imports no design, layer, model, ...).
"""

from __future__ import annotations

import importlib

import pytest

from .import_graph import LAYERS, PACKAGE, arrows_up, cycles, import_graph, module_name, module_paths


def test_the_walker_covers_the_whole_package():
    graph = import_graph()
    names = {module_name(p) for p in module_paths()}
    assert set(graph) == names and len(names) > 60
    for sub in ("ops", "ops.bayesian_layer", "ops.utils", "design", "layers", "models", "data", "experiments",
                "training", "evaluation"):
        assert f"bayeslayer.{sub}" in graph
    # lazy imports are edges: state_budget's command line imports the harness inside a function
    assert "bayeslayer.experiments.common.harness" in graph["bayeslayer.experiments.state_budget"]
    # parent-package edges: the dispatch imports ops.bayesian_layer.chunk, so ops/bayesian_layer/__init__ runs
    assert "bayeslayer.ops.bayesian_layer" in graph["bayeslayer.ops.backend"]
    # ... but not to a package above the importer, which Python has imported before the importer runs
    assert "bayeslayer.ops" not in graph["bayeslayer.ops.backend"]


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
    graph["bayeslayer.ops.bayesian_layer.prepare"].add("bayeslayer.ops.bayesian_layer.chunk")  # chunk → prepare exists
    found = cycles(graph)
    assert len(found) == 1 and found[0][0] == found[0][-1]
    assert {"bayeslayer.ops.bayesian_layer.prepare", "bayeslayer.ops.bayesian_layer.chunk"} <= set(found[0])


def test_no_import_cycle_in_the_package():
    found = cycles(import_graph())
    assert not found, "import cycle(s):\n" + "\n".join(" -> ".join(c) for c in found)



def _plant(tmp_path, files: dict[str, str]):
    """A throwaway package ``pkg`` under ``tmp_path`` with the given files (relative path -> source)."""
    for rel, src in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src, encoding="utf-8")
    return tmp_path / "pkg"


def test_a_planted_parent_package_cycle_fails(tmp_path):
    """``a → sub.x`` runs ``sub/__init__``, which imports ``sub.y``, which imports ``a`` inside a function: a loop
    that only the parent-package edge closes (the shape of an ``__init__`` that re-exports)."""
    root = _plant(tmp_path, {
        "__init__.py": "",
        "a.py": "from .sub.x import X\n",
        "sub/__init__.py": "from .y import Y\n",
        "sub/x.py": "X = 1\n",
        "sub/y.py": "def Y():\n    from .. import a  # lazy: still an edge\n    return a\n",
    })
    assert cycles(import_graph(root=root, parent_edges=False)) == []  # invisible without the parent edge
    found = cycles(import_graph(root=root))
    assert len(found) == 1 and {"pkg.a", "pkg.sub", "pkg.sub.y"} == set(found[0])


def test_a_planted_lazy_import_cycle_fails(tmp_path):
    root = _plant(tmp_path, {
        "__init__.py": "",
        "a.py": "import pkg.b\n",
        "b.py": "def f():\n    import pkg.a\n    return pkg.a\n",
    })
    found = cycles(import_graph(root=root))
    assert len(found) == 1 and set(found[0]) == {"pkg.a", "pkg.b"}


def test_no_import_runs_up_the_layers():
    bad = arrows_up(import_graph())
    assert not bad, "imports that run up the layers (tests/import_graph.py LAYERS):\n" + "\n".join(bad)


def test_the_layer_check_sees_an_arrow_up_and_a_room_it_does_not_know():
    graph = import_graph()
    assert {r for rooms in LAYERS for r in rooms} >= {"ops", "design", "layers", "models", "experiments"}
    graph["bayeslayer.ops.bayesian_layer.chunk"].add("bayeslayer.design")  # e.g. a parent-package edge
    graph["bayeslayer.layers"].add("bayeslayer.newroom.thing")
    assert arrows_up(graph) == [
        "bayeslayer.layers -> bayeslayer.newroom.thing (room 'newroom' has no place in LAYERS)",
        "bayeslayer.ops.bayesian_layer.chunk -> bayeslayer.design",
    ]


def test_inside_ops_the_shared_pieces_import_nothing_above_them():
    """``ops/utils`` imports nothing else of ``ops``; the op's package ``__init__`` imports nothing (so
    importing any of its files runs no other), and only the dispatch and ``ops/__init__`` import it whole."""
    graph = import_graph(("ops",))
    for mod, targets in graph.items():
        if mod.startswith("bayeslayer.ops.utils"):
            assert {t for t in targets if t.startswith("bayeslayer.ops")} <= {
                t for t in targets if t.startswith("bayeslayer.ops.utils")}, mod
    assert graph["bayeslayer.ops.bayesian_layer"] == set() and graph["bayeslayer.ops.utils"] == set()
