"""Does a score flag a wrong answer?  The analysis of ``bayeslayer variance`` (docs/theory.md: the Bayesian Layer's
predictive variance ``1 + q_tᵀ P_t q_t``), for any per-query scores.

* :func:`token_variance`: one variance score per token ``[B, T]`` from a model's per-layer variances
  (``output_variances=True`` gives ``[B, T, H, G]`` per layer): the mean over heads, groups and layers,
  the last layer's, or the largest;
* :func:`auroc`: the area under the ROC curve of a score for a boolean label (ties count half);
* :func:`fit_logistic`: a logistic regression on standardised features (Newton steps, a small ridge);
* :func:`score_queries`: each score's AUROC for a wrong answer on a held-out half of the queries, a logistic
  combination of (log variance, entropy) fitted on the other half, the accuracy per decile of each score and
  per condition.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

#: The accuracy is shown per decile of a score.
QUANTILES = 10
#: How :func:`token_variance` reduces over layers, heads and groups.
REDUCTIONS = ("mean", "max")


def token_variance(variances: Sequence[torch.Tensor | None], *, layers: str | int | Sequence[int] = "all",
                   reduction: str = "mean") -> torch.Tensor:
    """One predictive-variance score per token, ``[B, T]``, from a model's per-layer variances.

    ``variances``: one entry per layer, the layer's predictive variance ``v_l = 1 + q_tᵀ P_t q_t``
    ``[B, T, H, G]`` (a Bayesian Layer: ``H`` heads, ``G`` groups of value columns) or ``None`` (a layer
    without a covariance) — the ``variances`` of ``model(ids, output_variances=True)``, or one entry of
    ``generate(..., output_variances=True, return_dict_in_generate=True).variances`` (the forward that
    produced a token: the prompt, then ``T = 1``).  ``layers``: ``"all"`` (every layer with a variance),
    ``"last"`` (the last of them), or model layer indices (an int or a list; ``None`` layers count).
    ``reduction``:

    * ``"mean"``: per layer the mean over heads and groups, then the mean over the chosen layers ``L``
      (each layer weighs the same whatever its heads)::

          s[b, t] = (1/|L|) Σ_{l∈L} (1/(H_l·G_l)) Σ_{h,g} v_l[b, t, h, g]

    * ``"max"``: the largest ``v_l[b, t, h, g]`` over the chosen layers, heads and groups (the least
      certain head).

    A larger score: the memory knows the queried direction less well.  ``bayeslayer variance`` scores a
    query token by ``layers="last"`` (``variance_last``) and ``layers="all"`` (``variance_mean``), both
    with ``"mean"``.  Returns a tensor of the variances' dtype and device; gradients flow through it.
    """
    if isinstance(variances, torch.Tensor) or not isinstance(variances, (list, tuple)):
        raise TypeError("variances must be a tuple of per-layer tensors [B, T, H, G] or None (the .variances of "
                        f"an output with output_variances=True), got {type(variances).__name__}")
    for i, v in enumerate(variances):
        if v is not None and not (isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point()):
            got = f"shape {tuple(v.shape)}, {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"variances[{i}] must be a float tensor [B, T, H, G] or None, got {got}")
    present = [i for i, v in enumerate(variances) if v is not None]
    if not present:
        raise ValueError("variances holds no layer with a variance (all None): the model has no Bayesian Layer")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(layers, str):
        if layers not in ("all", "last"):
            raise ValueError(f"layers must be 'all', 'last' or layer indices, got {layers!r}")
        chosen = present if layers == "all" else present[-1:]
    else:
        chosen = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
        if (not isinstance(chosen, (list, tuple)) or not chosen
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in chosen)):
            raise ValueError(f"layers must be 'all', 'last' or layer indices (an int or a non-empty list), "
                             f"got {layers!r}")
        n = len(variances)
        if any(not -n <= i < n for i in chosen):
            raise ValueError(f"layers {list(chosen)} must be indices of the {n} layers")
        chosen = sorted({i % n for i in chosen})
        missing = [i for i in chosen if variances[i] is None]
        if missing:
            raise ValueError(f"layers {missing} have no variance (no covariance); layers with one: {present}")
    picked = [variances[i] for i in chosen]
    if len({tuple(v.shape[:2]) for v in picked}) != 1:
        raise ValueError(f"the layers' variances must share [B, T], got {[tuple(v.shape) for v in picked]}")
    if reduction == "mean":
        return torch.stack([v.mean(dim=(-2, -1)) for v in picked]).mean(0)
    return torch.stack([v.amax(dim=(-2, -1)) for v in picked]).amax(0)


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


__all__ = ["QUANTILES", "REDUCTIONS", "auroc", "fit_logistic", "score_queries", "token_variance"]
