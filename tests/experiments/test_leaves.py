"""Experiments are leaves: no module of ``bayeslayer.experiments`` imports another experiment.

An experiment is a module directly in ``bayeslayer/experiments/``; what several share lives in
``bayeslayer.experiments.common`` (which imports no experiment) or lower in the package.  The
graph is tests/import_graph.py's: every import, at module level or inside a function.
"""

from __future__ import annotations

import pytest

from ..import_graph import import_graph

PREFIX = "bayeslayer.experiments."
COMMON = PREFIX + "common"

# Imports still to be mended, each named; the list may only shrink (a mended one fails the last test
# until it is struck off here).
PENDING: set[tuple[str, str]] = set()


def experiments(graph: dict[str, set[str]]) -> set[str]:
    return {m for m in graph if m.startswith(PREFIX) and "." not in m[len(PREFIX):] and m != COMMON}


def experiment_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """``(importer, experiment)`` for every import of an experiment by another experiment or by ``common``."""
    leaves = experiments(graph)
    importers = leaves | {m for m in graph if m == COMMON or m.startswith(COMMON + ".")}
    return {(a, b) for a in importers for b in graph[a] if b in leaves and b != a}


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_experiments_are_found(graph):
    found = experiments(graph)
    for name in ("collision", "demo", "distill", "heldout", "lm", "mqar", "niah", "recall", "state_budget"):
        assert PREFIX + name in found
    assert not {m for m in found if m.startswith(COMMON)}


def test_no_experiment_imports_another(graph):
    found = experiment_edges(graph) - PENDING
    assert not found, "experiments import experiments:\n" + "\n".join(f"{a} -> {b}" for a, b in sorted(found))


def test_the_check_sees_a_planted_import(graph):
    """Not vacuous: a lazy import of one experiment by another, or by the shared core, is reported."""
    planted = {k: set(v) for k, v in graph.items()}
    planted[PREFIX + "distill"].add(PREFIX + "niah")
    planted[COMMON + ".harness"].add(PREFIX + "lm")
    assert {(PREFIX + "distill", PREFIX + "niah"), (COMMON + ".harness", PREFIX + "lm")} <= experiment_edges(planted)


def test_the_pending_list_only_names_imports_that_exist(graph):
    stale = PENDING - experiment_edges(graph)
    assert not stale, f"mended: strike {sorted(stale)} off PENDING"


#: an experiment module holds options, the run, the record and its figures and tables; machinery that grows
#: past this belongs in the library (training/, evaluation/, models/) or in experiments/common/
MAX_MODULE_LINES = 400


def test_no_experiment_module_is_longer_than_the_limit():
    from pathlib import Path

    import bayeslayer.experiments as pkg

    root = Path(pkg.__file__).parent
    long = {str(p.relative_to(root)): n for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, f"experiment modules over {MAX_MODULE_LINES} lines: {long}"
