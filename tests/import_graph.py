"""The package's import graph, read from the source: every ``import`` / ``from … import`` of a
bayeslayer module, at module level or inside a function (a lazy import is still an edge), as
``{module: {modules it imports}}``; and the import cycles in it (strongly connected components).

Used by tests/test_import_cycles.py (the whole package) and tests/ops/test_backend.py (the ops layering).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bayeslayer"


def module_name(path: Path) -> str:
    """``bayeslayer/ops/bayesian_layer/chunk.py`` → ``bayeslayer.ops.bayesian_layer.chunk``; a package's
    ``__init__.py`` → the package."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    base = PACKAGE.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def module_paths(subpackages: tuple[str, ...] | None = None) -> list[Path]:
    """Every ``.py`` file of the package (or of the given subpackages of it), sorted."""
    roots = [PACKAGE] if subpackages is None else [PACKAGE / sub for sub in subpackages]
    return sorted(p for root in roots for p in root.rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """The bayeslayer modules ``path`` imports anywhere in its source (functions and classes included)."""
    name = module_name(path)
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule; `from mod import name` the module
            targets = [f"{mod}.{a.name}" if is_module(f"{mod}.{a.name}") else mod for a in node.names]
        else:
            continue
        found.update(t for t in targets if (t == "bayeslayer" or t.startswith("bayeslayer.")) and is_module(t))
    found.discard(name)
    return found


def import_graph(subpackages: tuple[str, ...] | None = None) -> dict[str, set[str]]:
    """``{module: bayeslayer modules it imports}`` over the package (or the given subpackages)."""
    return {module_name(path): imported_modules(path) for path in module_paths(subpackages)}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[a, b, …, a]`` of ``graph`` (edges to modules outside it ignored), or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle of ``graph``, one per strongly connected component of more than one module,
    each named by one cycle through it (``[a, b, …, a]``), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    found = []
    for comp in components:
        sub = {m: graph[m] & comp for m in comp}
        found.append(find_cycle(sub))
    return sorted(found)
