"""Does a score flag a wrong answer?  The analysis of ``bayeslayer variance`` (docs/theory.md: the Bayesian Layer's
predictive variance ``1 + q_tᵀ P_t q_t``), for any per-query scores.

* :func:`auroc`: the area under the ROC curve of a score for a boolean label (ties count half);
* :func:`fit_logistic`: a logistic regression on standardised features (Newton steps, a small ridge);
* :func:`score_queries`: each score's AUROC for a wrong answer on a held-out half of the queries, a logistic
  combination of (log variance, entropy) fitted on the other half, the accuracy per decile of each score and
  per condition.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: The accuracy is shown per decile of a score.
QUANTILES = 10


def auroc(score: np.ndarray, positive: np.ndarray) -> float | None:
    """Area under the ROC curve of ``score`` for the boolean ``positive`` (ties count half): the chance that
    a random positive scores above a random negative.  ``None`` when one class is empty."""
    score, positive = np.asarray(score, dtype=np.float64), np.asarray(positive, dtype=bool)
    if score.shape != positive.shape or score.ndim != 1:
        raise ValueError(f"score and positive must be 1-D of one length, got {score.shape} and {positive.shape}")
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]  # 1-based average ranks
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def fit_logistic(x: np.ndarray, y: np.ndarray, ridge: float = 1e-3, iterations: int = 50):
    """Logistic regression ``P(y) = σ(w·z + b)`` on standardised features ``z`` (Newton steps, a small ridge
    on ``w``); returns ``predict(x) -> logit``."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    mu, sd = x.mean(0), x.std(0)
    sd = np.where(sd > 0, sd, 1.0)
    z = np.concatenate([(x - mu) / sd, np.ones((len(x), 1))], 1)
    w = np.zeros(z.shape[1])
    penalty = np.diag([ridge] * (z.shape[1] - 1) + [0.0])
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-(z @ w)))
        grad = z.T @ (p - y) / len(y) + penalty @ w
        hess = (z * (p * (1 - p))[:, None]).T @ z / len(y) + penalty + 1e-9 * np.eye(len(w))
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    return lambda xs: np.concatenate([(np.asarray(xs, dtype=np.float64) - mu) / sd,
                                      np.ones((len(xs), 1))], 1) @ w


def score_queries(queries: dict[str, np.ndarray], seed: int) -> dict[str, Any]:
    """AUROCs for a wrong answer on a held-out half, per-decile accuracies and the accuracy per condition."""
    correct = queries["correct"].astype(bool)
    wrong = ~correct
    n = correct.size
    perm = np.random.default_rng(seed).permutation(n)
    fit, test = perm[: n // 2], perm[n // 2:]
    features = np.stack([np.log(queries["variance_last"]), queries["entropy"]], 1)
    result: dict[str, Any] = {"queries": int(n), "accuracy": float(correct.mean()),
                              "held_out_queries": int(test.size), "held_out_wrong": int(wrong[test].sum())}
    for key in ("variance_last", "variance_mean", "entropy"):
        result[f"auroc_{key}"] = auroc(queries[key][test], wrong[test])
    if wrong[fit].any() and correct[fit].any():
        result["auroc_combined"] = auroc(fit_logistic(features[fit], wrong[fit])(features[test]), wrong[test])
    else:
        result["auroc_combined"] = None
    for key in ("variance_last", "entropy"):
        edges = np.quantile(queries[key], np.linspace(0, 1, QUANTILES + 1))
        bins = np.clip(np.searchsorted(edges, queries[key], side="right") - 1, 0, QUANTILES - 1)
        result[f"accuracy_by_{key}_decile"] = [float(correct[bins == b].mean()) if (bins == b).any() else None
                                               for b in range(QUANTILES)]
    result["by_condition"] = {
        int(c): {"accuracy": float(correct[queries["condition"] == c].mean()),
                 "variance_last": float(np.median(queries["variance_last"][queries["condition"] == c])),
                 "auroc_variance_last": auroc(queries["variance_last"][queries["condition"] == c],
                                              wrong[queries["condition"] == c]),
                 "auroc_entropy": auroc(queries["entropy"][queries["condition"] == c],
                                        wrong[queries["condition"] == c])}
        for c in np.unique(queries["condition"])}
    return result


__all__ = ["QUANTILES", "auroc", "fit_logistic", "score_queries"]
