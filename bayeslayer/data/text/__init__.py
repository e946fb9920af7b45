"""Text corpora for language modelling: load, split, tokenize, cache, pack.

A corpus becomes, per split, one flat stream of token ids (each non-empty
document followed by an end-of-text token), cached on disk as a raw numpy array and
opened as a read-only ``np.memmap``; packed windows are non-overlapping
``[N, seq_len]`` views of that stream (the tail shorter than one window is
dropped)::

    corpus = load_text_corpus("python-docstrings", vocab_size=8192)
    windows = corpus.windows("validation", seq_len=2048)  # np.ndarray [N, 2048]
    dataset = corpus.dataset("train", seq_len=2048)  # torch Dataset of {"input_ids", "labels"}

Sources (``source`` argument):

* ``"python-docstrings"`` (default): the docstrings of the running Python's
  standard library, read from its ``.py`` files with :mod:`ast` (nothing is
  imported or run), one document per module, test packages left out: about
  1.8 MB of English on CPython 3.11, on every machine with Python, offline.
* ``"python-docs"``: the English prose of Python's documentation
  from Debian's ``python3-doc`` package, HTML stripped to text with
  :mod:`html.parser` (code blocks, navigation and index pages dropped).  Install it
  once with ``apt-get install -y python3-doc`` (as root; the library never runs it:
  without the package, loading raises :class:`CorpusNotFoundError` naming that command).
* ``"hf:<name>[:<config>]"``: a Hugging Face dataset through the optional
  ``datasets`` package, with its own train/validation/test splits; e.g.
  ``"hf:Salesforce/wikitext:wikitext-103-raw-v1"`` (the paper's corpus, also
  named ``"wikitext-103"``).
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

The package has one module per job; this ``__init__`` re-exports their public names, so
``from bayeslayer.data.text import X`` works for all of them:

* :mod:`~bayeslayer.data.text.htmltext`: HTML to text (:func:`html_to_text`);
* :mod:`~bayeslayer.data.text.sources`: sources and splits (:func:`corpus_files`, :func:`hash_split`,
  the default corpus);
* :mod:`~bayeslayer.data.text.tokenizer`: loading and training tokenizers, the end-of-text token;
* :mod:`~bayeslayer.data.text.cache`: the token cache (:func:`tokenize_split`, :class:`TokenStream`);
* :mod:`~bayeslayer.data.text.windows`: packed windows (:func:`pack_windows`, :class:`PackedWindows`);
* :mod:`~bayeslayer.data.text.corpus`: all of it together (:func:`load_text_corpus`, :class:`TextCorpus`)
  and ``python -m bayeslayer.data.text``.
"""

from .cache import ENCODE_PIECE_CHARS, FORMAT_VERSION, CacheError, TokenStream, default_cache_dir, tokenize_split
from .corpus import TextCorpus, load_text_corpus, main
from .htmltext import html_to_text
from .sources import (
    HTML_SUFFIXES,
    NAMED_SOURCES,
    PARQUET_SUFFIXES,
    PYTHON_DOCS,
    PYTHON_DOCS_DIRS,
    PYTHON_DOCS_GLOB,
    PYTHON_DOCS_INSTALL,
    PYTHON_DOCSTRINGS,
    SOURCE_ALIASES,
    SOURCE_HELP,
    SPLIT_ALIASES,
    SPLITS,
    TEXT_SUFFIXES,
    CorpusFiles,
    CorpusNotFoundError,
    DocumentSource,
    corpus_files,
    hash_split,
    hf_corpus_files,
    local_corpus_files,
    prepare_default_corpus,
    python_docs_dir,
    python_docs_files,
    python_docstrings_files,
    split_wikitext_articles,
    stdlib_docstrings,
    stdlib_root,
)
from .tokenizer import DEFAULT_EOS, EOS_CANDIDATES, find_eos_id, load_tokenizer, train_bpe_tokenizer
from .windows import PackedWindows, pack_windows

__all__ = [
    "DEFAULT_EOS", "ENCODE_PIECE_CHARS", "EOS_CANDIDATES", "FORMAT_VERSION", "HTML_SUFFIXES", "NAMED_SOURCES",
    "PARQUET_SUFFIXES", "PYTHON_DOCS", "PYTHON_DOCSTRINGS", "PYTHON_DOCS_DIRS", "PYTHON_DOCS_GLOB",
    "PYTHON_DOCS_INSTALL", "SOURCE_ALIASES", "SOURCE_HELP", "SPLITS", "SPLIT_ALIASES", "TEXT_SUFFIXES",
    "CacheError", "CorpusFiles", "CorpusNotFoundError", "DocumentSource", "PackedWindows", "TextCorpus",
    "TokenStream", "corpus_files", "default_cache_dir", "find_eos_id", "hash_split", "hf_corpus_files",
    "html_to_text", "load_text_corpus", "load_tokenizer", "local_corpus_files", "main", "pack_windows",
    "prepare_default_corpus", "python_docs_dir", "python_docs_files", "python_docstrings_files",
    "split_wikitext_articles", "stdlib_docstrings", "stdlib_root", "tokenize_split", "train_bpe_tokenizer",
]
