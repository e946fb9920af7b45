"""The corpus: a tokenizer and one cached token stream per split, loaded by :func:`load_text_corpus`."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bayeslayer.checks import INT_MAX, check_int
from bayeslayer.data.arhit import ARHitAnnotation, BigramCounts, annotate_ar_hits
from bayeslayer.files import atomic_write_text

from .cache import FORMAT_VERSION, TokenStream, cache_key, default_cache_dir, tokenize_split
from .sources import PYTHON_DOCS_INSTALL, SOURCE_HELP, SPLITS, CorpusFiles, corpus_files, prepare_default_corpus
from .tokenizer import DEFAULT_EOS, find_eos_id, load_tokenizer, tokenizers_package, train_bpe_tokenizer
from .windows import PackedWindows, pack_windows


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
        """AR-hit annotation (docs/theory.md §8.5) of ``split``'s packed windows [N, seq_len]."""
        return annotate_ar_hits(self.windows(split, seq_len), self.bigram_counts())


def load_text_corpus(
    source: str | os.PathLike = "python-docstrings",
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
        source: ``"python-docstrings"``, ``"python-docs"``, ``"wikitext-103"``,
            ``"hf:<name>[:<config>]"`` or a local path.
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
    check_int("vocab_size", vocab_size, minimum=-INT_MAX)  # its range is the tokenizer's to check
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
    tk = tokenizers_package()
    fields = {
        "format": FORMAT_VERSION,
        "corpus": files.fingerprint,
        "vocab_size": vocab_size,
        "eos": eos_token,
        "tokenizers": tk.__version__,
    }
    path = cache_dir / f"tokenizer-{cache_key(fields)}.json"
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
    """``python -m bayeslayer.data.text [--source S] [--vocab-size V]``: tokenize, cache and report."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bayeslayer.data.text",
                                     description="Prepare (tokenize and cache) a text corpus. The default, "
                                     "python-docstrings, is on every machine; python-docs must be installed first: "
                                     + PYTHON_DOCS_INSTALL + " (as root).")
    parser.add_argument("--source", default="python-docstrings", help=SOURCE_HELP)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json or a directory holding one")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    if args.source == "python-docs":
        print(f"python3-doc HTML at {prepare_default_corpus()}")
    corpus = load_text_corpus(
        args.source, tokenizer=args.tokenizer, vocab_size=args.vocab_size, cache_dir=args.cache_dir
    )
    print(f"{corpus.description}: vocab {corpus.vocab_size}, eos id {corpus.eos_id}")
    for split, stream in corpus.splits.items():
        state = "cached" if stream.from_cache else "tokenized"
        n_tokens = stream.tokens.shape[0]
        print(f"  {split:<10} {stream.n_documents:>6} docs {n_tokens:>11,} tokens ({state}) {stream.path}")

