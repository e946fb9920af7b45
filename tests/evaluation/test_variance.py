"""Does a score flag a wrong answer (bayeslayer.evaluation.variance): the AUROC against a brute-force pair count,
the logistic fit finding the informative feature."""

import numpy as np
import pytest

from bayeslayer.evaluation.variance import auroc, fit_logistic


def test_auroc_counts_pairs_and_half_ties():
    assert auroc(np.array([0.1, 0.2, 0.8, 0.9]), np.array([False, False, True, True])) == 1.0
    assert auroc(np.array([0.9, 0.8, 0.2, 0.1]), np.array([False, False, True, True])) == 0.0
    assert auroc(np.ones(4), np.array([False, True, False, True])) == 0.5
    # against a brute-force count over all (positive, negative) pairs, ties counting half
    rng = np.random.default_rng(0)
    s, y = rng.integers(0, 5, 200).astype(float), rng.random(200) < 0.3
    pairs = s[y][:, None] - s[~y][None, :]
    assert auroc(s, y) == pytest.approx(((pairs > 0).sum() + 0.5 * (pairs == 0).sum()) / pairs.size)
    assert auroc(s, np.zeros(200, bool)) is None
    with pytest.raises(ValueError, match="1-D"):
        auroc(s, y[:10])


def test_logistic_fit_finds_the_informative_feature():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 2))
    y = (x[:, 1] + 0.3 * rng.normal(size=400)) > 0
    predict = fit_logistic(x[:200], y[:200])
    assert auroc(predict(x[200:]), y[200:]) > 0.9
    assert auroc(predict(x[200:]), y[200:]) > auroc(x[200:, 0], y[200:])
