"""The essay haystack of NIAH: a split the corpus does not have is an error listing the splits it has
(it used to fall back to every document without a word)."""

from __future__ import annotations

import pytest

from bayeslayer.data.niah import load_essays

from ..experiments.corpus import write_word_corpus


def test_an_unknown_haystack_split_lists_the_valid_ones(tmp_path):
    source = write_word_corpus(tmp_path / "text", {"train": 3, "validation": 2, "test": 2}, sentences=4)
    assert load_essays(str(source), "test")
    with pytest.raises(ValueError, match=r"haystack split 'nosuch' is not a split of .*; its splits are "
                                         r"test, train, validation"):
        load_essays(str(source), "nosuch")
