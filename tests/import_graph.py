"""The package's import graph, read from the source: every ``import`` / ``from … import`` of a
bayeslayer module, at module level or inside a function (a lazy import is still an edge), as
``{module: {modules it imports}}``; and the import cycles in it (strongly connected components).

Importing ``a.b.c`` first runs ``a/__init__.py`` and ``a/b/__init__.py``, so an import of a module is
also an edge to each package above it (the *parent-package edge*) — except the packages above the
importer itself, which Python has already imported (or is importing) before the importer runs.  A
package whose ``__init__`` re-exports can close a loop only through these edges
(``x → a.b.c`` while ``a/b/__init__`` imports a module that imports ``x``).

Used by tests/test_import_cycles.py (the whole package: cycles and the layering) and
tests/ops/test_backend.py (the ops layering).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bayeslayer"

#: the package's rooms (first dotted part below ``bayeslayer``) from the bottom up: a module may import
#: its own room, rooms on its level and rooms below it, never a room above ("an arrow up").  The
#: package's own ``__init__`` is the top.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "checks", "files"),
    ("ops",),
    ("design",),
    ("layers",),
    ("data",),
    ("models", "autoregister"),  # autoregister: imports models when transformers loads its Auto classes
    ("training",),
    ("evaluation",),
    ("experiments",),
    ("cli",),
)


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """``bayeslayer/ops/bayesian_layer/chunk.py`` → ``bayeslayer.ops.bayesian_layer.chunk``; a package's
    ``__init__.py`` → the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str, root: Path = PACKAGE) -> bool:
    base = root.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def module_paths(subpackages: tuple[str, ...] | None = None, root: Path = PACKAGE) -> list[Path]:
    """Every ``.py`` file of the package (or of the given subpackages of it), sorted."""
    roots = [root] if subpackages is None else [root / sub for sub in subpackages]
    return sorted(p for r in roots for p in r.rglob("*.py"))


def parents(name: str) -> list[str]:
    """The packages above a dotted module name: ``a.b.c`` → ``["a", "a.b"]``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imported_modules(path: Path, root: Path = PACKAGE, parent_edges: bool = True) -> set[str]:
    """The package's modules ``path`` imports anywhere in its source (functions and classes included),
    and (``parent_edges``) the packages above each of them whose ``__init__`` that import runs."""
    return set(_imported_modules(path, path.read_text(encoding="utf-8"), root, parent_edges))


@functools.cache
def _imported_modules(path: Path, text: str, root: Path, parent_edges: bool) -> frozenset[str]:
    # keyed by the source text as well as the path: a file is parsed once per test run unless it changes
    name = module_name(path, root)
    top = root.name
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(text, filename=str(path))):
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
            targets = [f"{mod}.{a.name}" if is_module(f"{mod}.{a.name}", root) else mod for a in node.names]
        else:
            continue
        found.update(t for t in targets if (t == top or t.startswith(top + ".")) and is_module(t, root))
    if parent_edges:
        own = set(parents(name)) | ({name} if is_pkg else set())  # already imported when ``name`` runs
        found.update(p for t in list(found) for p in parents(t) if p not in own and p.startswith(top))
    found.discard(name)
    return frozenset(found)


def import_graph(subpackages: tuple[str, ...] | None = None, root: Path = PACKAGE,
                 parent_edges: bool = True) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the package (or the given subpackages), parent-package edges
    included unless ``parent_edges=False``."""
    return {module_name(path, root): imported_modules(path, root, parent_edges)
            for path in module_paths(subpackages, root)}


def room(name: str) -> str:
    """The room of a module: its first dotted part below the package (the package itself: ``""``)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Every edge of ``graph`` that runs up :data:`LAYERS` (or leaves a room :data:`LAYERS` does not name),
    as ``"a -> b"``, sorted."""
    level = {r: i for i, rooms in enumerate(LAYERS) for r in rooms}
    level[""] = len(LAYERS)
    bad = []
    for a, targets in graph.items():
        for b in targets:
            ra, rb = room(a), room(b)
            if ra == rb:
                continue
            if ra not in level or rb not in level:
                bad.append(f"{a} -> {b} (room {ra if ra not in level else rb!r} has no place in LAYERS)")
            elif level[rb] > level[ra]:
                bad.append(f"{a} -> {b}")
    return sorted(bad)


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
