"""No module outside ``bayeslayer/training`` builds an optimiser, steps one or runs a backward pass.

Read from the source (the syntax tree, so docstrings and comments do not count): a reference to
``torch.optim`` (``torch.optim.X``, ``from torch.optim import ...``, ``from torch import optim``), a
call of ``.step()`` on something named like an optimiser or a scheduler, and a call of ``.backward()``
are allowed only in :mod:`bayeslayer.training`; every experiment trains through
:func:`bayeslayer.training.loop.train_loop` (``test_regression.py`` shows it at run time).
"""

from __future__ import annotations

import ast
from pathlib import Path

import bayeslayer

PACKAGE = Path(bayeslayer.__file__).parent
TRAINING = PACKAGE / "training"


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def training_calls(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of every optimiser construction/use, optimiser step and backward pass in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module is not None and (
                node.module.startswith("torch.optim") or (node.module == "torch"
                                                          and any(a.name == "optim" for a in node.names))):
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Import) and any(a.name.startswith("torch.optim") for a in node.names):
            found.append((node.lineno, "import torch.optim"))
        elif isinstance(node, ast.Attribute) and _dotted(node).startswith("torch.optim."):
            found.append((node.lineno, _dotted(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = _dotted(node.func.value).lower()
            if node.func.attr == "backward":
                found.append((node.lineno, f"{_dotted(node.func)}()"))
            elif node.func.attr == "step" and any(w in receiver for w in ("optim", "sched", "opt")):
                found.append((node.lineno, f"{_dotted(node.func)}()"))
    return sorted(set(found))


def test_the_scan_finds_what_it_looks_for():
    source = ("import torch\nfrom torch.optim import SGD\nopt = torch.optim.AdamW([])\n"
              "loss.backward()\nopt.step()\nscheduler.step()\nmodel.step()\n'''torch.optim.AdamW in a docstring'''\n")
    assert [line for line, _ in training_calls(source)] == [2, 3, 4, 5, 6]


def test_no_module_outside_training_builds_or_steps_an_optimizer():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if TRAINING in path.parents:
            continue
        calls = training_calls(path.read_text(encoding="utf-8"))
        if calls:
            offenders[str(path.relative_to(PACKAGE))] = calls
    assert offenders == {}, f"training outside bayeslayer/training/loop.py: {offenders}"
    assert training_calls((TRAINING / "loop.py").read_text())  # and the loop does all of it
