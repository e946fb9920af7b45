"""Corpus sources and splits: which documents a ``source`` names, and which split each belongs to.

See :mod:`bayeslayer.data.text` for the sources, the hash split and the document rules.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .htmltext import html_to_text

SPLITS = ("train", "validation", "test")
SPLIT_ALIASES = {
    "train": "train",
    "training": "train",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "validation",
    "test": "test",
}
TEXT_SUFFIXES = (".txt", ".raw", ".text")
HTML_SUFFIXES = (".html", ".htm")
PARQUET_SUFFIXES = (".parquet",)
PYTHON_DOCS_DIRS = ("/usr/share/doc/python3/html",)
PYTHON_DOCS_GLOB = "/usr/share/doc/python3.*/html"

#: The corpus every Python installation has, offline: the docstrings of its standard library.
PYTHON_DOCSTRINGS = "python-docstrings"
#: Debian's ``python3-doc`` HTML documentation (needs the package; :data:`PYTHON_DOCS_INSTALL`).
PYTHON_DOCS = "python-docs"
#: The paper's corpus, from the Hugging Face hub (needs ``datasets`` and a connection, once).
WIKITEXT_103 = "hf:Salesforce/wikitext:wikitext-103-raw-v1"
#: The named sources a ``source`` argument may give instead of ``hf:...`` or a path: name -> what it is.
NAMED_SOURCES = {
    PYTHON_DOCSTRINGS: "the docstrings of this Python's standard library (offline, on every machine)",
    PYTHON_DOCS: "Python's HTML documentation from Debian's python3-doc package (apt-get install python3-doc)",
    "wikitext-103": f"WikiText-103, the paper's corpus, from the Hugging Face hub ({WIKITEXT_103})",
}
#: Named sources that stand for an ``hf:`` source.
SOURCE_ALIASES = {"wikitext-103": WIKITEXT_103}
#: How a ``source`` may be written, for help texts and errors.
SOURCE_HELP = f"{', '.join(NAMED_SOURCES)}, hf:<name>[:<config>] or a local path"


class CorpusNotFoundError(FileNotFoundError):
    """The requested corpus is not on this machine (the message says how to get it)."""


@dataclass(frozen=True)
class DocumentSource:
    """A lazily read document: ``name`` (stable, used for hash splits) and a reader."""

    name: str
    read: Callable[[], str] = field(repr=False, compare=False)


@dataclass(frozen=True)
class CorpusFiles:
    """The documents of each split plus a fingerprint that changes whenever they may."""

    splits: dict[str, Sequence[DocumentSource]]
    fingerprint: dict
    description: str


def _split_of_name(relative: str) -> str | None:
    parts = re.split(r"[/\\._\-]+", relative.lower())
    found = {SPLIT_ALIASES[p] for p in parts if p in SPLIT_ALIASES}
    return found.pop() if len(found) == 1 else None


def hash_split(name: str, fractions: Sequence[float], seed: int) -> str:
    """The split of a document under the deterministic hash rule (see module docstring)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()
    u = int(digest[:16], 16) / 2.0**64
    total = 0.0
    for split, fraction in zip(SPLITS, fractions, strict=True):
        total += fraction
        if u < total:
            return split
    return SPLITS[-1]


def _check_fractions(fractions) -> tuple[float, float, float]:
    try:
        out = tuple(float(f) for f in fractions)
    except TypeError as exc:
        raise TypeError(f"split_fractions must be 3 numbers, got {fractions!r}") from exc
    if len(out) != 3 or any(not (0 < f < 1) for f in out) or abs(sum(out) - 1) > 1e-9:
        raise ValueError(f"split_fractions must be 3 numbers in (0, 1) summing to 1 (train/val/test), got {out}")
    return out  # type: ignore[return-value]

_WIKITEXT_HEADING = re.compile(r"^ = [^=].* = \n?$")


def split_wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """Join WikiText-style lines (each ending in ``"\\n"``) and cut at ``" = Title = "`` headings."""
    article: list[str] = []
    for line in lines:
        if _WIKITEXT_HEADING.match(line) and any(s.strip() for s in article):
            yield "".join(article)
            article = []
        article.append(line if line.endswith("\n") or not line else line + "\n")
    if any(s.strip() for s in article):
        yield "".join(article)


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _read_html(path: Path) -> str:
    return html_to_text(path.read_text(encoding="utf-8", errors="replace"))


# One parquet file's text column at a time: documents are read file by file, so a
# single slot avoids both re-reading a file per row and holding every file in memory.
_PARQUET_SLOT: dict = {}


def _parquet_rows(path: Path, text_column: str) -> list:
    import pyarrow.parquet as pq

    if _PARQUET_SLOT.get("key") != (path, text_column):
        _PARQUET_SLOT.clear()
        rows = pq.read_table(path, columns=[text_column]).column(text_column).to_pylist()
        _PARQUET_SLOT.update(key=(path, text_column), rows=rows)
    return _PARQUET_SLOT["rows"]


def release_parquet_rows() -> None:
    """Drop the parquet text column held for lazy document reads (call once the documents are read)."""
    _PARQUET_SLOT.clear()


def _parquet_documents(path: Path, relative: str, text_column: str, rows_are_lines: bool) -> list:
    """Rows as documents (read lazily), or, for line-per-row text, the articles they form."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow (or datasets)") from exc
    meta = pq.ParquetFile(path)
    names = meta.schema_arrow.names
    if text_column not in names:
        raise ValueError(f"{path} has no column {text_column!r}; columns are {names}")
    if rows_are_lines:
        articles = list(split_wikitext_articles(r or "" for r in _parquet_rows(path, text_column)))
        return [DocumentSource(f"{relative}#{i}", lambda a=a: a) for i, a in enumerate(articles)]
    return [
        DocumentSource(f"{relative}#{i}", lambda i=i: _parquet_rows(path, text_column)[i] or "")
        for i in range(meta.metadata.num_rows)
    ]


class _LazyDocuments(Sequence):
    """A document list built on first use, so a cache hit never reads the dataset's text.

    ``truthy`` answers ``bool()`` without building (whether the source has rows).
    """

    def __init__(self, build: Callable[[], list[DocumentSource]], truthy: bool) -> None:
        self._build, self._truthy, self._docs = build, truthy, None

    def _get(self) -> list[DocumentSource]:
        if self._docs is None:
            self._docs = self._build()
        return self._docs

    def __len__(self) -> int:
        return len(self._get())

    def __getitem__(self, index):
        return self._get()[index]

    def __bool__(self) -> bool:
        return self._truthy if self._docs is None else bool(self._docs)


def _corpus_file_list(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)


def local_corpus_files(
    path: str | os.PathLike,
    *,
    split_fractions: Sequence[float] = (0.9, 0.05, 0.05),
    split_seed: int = 0,
    text_column: str = "text",
    rows_are_lines: bool | None = None,
    named_splits: bool | None = None,
    exclude: Callable[[str], bool] | None = None,
) -> CorpusFiles:
    """Documents of a local file or directory of ``.txt``/``.raw``/``.html``/``.parquet`` files.

    ``named_splits``: ``True`` takes each file's split from its path (``train``,
    ``validation``/``valid``/``val``/``dev``, ``test`` as a path component, e.g.
    ``wiki.test.raw``); ``False`` hash-splits documents; ``None`` decides by
    whether any file names a split (then every file must).
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise CorpusNotFoundError(f"corpus path {root} does not exist")
    fractions = _check_fractions(split_fractions)
    suffixes = TEXT_SUFFIXES + HTML_SUFFIXES + PARQUET_SUFFIXES
    files = _corpus_file_list(root, suffixes)
    base = root.parent if root.is_file() else root
    relatives = [p.relative_to(base).as_posix() for p in files]
    if exclude is not None:
        kept = [(p, r) for p, r in zip(files, relatives, strict=True) if not exclude(r)]
        files, relatives = [p for p, _ in kept], [r for _, r in kept]
    if not files:
        raise CorpusNotFoundError(f"no {'/'.join(suffixes)} files under {root}")
    if rows_are_lines is None:
        rows_are_lines = "wikitext" in str(root).lower()

    named = {r: _split_of_name(r) for r in relatives}
    explicit = any(s is not None for s in named.values()) if named_splits is None else bool(named_splits)
    if explicit and any(s is None for s in named.values()):
        unnamed = [r for r, s in named.items() if s is None][:5]
        raise ValueError(
            f"{root}: some files name a split (train/validation/test) and some do not, e.g. {unnamed}; "
            "name every file's split, or pass named_splits=False to hash-split"
        )
    splits: dict[str, list[DocumentSource]] = {s: [] for s in SPLITS}
    stats = []
    for file, relative in zip(files, relatives, strict=True):
        st = file.stat()
        stats.append([relative, st.st_size, st.st_mtime_ns])
        suffix = file.suffix.lower()
        if suffix in PARQUET_SUFFIXES:
            docs = _parquet_documents(file, relative, text_column, rows_are_lines)
        elif suffix in HTML_SUFFIXES:
            docs = [DocumentSource(relative, lambda f=file: _read_html(f))]
        else:
            docs = [DocumentSource(relative, lambda f=file: _read_text(f))]
        for doc in docs:
            split = named[relative] if explicit else hash_split(doc.name, fractions, split_seed)
            splits[split].append(doc)
    rule = {"explicit": True} if explicit else {"fractions": fractions, "seed": split_seed}
    fingerprint = {
        "kind": "local",
        "root": str(root.resolve()),
        "files": stats,
        "rule": rule,
        "text_column": text_column,
        "rows_are_lines": rows_are_lines,
    }
    return CorpusFiles(splits=splits, fingerprint=fingerprint, description=str(root))


# --------------------------------------------------------------------------- the default corpus


def python_docs_dir() -> Path | None:
    """Where ``python3-doc`` put the HTML documentation, or ``None``."""
    import glob

    candidates = [Path(p) for p in PYTHON_DOCS_DIRS] + [Path(p) for p in sorted(glob.glob(PYTHON_DOCS_GLOB))]
    for candidate in candidates:
        if (candidate / "index.html").is_file() and (candidate / "library").is_dir():
            return candidate.resolve()
    return None


def _exclude_python_docs_page(relative: str) -> bool:
    """Index, search and table-of-contents pages are lists of names, not prose."""
    name = relative.rsplit("/", 1)[-1]
    return (
        relative.startswith("_")
        or name.startswith("genindex")
        or name in {"py-modindex.html", "search.html", "contents.html", "download.html"}
    )


#: The one command that installs the default corpus (Debian's python3-doc), as root. Installing is the
#: README's job (docs/data.md); the library only says what to run.
PYTHON_DOCS_INSTALL = "apt-get install -y python3-doc"


def prepare_default_corpus() -> Path:
    """The HTML root of the default corpus (Debian's ``python3-doc``), which must be installed.

    Raises :class:`CorpusNotFoundError` (a ``FileNotFoundError``, so ``bayeslayer`` reports it as
    one line, exit 2) naming the command that installs it: :data:`PYTHON_DOCS_INSTALL`, as root.
    The library never runs it.
    """
    found = python_docs_dir()
    if found is not None:
        return found
    raise CorpusNotFoundError(
        "the default corpus python-docs is Debian's python3-doc package (Python's HTML documentation), "
        f"which is not installed on this machine: install it with `{PYTHON_DOCS_INSTALL}` (as root, "
        "e.g. `sudo " + PYTHON_DOCS_INSTALL + "`), or pass another source"
    )


def python_docs_files(
    root: str | os.PathLike | None = None,
    *,
    split_fractions: Sequence[float] = (0.9, 0.05, 0.05),
    split_seed: int = 0,
) -> CorpusFiles:
    """Documents of Python's HTML documentation, one per page, hash-split."""
    if root is None:
        root = python_docs_dir()
        if root is None:
            prepare_default_corpus()  # raises with the install command
    files = local_corpus_files(
        root,
        split_fractions=split_fractions,
        split_seed=split_seed,
        named_splits=False,  # library/test.html documents the test package; it is not a split
        exclude=_exclude_python_docs_page,
    )
    fingerprint = dict(files.fingerprint, kind="python-docs")
    return CorpusFiles(files.splits, fingerprint, f"Python documentation at {root}")


# Folders of the standard library that hold tests, tools' data or third-party code, not the library's prose.
_STDLIB_SKIP = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The standard library folder of the running Python (``sysconfig``'s ``stdlib`` path)."""
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def stdlib_docstrings(path: str | os.PathLike) -> str:
    """The docstrings of one Python file, in source order (module, classes, functions), one paragraph
    block each; parsed with :mod:`ast`, never imported or run.  A file that does not parse gives ``""``."""
    import ast
    import warnings

    try:
        with warnings.catch_warnings():  # old escape sequences in a docstring are not our concern
            warnings.simplefilter("ignore")
            tree = ast.parse(Path(path).read_bytes())
    except (SyntaxError, ValueError):
        return ""
    nodes = [node for node in ast.walk(tree)
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes.sort(key=lambda node: getattr(node, "lineno", 0))  # ast.walk is breadth-first; the module has no line
    docs = [d for d in (ast.get_docstring(node) for node in nodes) if d and d.strip()]
    return "\n\n".join(docs) + ("\n" if docs else "")


def _stdlib_py_files(root: Path) -> Iterator[Path]:
    """The ``.py`` files under ``root`` outside folders named in :data:`_STDLIB_SKIP` (at any depth), which are
    not entered at all: a ``site-packages`` inside the library folder can hold ten times its files."""
    for folder, subfolders, names in os.walk(root):  # as Path.rglob: into no linked folder
        subfolders[:] = [d for d in subfolders if d not in _STDLIB_SKIP]
        for name in names:
            path = Path(folder, name)
            if name.endswith(".py") and path.is_file():
                yield path


def python_docstrings_files(
    root: str | os.PathLike | None = None,
    *,
    split_fractions: Sequence[float] = (0.9, 0.05, 0.05),
    split_seed: int = 0,
) -> CorpusFiles:
    """The docstrings of the standard library as a corpus: one document per module, hash-split.

    ``root`` defaults to :func:`stdlib_root` (about 1.8 MB of text from 730 modules on CPython 3.11).
    Test packages and ``site-packages`` are left out.  Files are listed in sorted order and read with
    :func:`stdlib_docstrings` (no code is run); the fingerprint holds every file's size and mtime and
    the Python version, so another interpreter's library is another cache entry.
    """
    import sys

    root = stdlib_root() if root is None else Path(root).expanduser().resolve()
    if not root.is_dir():
        raise CorpusNotFoundError(f"standard library folder {root} does not exist")
    fractions = _check_fractions(split_fractions)
    files = sorted(_stdlib_py_files(root))
    if not files:
        raise CorpusNotFoundError(f"no .py files under {root}")
    splits: dict[str, list[DocumentSource]] = {s: [] for s in SPLITS}
    stats = []
    for file in files:
        relative = file.relative_to(root).as_posix()
        st = file.stat()
        stats.append([relative, st.st_size, st.st_mtime_ns])
        doc = DocumentSource(relative, lambda f=file: stdlib_docstrings(f))
        splits[hash_split(relative, fractions, split_seed)].append(doc)
    fingerprint = {
        "kind": PYTHON_DOCSTRINGS,
        "root": str(root),
        "python": list(sys.version_info[:3]),
        "files": stats,
        "rule": {"fractions": fractions, "seed": split_seed},
    }
    return CorpusFiles(splits, fingerprint, f"docstrings of the Python standard library at {root}")


def hf_corpus_files(
    name: str,
    config: str | None = None,
    *,
    text_column: str = "text",
    rows_are_lines: bool | None = None,
    revision: str | None = None,
) -> CorpusFiles:
    """Documents of a Hugging Face dataset's train/validation/test splits (needs ``datasets``)."""
    try:
        import datasets
    except ImportError as exc:
        raise ImportError("hf: sources need the optional `datasets` package: pip install datasets") from exc
    try:
        loaded = datasets.load_dataset(name, config, revision=revision)
    except FileNotFoundError as exc:
        raise CorpusNotFoundError(f"Hugging Face dataset {name!r} ({config}) not found: {exc}") from exc
    if rows_are_lines is None:
        rows_are_lines = "wikitext" in name.lower()
    splits: dict[str, Sequence[DocumentSource]] = {s: [] for s in SPLITS}
    fingerprint: dict = {"kind": "hf", "name": name, "config": config, "revision": revision, "splits": {}}
    for hf_split in loaded:
        split = SPLIT_ALIASES.get(hf_split)
        if split is None:
            continue
        ds = loaded[hf_split]
        if text_column not in ds.column_names:
            raise ValueError(f"{name} split {hf_split} has no column {text_column!r}: {ds.column_names}")
        fingerprint["splits"][split] = [hf_split, getattr(ds, "_fingerprint", None), len(ds)]
        splits[split] = _LazyDocuments(
            lambda ds=ds, name=hf_split: _hf_documents(ds, name, text_column, rows_are_lines), len(ds) > 0
        )
    fingerprint["rows_are_lines"] = rows_are_lines
    fingerprint["text_column"] = text_column
    return CorpusFiles(splits, fingerprint, f"Hugging Face dataset {name} ({config})")


def _hf_documents(ds, hf_split: str, text_column: str, rows_are_lines: bool) -> list[DocumentSource]:
    rows = ds[text_column]
    docs = split_wikitext_articles(r or "" for r in rows) if rows_are_lines else (r or "" for r in rows)
    return [DocumentSource(f"{hf_split}#{i}", lambda d=d: d) for i, d in enumerate(docs)]


def corpus_files(source: str | os.PathLike, **kwargs) -> CorpusFiles:
    """Resolve a ``source`` (a name of :data:`NAMED_SOURCES`, ``hf:<name>[:<config>]`` or a path; see
    :mod:`bayeslayer.data.text`) to its documents."""
    if isinstance(source, (str, os.PathLike)) is False:
        raise TypeError(f"source must be a str or path, got {type(source).__name__}")
    text = SOURCE_ALIASES.get(str(source), str(source))
    if text == PYTHON_DOCSTRINGS:
        keep = {k: v for k, v in kwargs.items() if k in ("split_fractions", "split_seed")}
        return python_docstrings_files(**keep)
    if text == PYTHON_DOCS:
        keep = {k: v for k, v in kwargs.items() if k in ("split_fractions", "split_seed")}
        return python_docs_files(**keep)
    if text.startswith("hf:"):
        name, _, config = text[3:].partition(":")
        keep = {k: v for k, v in kwargs.items() if k in ("text_column", "rows_are_lines", "revision")}
        if kwargs.get("named_splits") is not None:
            raise ValueError("named_splits applies to local files; hf: datasets bring their own splits")
        return hf_corpus_files(name, config or None, **keep)
    return local_corpus_files(text, **kwargs)
