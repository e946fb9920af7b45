"""Shared set-up of the NIAH tests: a BPE tokenizer trained on the essays, RULER's template and noise, and a
generator over it."""

from __future__ import annotations

import pytest

from bayeslayer.data import niah as data_niah
from bayeslayer.data.text import train_bpe_tokenizer
from tests.experiments.corpus import ESSAYS

TEMPLATE = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the numbers afterwards. What are all the special magic numbers for "
            "calm-river mentioned in the provided text? The special magic uuids for it mentioned in the "
            "provided text are: One of the special magic numbers for calm-river is: 1234567. A number is.")


@pytest.fixture(scope="module")
def tokenizer():
    texts = ESSAYS * 4 + [data_niah.NOISE_PARAGRAPH] * 4 + [TEMPLATE] * 8 + [" ".join(data_niah.WORDS[::7])] * 2 \
        + ["0123456789 abcdef 4a1f-9b2c-e3d0 " * 10]
    return train_bpe_tokenizer(texts, 1000)


@pytest.fixture(scope="module")
def generator(tokenizer):
    return data_niah.NiahGenerator(tokenizer, ESSAYS, seed=0)


__all__ = ["TEMPLATE", "generator", "tokenizer"]
