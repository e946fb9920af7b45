"""The scripts under ``benchmarks/`` as modules, for the tests of their pieces (the folder is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """Execute ``benchmarks/<name>.py`` as a fresh module ``benchmarks_<name>``.

    The module is registered in ``sys.modules`` before it runs (dataclasses look their module up there);
    a caller that wants it gone afterwards pops ``module.__name__``."""
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"name: no benchmark script {path}")
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return module


def loaded_benchmark(name: str) -> Iterator[ModuleType]:
    """:func:`load_benchmark` for a fixture (``yield from loaded_benchmark(name)``): the module, then forgotten."""
    module = load_benchmark(name)
    try:
        yield module
    finally:
        sys.modules.pop(module.__name__, None)
