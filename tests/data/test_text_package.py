"""``bayeslayer.data.text`` is a package of its jobs; every name the old module had still imports from it."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import bayeslayer.data.text as text

ROOT = Path(__file__).resolve().parents[2]

# The public names of the single-module bayeslayer/data/text.py this package replaced.
OLD_PUBLIC_NAMES = (
    "CacheError", "CorpusFiles", "CorpusNotFoundError", "DEFAULT_EOS", "DocumentSource", "ENCODE_PIECE_CHARS",
    "EOS_CANDIDATES", "FORMAT_VERSION", "HTML_SUFFIXES", "PARQUET_SUFFIXES", "PYTHON_DOCS_DIRS", "PYTHON_DOCS_GLOB",
    "PackedWindows", "SPLITS", "SPLIT_ALIASES", "TEXT_SUFFIXES", "TextCorpus", "TokenStream", "corpus_files",
    "default_cache_dir", "find_eos_id", "hash_split", "hf_corpus_files", "html_to_text", "load_text_corpus",
    "load_tokenizer", "local_corpus_files", "main", "pack_windows", "prepare_default_corpus", "python_docs_dir",
    "python_docs_files", "split_wikitext_articles", "tokenize_split", "train_bpe_tokenizer",
)
MODULES = ("htmltext", "sources", "tokenizer", "cache", "windows", "corpus")


def test_every_old_public_name_is_exported_by_the_package():
    missing = [name for name in OLD_PUBLIC_NAMES if not hasattr(text, name)]
    assert not missing
    assert set(OLD_PUBLIC_NAMES) <= set(text.__all__)
    assert all(hasattr(text, name) for name in text.__all__)


@pytest.mark.parametrize("module", MODULES)
def test_each_job_module_defines_what_the_package_reexports(module):
    mod = importlib.import_module(f"bayeslayer.data.text.{module}")
    for name in text.__all__:
        value = getattr(text, name)
        if getattr(value, "__module__", None) == mod.__name__:
            assert getattr(mod, name) is value


def _imported_names(source: str) -> list[str]:
    """Names of every ``from bayeslayer.data.text import ...`` (or ``from ..data.text import ...``) in ``source``."""
    names = []
    pattern = r"from (?:bayeslayer|\.+)\.?data\.text import (\([^)]*\)|[^\n]*)"
    for match in re.finditer(pattern, source):
        body = match.group(1).strip("()")
        names += [part.split(" as ")[0].strip() for part in re.split(r"[,\n]", body)]
    return [n for n in names if n.isidentifier()]  # prose such as "import X`` works" is not an import


def test_every_import_in_the_repository_resolves():
    """grep over bayeslayer/, tests/, benchmarks/, docs/ and the README: each imported name exists."""
    files = [ROOT / "README.md"]
    for folder in ("bayeslayer", "tests", "benchmarks", "docs"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    seen = {}
    for path in files:
        if path.is_file():
            for name in _imported_names(path.read_text(encoding="utf-8")):
                seen.setdefault(name, path)
    assert "load_text_corpus" in seen and "train_bpe_tokenizer" in seen  # the scan finds the real imports
    unknown = {name: str(path.relative_to(ROOT)) for name, path in seen.items()
               if name not in ("cache", "corpus", "sources", "tokenizer", "windows", "htmltext")
               and not hasattr(text, name)}
    assert not unknown


def test_the_job_modules_import_each_other_without_a_cycle():
    """Imports between the job modules, lazy and TYPE_CHECKING ones included, form no cycle."""
    import ast

    folder = Path(text.__file__).parent
    graph = {}
    for module in MODULES:
        tree = ast.parse((folder / f"{module}.py").read_text(encoding="utf-8"))
        graph[module] = {n.module for n in ast.walk(tree)
                         if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module in MODULES}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path + (module,))}"
        if module not in done:
            for dep in graph[module]:
                visit(dep, path + (module,))
            done.add(module)

    for module in MODULES:
        visit(module, ())
    assert graph["corpus"] >= {"cache", "sources", "tokenizer", "windows"}  # the walk sees the real imports
