"""Fixtures for the lm-eval bridge tests: a tiny tokenizer, a tiny BL/GDN hybrid and a retrofitted
GDN saved to disk, and an offline environment (nothing here may touch the network)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bayeslayer.data.text import find_eos_id, train_bpe_tokenizer
from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM, replace_layers

from ..experiments.corpus import ESSAYS, WORDS  # noqa: F401 (re-exported to the tests here)

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="session", autouse=True)
def offline():
    """HF_HUB_OFFLINE/HF_DATASETS_OFFLINE for these tests (and the constants read at import time)."""
    mp = pytest.MonkeyPatch()
    for key, value in OFFLINE.items():
        mp.setenv(key, value)
    import datasets.config
    import huggingface_hub.constants

    mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    yield
    mp.undo()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one intra-op thread (two threads spin-wait on a busy shared machine, e.g. a
    depthwise conv1d of a decode step took 16 ms instead of 0.8 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def word_text(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n))


@pytest.fixture(scope="session")
def tokenizer():
    rng = np.random.default_rng(0)
    texts = [word_text(rng, 40) + "." for _ in range(60)] + ESSAYS * 4
    from bayeslayer.data.niah import NOISE_PARAGRAPH, TASKS, prompt_template

    texts += [NOISE_PARAGRAPH] * 4 + [" ".join(prompt_template(t, ["calm-river"] * TASKS[t].num_queries))
                                      for t in TASKS] * 4
    return train_bpe_tokenizer(texts, 600)


def _save(model, path, tokenizer):
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def tiny_config(tokenizer, mixers) -> BayesLayerConfig:
    eos = find_eos_id(tokenizer)
    return BayesLayerConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=len(mixers),
                            num_heads=2, head_dim=8, mixers=list(mixers), bos_token_id=None, eos_token_id=eos,
                            pad_token_id=eos)


@pytest.fixture(scope="session")
def bl_dir(tmp_path_factory, tokenizer):
    """A BL + GDN hybrid, saved with its tokenizer.json (what our pipelines write)."""
    torch.manual_seed(0)
    model = BayesLayerForCausalLM(tiny_config(tokenizer, ["bayesian", "gated_deltanet"])).eval()
    return _save(model, tmp_path_factory.mktemp("bl"), tokenizer)


@pytest.fixture(scope="session")
def retrofit_dir(tmp_path_factory, tokenizer):
    """A two-layer Gated DeltaNet whose layer 1 is swapped for a Bayesian Layer (models/retrofit.py)."""
    torch.manual_seed(1)
    model = BayesLayerForCausalLM(tiny_config(tokenizer, ["gated_deltanet", "gated_deltanet"])).eval()
    replace_layers(model, [1], mixer="bayesian", init_from="teacher")
    return _save(model.eval(), tmp_path_factory.mktemp("retrofit"), tokenizer)


@pytest.fixture(scope="session")
def fla_gdn_dir(tmp_path_factory, tokenizer):
    """A flash-linear-attention Gated DeltaNet checkpoint written by fla itself, with our tokenizer.json."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Triton is not supported on current platform"
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    torch.manual_seed(2)
    eos = find_eos_id(tokenizer)
    model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8,
        expand_v=2, hidden_ratio=2, fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False,
        bos_token_id=None, eos_token_id=eos, pad_token_id=eos))
    return _save(model, tmp_path_factory.mktemp("fla_gdn"), tokenizer)


@pytest.fixture(scope="session")
def model_dirs(bl_dir, retrofit_dir, fla_gdn_dir):
    return {"bl": bl_dir, "retrofit": retrofit_dir, "fla_gdn": fla_gdn_dir}

