"""The token cache: each split's token ids tokenized once and kept on disk as a raw array.

See :mod:`bayeslayer.data.text` for the cache layout, its key and how damage is handled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from bayeslayer.files import atomic_write, atomic_write_text, sha256_file

from .sources import DocumentSource, release_parquet_rows
from .tokenizer import tokenizer_digest
from .windows import pack_windows

# Bump when text extraction, splitting or the stream layout changes: it invalidates caches.
FORMAT_VERSION = 1
# Long single documents are tokenized in pieces of about this many characters.
ENCODE_PIECE_CHARS = 1 << 20


class CacheError(RuntimeError):
    """A token cache file is truncated, corrupt or inconsistent with its metadata."""


def default_cache_dir() -> Path:
    """``$BAYESLAYER_CACHE`` or ``~/.cache/bayeslayer``."""
    env = os.environ.get("BAYESLAYER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "bayeslayer"


_SAFE_CUT = re.compile(r"\n(?=[^\s]| [^\s])")


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


def cache_key(fields: dict) -> str:
    """The 24-hex-digit key of a cache entry: a hash of everything its content depends on."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]


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
        "tokenizer": tokenizer_digest(tokenizer),
        "eos_id": eos_id,
        "dtype": dtype.str,
    }
    key = cache_key(fields)
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
        release_parquet_rows()
        if n_tokens == 0:  # empty documents are skipped, EOS included
            raise ValueError(f"split {split!r}: all {len(docs)} documents are empty")
    meta = {"n_tokens": n_tokens, "dtype": dtype.str, "sha256": checksum, "n_documents": len(docs)}
    meta["key"] = fields  # for a human reading the cache directory
    atomic_write_text(meta_path, json.dumps(meta, indent=1, default=str))
    tokens, _ = _open_cached(bin_path, meta_path, verify=False)
    return TokenStream(split, tokens, bin_path, False, len(docs))
