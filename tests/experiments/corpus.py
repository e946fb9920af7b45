"""A small English-like text corpus the experiment tests write (no network, no python3-doc)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WORDS = ("the cat sat on a mat while dog ran far from home and bird sang song under old tree "
         "every morning river flows past stone bridge near quiet town where people read books").split()
# three short essays for NIAH's essay haystacks (sentences ending in ., ! and ?)
ESSAYS = [
    "The history of the town begins with a small market by the river. Traders came from the hills to sell "
    "wool and grain. Over the years the market grew into a busy port, and the port became a city. "
    "Its harbour was deep enough for ships that crossed the sea.",
    "Engineers later built a stone bridge across the water! It carried carts, then trains, then cars. "
    "Nobody remembers who designed it, but everyone crosses it every day. The arches were repaired twice.",
    "In winter the river freezes and children skate on it. Old people say the ice was thicker when they "
    "were young? The records agree with them, mostly. Spring floods come in April and leave fertile mud "
    "on the fields, which is why farmers have always stayed close to the water despite the danger.",
]


def write_word_corpus(root: Path, docs: dict[str, int], *, sentences: int, words: tuple[int, int] = (5, 12),
                      repeat_phrase: bool = False) -> Path:
    """``<root>/<split>.txt`` for each ``split: n_docs`` of ``docs``: documents of ``sentences`` random
    sentences of ``words[0] … words[1] − 1`` words, joined by blank lines (seeded, so identical each run).
    ``repeat_phrase`` puts one 6-word phrase at sentences 3 and 9 of every document, so AR-hit tokens exist."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for split, n_docs in docs.items():
        texts = []
        for _ in range(n_docs):
            phrase = " ".join(rng.choice(WORDS, size=6)) if repeat_phrase else None
            lines = [" ".join(rng.choice(WORDS, size=rng.integers(*words))) for _ in range(sentences)]
            if phrase is not None:
                lines[3] = lines[9] = phrase
            texts.append(". ".join(lines) + ".")
        (root / f"{split}.txt").write_text("\n\n".join(texts))
    return root
