"""Does a score flag a wrong answer (bayeslayer.evaluation.variance): the AUROC against a brute-force pair count,
the logistic fit finding the informative feature; one variance score per token (``token_variance``) against
its formula, on a model's outputs and generation, and docs/experiments.md's recipe as written."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from bayeslayer.evaluation.variance import auroc, fit_logistic, token_variance

DOCS = Path(__file__).resolve().parents[2] / "docs" / "experiments.md"


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


def _layers():
    """Three layers of different heads and groups around one without a covariance."""
    g = torch.Generator().manual_seed(0)
    return (1 + torch.rand(2, 5, 2, 3, generator=g, dtype=torch.float64), None,
            1 + torch.rand(2, 5, 4, 1, generator=g, dtype=torch.float64))


def test_token_variance_is_the_mean_over_heads_and_groups_then_layers():
    a, none, b = variances = _layers()
    # per layer the mean over its H·G values, then the layers weigh the same (not their head counts)
    manual = (a.sum((-2, -1)) / 6 + b.sum((-2, -1)) / 4) / 2
    torch.testing.assert_close(token_variance(variances), manual, rtol=1e-15, atol=0)
    assert token_variance(variances).shape == (2, 5) and token_variance(variances).dtype == torch.float64
    torch.testing.assert_close(token_variance(variances, layers="last"), b.mean((-2, -1)), rtol=1e-15, atol=0)
    torch.testing.assert_close(token_variance(variances, layers=0), a.mean((-2, -1)), rtol=1e-15, atol=0)
    torch.testing.assert_close(token_variance(variances, layers=[-1, 0]), manual, rtol=1e-15, atol=0)
    worst = torch.maximum(a.flatten(2).max(-1).values, b.flatten(2).max(-1).values)
    assert torch.equal(token_variance(variances, reduction="max"), worst)
    assert torch.equal(token_variance(variances, layers="last", reduction="max"), b.flatten(2).max(-1).values)


def test_token_variance_of_a_model_output_and_its_gradient():
    from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM

    torch.manual_seed(0)
    model = BayesLayerForCausalLM(BayesLayerConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_heads=2,
                                                   head_dim=8, mixers=["gated_deltanet", "bayesian"]))
    out = model(torch.randint(0, 32, (3, 7)), output_variances=True)
    assert out.variances[0] is None
    score = token_variance(out.variances)
    torch.testing.assert_close(score, out.variances[1].mean((-2, -1)))
    assert (score >= 1).all()  # 1 + qᵀ P q with P positive semi-definite
    score.sum().backward()
    assert model.model.layers[1].attn.q_proj.weight.grad.abs().sum() > 0


def test_the_docs_recipe_runs_and_means_what_it_says():
    [code] = re.findall(r"<!-- recipe: token-variance -->\s*```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    scope: dict = {}
    exec(compile(code, f"{DOCS}:token-variance", "exec"), scope)
    out, model = scope["out"], scope["model"]
    a, none, b = out.variances
    assert none is None and a.shape == b.shape == (2, 12, 2, 1)
    torch.testing.assert_close(scope["score"], (a.mean((-2, -1)) + b.mean((-2, -1))) / 2)
    torch.testing.assert_close(scope["last"], b.mean((-2, -1)))
    assert torch.equal(scope["worst"], torch.maximum(a.amax((-2, -1)), b.amax((-2, -1))))
    assert scope["flagged"].sum() == 3  # the top tenth of 24 scores (ties have probability zero)
    gen, per_token = scope["gen"], scope["per_token"]
    assert torch.equal(gen.sequences[:, :4], scope["ids"][:, :4])
    assert per_token.shape == (2, 6) and gen.sequences.shape == (2, 7)
    with torch.no_grad():  # through the cache: the values of a full forward over the same tokens
        full = model(gen.sequences[:, :-1], output_variances=True).variances
    torch.testing.assert_close(per_token, token_variance(full))


@pytest.mark.parametrize("call, error, needle", [
    (lambda v: token_variance(v[0]), TypeError, "tuple of per-layer tensors"),
    (lambda v: token_variance((None, None)), ValueError, "no layer with a variance"),
    (lambda v: token_variance((v[0][0],)), ValueError, r"variances\[0\] must be a float tensor \[B, T, H, G\]"),
    (lambda v: token_variance((v[0].long(),)), ValueError, "float tensor"),
    (lambda v: token_variance((v[0], v[2][:, :3])), ValueError, "share"),
    (lambda v: token_variance(v, layers="first"), ValueError, "'all', 'last' or layer indices"),
    (lambda v: token_variance(v, layers=[]), ValueError, "non-empty list"),
    (lambda v: token_variance(v, layers=True), ValueError, "layer indices"),
    (lambda v: token_variance(v, layers=3), ValueError, "indices of the 3 layers"),
    (lambda v: token_variance(v, layers=1), ValueError, r"layers \[1\] have no variance"),
    (lambda v: token_variance(v, reduction="median"), ValueError, "reduction must be one of"),
])
def test_token_variance_refuses_bad_input_by_name(call, error, needle):
    with pytest.raises(error, match=needle):
        call(_layers())
