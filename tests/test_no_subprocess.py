"""Library code starts no processes: installing things and running commands is the user's (or the README's) job.

Only the command line (``bayeslayer/cli.py``) may; today it does not either.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bayeslayer"
ALLOWED = {PACKAGE / "cli.py"}
FORBIDDEN_MODULES = {"subprocess", "pty"}
FORBIDDEN_OS = {"system", "popen", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
                "spawnvpe", "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
                "posix_spawn", "posix_spawnp"}


def _violations(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"from {node.module} import ...")
            elif node.module == "os":
                found += [f"from os import {a.name}" for a in node.names if a.name in FORBIDDEN_OS]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in FORBIDDEN_OS:
            found.append(f"os.{node.attr}")
    return [f"{path.relative_to(root)}: {v}" for v in found]


def test_the_checker_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport subprocess as sp\nfrom subprocess import run\nos.system('x')\n"
                   "from os import popen\n")
    assert len(_violations(bad, tmp_path)) == 4
    good = tmp_path / "good.py"
    good.write_text("import os\nos.path.join('a', 'b')\n")
    assert _violations(good, tmp_path) == []


def test_no_library_module_starts_a_process():
    sources = sorted(p for p in PACKAGE.rglob("*.py") if p not in ALLOWED)
    assert len(sources) > 50  # the walk sees the package
    offenders = [v for path in sources for v in _violations(path)]
    assert not offenders, "library code must not start processes (only bayeslayer/cli.py may): " + ", ".join(offenders)
