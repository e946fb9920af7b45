"""Text corpora for language modelling: load, split, tokenize, cache, pack.

A corpus becomes, per split, one flat stream of token ids (each non-empty
document followed by an end-of-text token), cached on disk as a raw numpy array and
opened as a read-only ``np.memmap``; packed windows are non-overlapping
``[N, seq_len]`` views of that stream (the tail shorter than one window is
dropped)::

    corpus = load_text_corpus("python-docs", vocab_size=8192)
    windows = corpus.windows("validation", seq_len=2048)  # np.ndarray [N, 2048]
    dataset = corpus.dataset("train", seq_len=2048)  # torch Dataset of {"input_ids", "labels"}

Sources (``source`` argument):

* ``"python-docs"`` (default): the English prose of Python's documentation
  from Debian's ``python3-doc`` package, HTML stripped to text with
  :mod:`html.parser` (code blocks, navigation and index pages dropped).  Set it
  up once with :func:`prepare_default_corpus` (``apt-get install -y python3-doc``).
* ``"hf:<name>[:<config>]"``: a Hugging Face dataset through the optional
  ``datasets`` package, with its own train/validation/test splits; e.g.
  ``"hf:Salesforce/wikitext:wikitext-103-raw-v1"`` (the paper's corpus).
* a path: a ``.txt``/``.raw``/``.html``/``.parquet`` file or a directory of them.
  Files whose name names a split (``train``, ``validation``/``valid``/``val``/
  ``dev``, ``test``, e.g. ``wiki.train.raw`` or ``test-00000.parquet``) form
  that split; otherwise documents are split by a hash of their name.

A text or HTML file is one document; a parquet row is one document, unless
rows are lines of a longer text (WikiText), in which case rows are joined and
cut into articles at ``" = Title = "`` headings.

Hash split: document ``name`` goes to the first split whose cumulative
fraction exceeds ``u = int(sha256(f"{seed}:{name}")[:16], 16) / 2**64``;
deterministic, and adding a document never moves another.

Cache: token ids of each split are stored under ``cache_dir`` (default
``$BAYESLAYER_CACHE`` or ``~/.cache/bayeslayer``) as ``tokens-<key>.bin`` plus a
``tokens-<key>.json`` written last, where ``key`` hashes the corpus files
(paths, sizes, mtimes) or dataset fingerprint, the split rule, the split name,
the text extraction version and the tokenizer (its full JSON).  The JSON holds
the token count and a SHA-256 of the ids; a truncated or corrupt cache is
detected on load and rebuilt with a warning (``on_corrupt="raise"`` raises
:class:`CacheError` instead).  Files are written to a temp name and renamed,
so concurrent builders (e.g. every rank of a ``torchrun`` job) never see half
a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
import torch.utils.data

from bayeslayer.data.arhit import ARHitAnnotation, BigramCounts, annotate_ar_hits
from bayeslayer.training.files import atomic_write, atomic_write_text, sha256_file

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
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
DEFAULT_EOS = "<|endoftext|>"
PYTHON_DOCS_DIRS = ("/usr/share/doc/python3/html",)
PYTHON_DOCS_GLOB = "/usr/share/doc/python3.*/html"
# Bump when text extraction, splitting or the stream layout changes: it invalidates caches.
FORMAT_VERSION = 1
# Long single documents are tokenized in pieces of about this many characters.
ENCODE_PIECE_CHARS = 1 << 20


class CorpusNotFoundError(FileNotFoundError):
    """The requested corpus is not on this machine (the message says how to get it)."""


class CacheError(RuntimeError):
    """A token cache file is truncated, corrupt or inconsistent with its metadata."""


def default_cache_dir() -> Path:
    """``$BAYESLAYER_CACHE`` or ``~/.cache/bayeslayer``."""
    env = os.environ.get("BAYESLAYER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "bayeslayer"


# --------------------------------------------------------------------------- HTML to text


_BLOCK_TAGS = {
    "address", "article", "aside", "blockquote", "br", "caption", "dd", "div", "dl", "dt",
    "figcaption", "figure", "footer", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "li",
    "main", "ol", "p", "section", "table", "tbody", "td", "th", "thead", "tr", "ul",
}  # fmt: skip
_SKIP_TAGS = {"script", "style", "pre", "head", "title", "nav", "form", "button", "textarea", "noscript"}
_SKIP_CLASSES = {
    "headerlink", "sphinxsidebar", "related", "footer", "highlight", "linenos", "toctree-wrapper",
}  # fmt: skip
_VOID_TAGS = {
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr",
}  # fmt: skip


class _ProseExtractor(HTMLParser):
    """Collects the visible prose of an HTML page, one paragraph per block element.

    Keeps only the page's main content (``role="main"``, Sphinx's ``div.body``)
    when it has one, and drops code blocks (``<pre>``), scripts, navigation,
    sidebars and Sphinx's ``¶`` header links.
    """

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self._stack: list[tuple[str, bool, bool]] = []  # (tag, skipping, in_main) after the tag opened
        self.main: list[str] = []
        self.body: list[str] = []
        self.found_main = False

    def _state(self) -> tuple[bool, bool]:
        return (self._stack[-1][1], self._stack[-1][2]) if self._stack else (False, False)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        skipping, in_main = self._state()
        if tag in _BLOCK_TAGS:
            self._text("\n\n", skipping, in_main)
        if tag in _VOID_TAGS:
            return
        attr = dict(attrs)
        classes = set((attr.get("class") or "").split())
        skipping = skipping or tag in _SKIP_TAGS or bool(classes & _SKIP_CLASSES)
        if attr.get("role") == "main" or (tag == "div" and "body" in classes) or tag == "main":
            in_main = True
            self.found_main = True
        self._stack.append((tag, skipping, in_main))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _BLOCK_TAGS:
            self._text("\n\n", *self._state())

    def handle_endtag(self, tag: str) -> None:
        # Unclosed <p>/<li> are legal HTML: pop up to the matching open tag, if any.
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] == tag:
                del self._stack[i:]
                break
        if tag in _BLOCK_TAGS:
            self._text("\n\n", *self._state())

    def handle_data(self, data: str) -> None:
        self._text(data, *self._state())

    def _text(self, data: str, skipping: bool, in_main: bool) -> None:
        if skipping:
            return
        self.body.append(data)
        if in_main:
            self.main.append(data)


def html_to_text(html: str) -> str:
    """The prose of an HTML page: paragraphs separated by one blank line, spaces collapsed.

    Uses only the standard library's :class:`html.parser.HTMLParser`.
    """
    if not isinstance(html, str):
        raise TypeError(f"html must be a str, got {type(html).__name__}")
    parser = _ProseExtractor()
    parser.feed(html)
    parser.close()
    raw = "".join(parser.main if parser.found_main else parser.body)
    paragraphs = (" ".join(block.split()) for block in raw.split("\n\n"))
    return "\n\n".join(p for p in paragraphs if p)


# --------------------------------------------------------------------------- documents


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
_SAFE_CUT = re.compile(r"\n(?=[^\s]| [^\s])")


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


def _text_pieces(text: str, max_chars: int = ENCODE_PIECE_CHARS) -> Iterator[str]:
    """Cut a long text at line starts where byte-level pre-tokenization cannot merge across."""
    start = 0
    while len(text) - start > max_chars:
        match = _SAFE_CUT.search(text, start + max_chars)
        if match is None:
            break
        yield text[start : match.end()]
        start = match.end()
    yield text[start:]


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


def prepare_default_corpus(*, install: bool = False) -> Path:
    """Make sure the default corpus (Debian's ``python3-doc``) is present; return its HTML root.

    With ``install=True`` and ``apt-get`` available (as root), runs
    ``apt-get install -y python3-doc`` (after ``apt-get update`` if the first
    attempt fails).  Otherwise raises :class:`CorpusNotFoundError` with the command.
    """
    found = python_docs_dir()
    if found is not None:
        return found
    command = ["apt-get", "install", "-y", "python3-doc"]
    if not install:
        raise CorpusNotFoundError(
            "the default corpus needs Debian's python3-doc package (Python's HTML documentation); "
            "install it with `apt-get install -y python3-doc` (as root), call "
            "prepare_default_corpus(install=True), or pass another source"
        )
    if shutil.which("apt-get") is None:
        raise CorpusNotFoundError("python3-doc is missing and apt-get is not available on this machine")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env)
        result = subprocess.run(command, capture_output=True, text=True, env=env)
    found = python_docs_dir()
    if found is None:
        raise CorpusNotFoundError(
            f"`{' '.join(command)}` did not provide the documentation (exit {result.returncode}): "
            f"{result.stderr.strip()[-500:]}"
        )
    return found


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
            prepare_default_corpus(install=False)  # raises with instructions
    files = local_corpus_files(
        root,
        split_fractions=split_fractions,
        split_seed=split_seed,
        named_splits=False,  # library/test.html documents the test package; it is not a split
        exclude=_exclude_python_docs_page,
    )
    fingerprint = dict(files.fingerprint, kind="python-docs")
    return CorpusFiles(files.splits, fingerprint, f"Python documentation at {root}")


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
    """Resolve a ``source`` string (see module docstring) to its documents."""
    if isinstance(source, (str, os.PathLike)) is False:
        raise TypeError(f"source must be a str or path, got {type(source).__name__}")
    text = str(source)
    if text == "python-docs":
        keep = {k: v for k, v in kwargs.items() if k in ("split_fractions", "split_seed")}
        return python_docs_files(**keep)
    if text.startswith("hf:"):
        name, _, config = text[3:].partition(":")
        keep = {k: v for k, v in kwargs.items() if k in ("text_column", "rows_are_lines", "revision")}
        if kwargs.get("named_splits") is not None:
            raise ValueError("named_splits applies to local files; hf: datasets bring their own splits")
        return hf_corpus_files(name, config or None, **keep)
    return local_corpus_files(text, **kwargs)


# --------------------------------------------------------------------------- tokenizers


def _tokenizers():
    try:
        import tokenizers
    except ImportError as exc:
        raise ImportError("text corpora need the `tokenizers` package: pip install tokenizers") from exc
    return tokenizers


def load_tokenizer(tokenizer) -> object:
    """A ``tokenizers.Tokenizer`` from an instance, a ``tokenizer.json`` path, a directory
    holding one (e.g. a downloaded Hugging Face model), or a transformers fast tokenizer."""
    tk = _tokenizers()
    if isinstance(tokenizer, tk.Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers PreTrainedTokenizerFast
    if isinstance(backend, tk.Tokenizer):
        return backend
    if isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        return tk.Tokenizer.from_file(str(path))
    raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, a path or a fast tokenizer, got {tokenizer!r}")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, *, eos_token: str = DEFAULT_EOS) -> object:
    """Train a byte-level BPE (GPT-2 style) of ``vocab_size`` tokens, ``eos_token`` included.

    Byte-level means every string is encodable (256 byte symbols form the base
    alphabet); ``vocab_size`` must leave room for them: at least 257.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 257 <= vocab_size <= 1 << 20:
        raise ValueError(f"vocab_size must be an int in [257, 2**20] for byte-level BPE, got {vocab_size!r}")
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[eos_token],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def find_eos_id(tokenizer, eos_token: str | None = None) -> int:
    """Id of ``eos_token``, or of the first of ``EOS_CANDIDATES`` the tokenizer knows."""
    names = [eos_token] if eos_token is not None else list(EOS_CANDIDATES)
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    raise ValueError(
        f"tokenizer has no end-of-text token among {names}; pass eos_token=<a token it has> "
        "(documents are separated by it)"
    )


def _tokenizer_digest(tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def _key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]


# --------------------------------------------------------------------------- token cache


@dataclass
class TokenStream:
    """One split as a flat stream of token ids (documents joined by EOS).

    ``tokens``: read-only ``np.memmap`` [T] of uint16/uint32; ``path``: the
    cache file; ``from_cache``: whether this call reused an existing cache
    (False when it tokenized); ``n_documents``: documents in the split.
    """

    split: str
    tokens: np.ndarray
    path: Path
    from_cache: bool
    n_documents: int

    def windows(self, seq_len: int) -> np.ndarray:
        """Non-overlapping windows [N, seq_len], N = len(tokens) // seq_len (a view, no copy)."""
        return pack_windows(self.tokens, seq_len)


def pack_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Pack a 1-D stream into non-overlapping windows ``[len(tokens) // seq_len, seq_len]``.

    The tail shorter than ``seq_len`` is dropped; a stream shorter than one
    window is an error, not an empty dataset.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D numpy array, got {getattr(tokens, 'shape', type(tokens))}")
    n = tokens.shape[0] // seq_len
    if n == 0:
        raise ValueError(f"a stream of {tokens.shape[0]} tokens holds no window of seq_len {seq_len}")
    return tokens[: n * seq_len].reshape(n, seq_len)


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _open_cached(bin_path: Path, meta_path: Path, *, verify: bool) -> tuple[np.ndarray, dict]:
    """Open a cache entry; raise CacheError if it is inconsistent."""
    try:
        meta = json.loads(meta_path.read_text())
        n_tokens, dtype, checksum = int(meta["n_tokens"]), np.dtype(meta["dtype"]), meta["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CacheError(f"token cache metadata {meta_path} is unreadable ({exc})") from exc
    if not bin_path.is_file():
        raise CacheError(f"token cache {bin_path} is missing but its metadata {meta_path} exists")
    size = bin_path.stat().st_size
    if size != n_tokens * dtype.itemsize:
        raise CacheError(
            f"token cache {bin_path} has {size} bytes, expected {n_tokens} tokens x {dtype.itemsize} bytes "
            f"= {n_tokens * dtype.itemsize} (truncated or overwritten)"
        )
    if verify and sha256_file(bin_path) != checksum:
        raise CacheError(f"token cache {bin_path} fails its SHA-256 check (corrupt)")
    if n_tokens == 0:
        raise CacheError(f"token cache {bin_path} is empty")
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,)), meta


def _encode_documents(
    docs: Sequence[DocumentSource],
    tokenizer,
    eos_id: int,
    f: BinaryIO,
    dtype: np.dtype,
    batch_docs: int = 64,
) -> tuple[int, str]:
    """Tokenize documents into the open binary file ``f`` (ids of each followed by EOS); return (count, sha256)."""
    digest = hashlib.sha256()
    n_tokens = 0
    eos = np.array([eos_id], dtype=dtype)

    def write(arr: np.ndarray) -> None:
        nonlocal n_tokens
        data = arr.astype(dtype, copy=False).tobytes()
        f.write(data)
        digest.update(data)
        n_tokens += arr.shape[0]

    for start in range(0, len(docs), batch_docs):
        batch = docs[start : start + batch_docs]
        pieces, owner = [], []
        for i, doc in enumerate(batch):
            for piece in _text_pieces(doc.read()):
                if piece:
                    pieces.append(piece)
                    owner.append(i)
        encodings = tokenizer.encode_batch(pieces, add_special_tokens=False) if pieces else []
        per_doc: list[list[np.ndarray]] = [[] for _ in batch]
        for i, enc in zip(owner, encodings, strict=True):
            per_doc[i].append(np.asarray(enc.ids, dtype=np.int64))
        for arrays in per_doc:
            if arrays:
                write(np.concatenate(arrays))
                write(eos)
    return n_tokens, digest.hexdigest()


def tokenize_split(
    docs: Sequence[DocumentSource],
    tokenizer,
    *,
    split: str,
    corpus_fingerprint: dict,
    cache_dir: str | os.PathLike,
    eos_id: int,
    on_corrupt: str = "rebuild",
    verify: bool = True,
) -> TokenStream:
    """The split's token stream from the cache, or tokenized now and cached.

    ``on_corrupt``: ``"rebuild"`` (warn, re-tokenize) or ``"raise"`` (:class:`CacheError`).
    """
    if on_corrupt not in ("rebuild", "raise"):
        raise ValueError(f"on_corrupt must be 'rebuild' or 'raise', got {on_corrupt!r}")
    if not docs:
        raise ValueError(f"split {split!r} has no documents; cannot build a token stream")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = _token_dtype(vocab_size)
    fields = {
        "format": FORMAT_VERSION,
        "corpus": corpus_fingerprint,
        "split": split,
        "tokenizer": _tokenizer_digest(tokenizer),
        "eos_id": eos_id,
        "dtype": dtype.str,
    }
    key = _key(fields)
    bin_path, meta_path = cache_dir / f"tokens-{key}.bin", cache_dir / f"tokens-{key}.json"
    if meta_path.exists():
        try:
            tokens, meta = _open_cached(bin_path, meta_path, verify=verify)
            return TokenStream(split, tokens, bin_path, True, int(meta["n_documents"]))
        except CacheError as exc:
            if on_corrupt == "raise":
                raise
            warnings.warn(f"{exc}; rebuilding it", RuntimeWarning, stacklevel=2)
            meta_path.unlink(missing_ok=True)

    with atomic_write(bin_path, "wb") as f:  # a kill leaves no half cache under the real name
        n_tokens, checksum = _encode_documents(docs, tokenizer, eos_id, f, dtype)
        _PARQUET_SLOT.clear()
        if n_tokens == 0:  # empty documents are skipped, EOS included
            raise ValueError(f"split {split!r}: all {len(docs)} documents are empty")
    meta = {"n_tokens": n_tokens, "dtype": dtype.str, "sha256": checksum, "n_documents": len(docs)}
    meta["key"] = fields  # for a human reading the cache directory
    atomic_write_text(meta_path, json.dumps(meta, indent=1, default=str))
    tokens, _ = _open_cached(bin_path, meta_path, verify=False)
    return TokenStream(split, tokens, bin_path, False, len(docs))


# --------------------------------------------------------------------------- the corpus


@dataclass
class TextCorpus:
    """A tokenized corpus: a tokenizer and one cached token stream per split."""

    tokenizer: object
    splits: dict[str, TokenStream]
    eos_id: int
    description: str
    tokenizer_path: Path | None = None

    @property
    def vocab_size(self) -> int:
        """Number of token ids (special tokens included): the LM's embedding size."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def tokens(self, split: str) -> np.ndarray:
        """The flat token stream [T] of ``split``."""
        if split not in self.splits:
            raise KeyError(f"split {split!r} was not loaded; loaded: {sorted(self.splits)}")
        return self.splits[split].tokens

    def windows(self, split: str, seq_len: int) -> np.ndarray:
        """Packed non-overlapping windows [N, seq_len] of ``split`` (a memmap view)."""
        return pack_windows(self.tokens(split), seq_len)

    def dataset(self, split: str, seq_len: int) -> PackedWindows:
        """A ``torch.utils.data.Dataset`` of packed windows (see :class:`PackedWindows`)."""
        if split not in self.splits:
            raise KeyError(f"split {split!r} was not loaded; loaded: {sorted(self.splits)}")
        return PackedWindows.from_stream(self.splits[split], seq_len)

    def bigram_counts(self) -> BigramCounts:
        """Bigram counts of the train stream, computed once and cached beside its tokens.

        The cache file is ``<train tokens>.bigrams.npz``; a damaged or stale one
        is rebuilt with a warning.
        """
        stream = self.splits.get("train")
        if stream is None:
            raise KeyError("bigram counts need the train split; load it with splits including 'train'")
        path = stream.path.with_name(stream.path.stem + ".bigrams.npz")
        if path.exists():
            try:
                counts = BigramCounts.load(path)
                if counts.n_tokens == stream.tokens.shape[0] and counts.vocab_size == self.vocab_size:
                    return counts
                problem = f"it counts {counts.n_tokens} tokens over vocab {counts.vocab_size}"
            except ValueError as exc:
                problem = str(exc)
            message = f"bigram counts {path} do not match the train split ({problem}); rebuilding"
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        counts = BigramCounts.from_tokens(stream.tokens, self.vocab_size)
        counts.save(path)
        return counts

    def annotate(self, split: str, seq_len: int) -> ARHitAnnotation:
        """AR-hit annotation (SPEC §4.5) of ``split``'s packed windows [N, seq_len]."""
        return annotate_ar_hits(self.windows(split, seq_len), self.bigram_counts())


class PackedWindows(torch.utils.data.Dataset):
    """Packed windows as a map-style torch ``Dataset``.

    Item ``i`` is ``{"input_ids": LongTensor[L], "labels": LongTensor[L]}``
    with ``labels = input_ids`` (the model shifts them, as Hugging Face
    causal LMs do).  Works with ``DistributedSampler``.  Built from a cached
    stream (:meth:`from_stream`, what ``TextCorpus.dataset`` does), it pickles
    as the cache file's path, so DataLoader workers started with ``spawn``
    reopen the memmap instead of receiving a copy of the ids.
    """

    def __init__(self, windows: np.ndarray) -> None:
        if not isinstance(windows, np.ndarray) or windows.ndim != 2:
            raise ValueError(f"windows must be a 2-D numpy array [N, L], got {getattr(windows, 'shape', None)}")
        self.windows = windows
        self._source: tuple[str, str, int, int] | None = None

    @classmethod
    def from_stream(cls, stream: TokenStream, seq_len: int) -> PackedWindows:
        """Windows [N, seq_len] of a cached token stream."""
        dataset = cls(stream.windows(seq_len))
        dataset._source = (str(stream.path), stream.tokens.dtype.str, int(stream.tokens.shape[0]), int(seq_len))
        return dataset

    def __getstate__(self) -> dict:
        if self._source is not None:
            return {"source": self._source}
        return {"source": None, "windows": self.windows}

    def __setstate__(self, state: dict) -> None:
        self._source = state["source"]
        if self._source is None:
            self.windows = state["windows"]
        else:
            path, dtype, n_tokens, seq_len = self._source
            self.windows = pack_windows(np.memmap(path, dtype=np.dtype(dtype), mode="r", shape=(n_tokens,)), seq_len)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> dict:
        ids = torch.from_numpy(np.asarray(self.windows[index], dtype=np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


def load_text_corpus(
    source: str | os.PathLike = "python-docs",
    *,
    tokenizer: object | str | os.PathLike | None = None,
    vocab_size: int = 8192,
    splits: Sequence[str] = SPLITS,
    cache_dir: str | os.PathLike | None = None,
    split_fractions: Sequence[float] = (0.9, 0.05, 0.05),
    split_seed: int = 0,
    text_column: str = "text",
    rows_are_lines: bool | None = None,
    named_splits: bool | None = None,
    eos_token: str | None = None,
    on_corrupt: str = "rebuild",
    verify: bool = True,
) -> TextCorpus:
    """Load, split, tokenize and cache a corpus; see the module docstring for sources.

    Args:
        source: ``"python-docs"``, ``"hf:<name>[:<config>]"`` or a local path.
        tokenizer: a ``tokenizers.Tokenizer``, a ``tokenizer.json`` path or a
            directory with one; ``None`` trains a byte-level BPE of
            ``vocab_size`` on the train split (cached by corpus and size).
        vocab_size: size of the trained BPE (ignored with ``tokenizer``).
        splits: which of ``train``/``validation``/``test`` to tokenize.
        cache_dir: where token ids and trained tokenizers live.
        split_fractions, split_seed: the hash split when files name no split.
        text_column: parquet / Hugging Face column holding the text.
        rows_are_lines: rows are lines of a longer text (WikiText); ``None``
            guesses from the source name.
        named_splits: local files: take splits from file names (``True``),
            hash-split (``False``) or decide from the names (``None``).
        eos_token: the document separator; ``None`` picks a known one.
        on_corrupt: ``"rebuild"`` or ``"raise"`` for a damaged cache.
        verify: check each cache file's SHA-256 on load (one read of the file).

    Returns:
        :class:`TextCorpus`.
    """
    if on_corrupt not in ("rebuild", "raise"):
        raise ValueError(f"on_corrupt must be 'rebuild' or 'raise', got {on_corrupt!r}")
    bad = [s for s in splits if s not in SPLITS]
    if bad or not splits:
        raise ValueError(f"splits must be a non-empty subset of {SPLITS}, got {tuple(splits)}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    files = corpus_files(
        source,
        split_fractions=split_fractions,
        split_seed=split_seed,
        text_column=text_column,
        rows_are_lines=rows_are_lines,
        named_splits=named_splits,
    )
    empty = [s for s in splits if not files.splits[s]]
    if empty:
        sizes = {s: len(d) for s, d in files.splits.items()}
        raise ValueError(
            f"{files.description}: split(s) {empty} have no documents (documents per split: {sizes}); "
            "add documents, name files by split (train/validation/test), or change split_fractions"
        )

    tokenizer_path = None
    if tokenizer is None:
        if not files.splits["train"]:
            raise ValueError(f"{files.description}: no train documents to train a tokenizer on")
        tokenizer, tokenizer_path = _trained_tokenizer(files, vocab_size, cache_dir, eos_token or DEFAULT_EOS)
    else:
        tokenizer = load_tokenizer(tokenizer)
    eos_id = find_eos_id(tokenizer, eos_token)
    streams = {
        split: tokenize_split(
            files.splits[split],
            tokenizer,
            split=split,
            corpus_fingerprint=files.fingerprint,
            cache_dir=cache_dir,
            eos_id=eos_id,
            on_corrupt=on_corrupt,
            verify=verify,
        )
        for split in splits
    }
    return TextCorpus(tokenizer, streams, eos_id, files.description, tokenizer_path)


def _trained_tokenizer(files: CorpusFiles, vocab_size: int, cache_dir: Path, eos_token: str):
    tk = _tokenizers()
    fields = {
        "format": FORMAT_VERSION,
        "corpus": files.fingerprint,
        "vocab_size": vocab_size,
        "eos": eos_token,
        "tokenizers": tk.__version__,
    }
    path = cache_dir / f"tokenizer-{_key(fields)}.json"
    if path.is_file():
        try:
            return tk.Tokenizer.from_file(str(path)), path
        except Exception as exc:  # the Rust parser raises a plain Exception
            message = f"cached tokenizer {path} is unreadable ({exc}); retraining it"
            warnings.warn(message, RuntimeWarning, stacklevel=3)
    cache_dir.mkdir(parents=True, exist_ok=True)
    texts = (doc.read() for doc in files.splits["train"])
    tokenizer = train_bpe_tokenizer(texts, vocab_size, eos_token=eos_token)
    atomic_write_text(path, tokenizer.to_str())
    return tokenizer, path


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m bayeslayer.data.text [--install] [--source S] [--vocab-size V]``: prepare and report."""
    import argparse

    parser = argparse.ArgumentParser(description="Prepare (install, tokenize, cache) a text corpus.")
    parser.add_argument("--source", default="python-docs")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json or a directory holding one")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--install", action="store_true", help="apt-get install python3-doc if missing")
    args = parser.parse_args(argv)
    if args.source == "python-docs":
        print(f"python3-doc HTML at {prepare_default_corpus(install=args.install)}")
    corpus = load_text_corpus(
        args.source, tokenizer=args.tokenizer, vocab_size=args.vocab_size, cache_dir=args.cache_dir
    )
    print(f"{corpus.description}: vocab {corpus.vocab_size}, eos id {corpus.eos_id}")
    for split, stream in corpus.splits.items():
        state = "cached" if stream.from_cache else "tokenized"
        n_tokens = stream.tokens.shape[0]
        print(f"  {split:<10} {stream.n_documents:>6} docs {n_tokens:>11,} tokens ({state}) {stream.path}")


if __name__ == "__main__":
    main()
