"""Tokenizers: load one, train a byte-level BPE, find the end-of-text token."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
DEFAULT_EOS = "<|endoftext|>"


def tokenizers_package():
    """The ``tokenizers`` package, or an ``ImportError`` that says how to install it."""
    try:
        import tokenizers
    except ImportError as exc:
        raise ImportError("text corpora need the `tokenizers` package: pip install tokenizers") from exc
    return tokenizers


def load_tokenizer(tokenizer) -> object:
    """A ``tokenizers.Tokenizer`` from an instance, a ``tokenizer.json`` path, a directory
    holding one (e.g. a downloaded Hugging Face model), or a transformers fast tokenizer."""
    tk = tokenizers_package()
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
    tk = tokenizers_package()
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


def tokenizer_digest(tokenizer) -> str:
    """SHA-256 of the tokenizer's full JSON: part of every token cache key."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
