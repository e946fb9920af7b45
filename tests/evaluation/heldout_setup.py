"""Shared set-up of the held-out tests: a tiny word corpus, its BPE tokenizer, two one-layer model folders
(GDN and BL) and a hand-computed perplexity."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from bayeslayer.data.text import train_bpe_tokenizer
from bayeslayer.evaluation.heldout import evaluate_heldout
from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM
from tests.experiments.corpus import write_word_corpus


def write_corpus(root: Path) -> Path:
    return write_word_corpus(root, {"train": 30, "validation": 4, "test": 6}, sentences=10, words=(4, 10))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("heldout_corpus") / "text")


@pytest.fixture(scope="module")
def tokenizer(corpus_dir):
    return train_bpe_tokenizer([(corpus_dir / "train.txt").read_text()], 300)


def tiny_model(vocab: int, mixer: str, seed: int) -> BayesLayerForCausalLM:
    torch.manual_seed(seed)
    config = BayesLayerConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=8,
                              mixer=mixer, mlp_dropout=0.0)
    return BayesLayerForCausalLM(config).eval()


def model_dir(path: Path, tokenizer, mixer: str, seed: int, *, with_tokenizer: bool = True) -> Path:
    tiny_model(tokenizer.get_vocab_size(with_added_tokens=True), mixer, seed).save_pretrained(path)
    if with_tokenizer:
        tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heldout_models")
    return {"GDN": model_dir(root / "gdn", tokenizer, "gated_deltanet", 1),
            "BL": model_dir(root / "bl", tokenizer, "bayesian", 0)}


def hand_ppl(model, windows: np.ndarray, scored: np.ndarray | None = None) -> tuple[float, int]:
    """exp(mean CE) with each window run alone from an empty state, log-softmax in float64."""
    total, n = 0.0, 0
    for i, row in enumerate(windows):
        ids = torch.from_numpy(np.asarray(row, dtype=np.int64))[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
        ce = -logp[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
        keep = torch.ones_like(ce, dtype=torch.bool) if scored is None else torch.from_numpy(scored[i].copy())
        total += float(ce[keep].sum())
        n += int(keep.sum())
    return math.exp(total / n), n


def evaluate_tiny(model_dirs, corpus_dir, cache, **kwargs):
    """``evaluate_heldout`` of the BL and GDN folders on the tiny corpus at lengths 16, 32 and one too long."""
    args = dict(split="test", reference="GDN", batch_size=2, device="cpu", cache_dir=cache, progress=False)
    args.update(kwargs)
    models = [("BL", model_dirs["BL"]), ("GDN", model_dirs["GDN"])]
    return evaluate_heldout(models, [f"tiny={corpus_dir}"], [16, 32, 1_000_000], **args)


__all__ = ["corpus_dir", "evaluate_tiny", "hand_ppl", "model_dir", "model_dirs", "tiny_model", "tokenizer",
           "write_corpus"]
