"""No module imports another module's private name (``from bayeslayer.x import _name``).

A name with a leading underscore is its module's own; a second module that needs it needs a public
name in one home.  Relative and absolute imports, at module level or inside functions, are read
from the source of every module of the package.
"""

from __future__ import annotations

import ast

from .import_graph import PACKAGE, module_name, module_paths


def private_imports() -> set[tuple[str, str]]:
    """``{(importing module, private name)}`` over the package."""
    found = set()
    for path in module_paths():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if not (node.level or (node.module or "").split(".")[0] == PACKAGE.name):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.add((module_name(path), alias.name))
    return found


def test_no_private_name_is_imported_across_modules():
    new = private_imports()
    assert not new, "private names imported from another module: " + ", ".join(
        f"{mod} imports {name}" for mod, name in sorted(new))

