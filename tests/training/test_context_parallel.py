"""Context-parallel training: the one training loop with a context-parallel group (gloo, CPU, ranks started
here by ``torch.multiprocessing.spawn``; workers in ``tests/training/cp_train_workers.py``) against one
process training on whole windows.  The default suite's two ranks are the suite's one two-rank job
(``tests/two_rank_job.py``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.multiprocessing as mp

from bayeslayer.training.distributed import init_distributed

from ..two_rank_job import records
from . import cp_train_workers
from .agreement import check_against_one_process

TOL64 = 1e-10


def spawn(tmp_path, world: int, fn, *args) -> list:
    mp.spawn(fn, args=(world, str(tmp_path / "init"), str(tmp_path), *args), nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def check(results: list, tol_losses: float, tol_weights: float) -> None:
    main = results[0]
    check_against_one_process(main, tol_losses, tol_weights)
    for r in results:
        assert r["ranks_agree"] == 0.0 and r["losses"] == main["losses"]


@pytest.fixture(scope="module")
def two_ranks(two_rank_job):
    """cp_train_workers.default_suite, run by the default suite's one two-rank job (tests/two_rank_job.py)."""
    return records(two_rank_job, "cp_train")


def test_two_ranks_train_like_one_process_float64(two_ranks):
    """3 AdamW steps, 4 windows of 40 tokens per step in 2 micro-batches, each window split over 2 ranks."""
    check([r["float64"] for r in two_ranks], TOL64, TOL64)


@pytest.mark.slow
def test_two_ranks_train_like_one_process_float32(tmp_path):
    # float32: the slices' sums and the gradients' all-reduce add in another order than one process, and AdamW
    # turns gradient entries of rounding size into updates of up to lr (3e-2) in either direction: weights
    # measured 4.5e-3 of a parameter's largest entry (losses 2.3e-7), where float64 agrees to 7e-12
    check(spawn(tmp_path, 2, cp_train_workers.train_case, 2, "float32", 3, 4, 2), 1e-5, 1e-2)


@pytest.mark.slow
def test_context_parallel_times_data_parallel_trains_like_one_process(tmp_path):
    """4 ranks: 2 replicas of a 2-rank context-parallel group."""
    check(spawn(tmp_path, 4, cp_train_workers.train_case, 2, "float64", 3, 4, 1), TOL64, TOL64)


def test_the_readme_recipe_trains_on_two_ranks(two_ranks):
    """README's context-parallel training recipe runs as written: 3 steps, one group of 2 ranks sharing every
    window, so both ranks report the same finite losses."""
    got = [r["readme"] for r in two_ranks]
    assert all(g["steps"] == 3 and g["cp_size"] == 2 and len(g["losses"]) == 3 for g in got)
    assert all(math.isfinite(x) and x > 0 for x in got[0]["losses"])
    assert got[0]["losses"] == got[1]["losses"]


def test_bad_setups_are_refused_by_name(two_ranks):
    for got in (r["bad"] for r in two_ranks):
        assert "layer 1's mixer 'attention' cannot run with cp_context" in got["attention"]
        assert "layer 0's mixer 'mamba2' cannot run with cp_context" in got["mamba2"]
        assert "context_parallel=3 must divide the number of ranks (2)" in got["divide"]
        assert "trainee must be a NextTokenTrainee" in got["trainee"] and "Linear" in got["trainee"]
        assert "input_ids must be [b, " in got["slice"] and "cp_window_slice" in got["slice"]


def test_context_parallel_needs_ranks():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ValueError, match="context_parallel=2 must divide the number of ranks \\(1\\)"):
        init_distributed(torch.device("cpu"), context_parallel=2)
    with pytest.raises(ValueError, match="context_parallel must be a positive int"):
        init_distributed(torch.device("cpu"), context_parallel=0)


@pytest.mark.parametrize(
    "mixers, kwargs, expected",
    [
        (["bayesian", "bayesian"], None, 4),
        (["bayesian"], {"bayesian": {"use_short_conv": False}}, None),
        (["bayesian", "gated_deltanet"], None, "layer 1's mixer 'gated_deltanet' cannot run with cp_context: it has"),
        (["bayesian"], {"bayesian": {"covariance": "lowrank", "rank": 1}}, "covariance='lowrank' has no context-par"),
        (["bayesian"], {"bayesian": {"dynamics": "rotation"}},
         "layer 0's mixer 'bayesian' cannot run with cp_context: rotations"),
    ],
)
def test_the_model_check_names_every_layer_without_a_context_parallel_path(mixers, kwargs, expected):
    """What the training path checks before it starts: the short convolutions' width, or the layers refused."""
    from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM

    model = BayesLayerForCausalLM(BayesLayerConfig(vocab_size=50, hidden_size=16, num_hidden_layers=len(mixers),
                                                   num_heads=2, head_dim=4, mixers=mixers, mixer_kwargs=kwargs,
                                                   bos_token_id=None, eos_token_id=None))
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected.replace("(", r"\(")):
            model.context_parallel_conv_size()
    else:
        assert model.context_parallel_conv_size() == expected
