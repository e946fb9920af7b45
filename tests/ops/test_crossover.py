"""``bayeslayer.ops.bayesian_layer.crossover``: the chain-or-scan sums as documented, the crossover they give, the
figures equal to the cost model's record, bad inputs refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bayeslayer.ops.bayesian_layer import crossover as xo
from bayeslayer.ops.bayesian_layer.scan import choose_segment_chunks

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "results" / "cost_model" / "crossover_sm90_triton3.6.json"

# made-up figures: a chain step of 10 cycles against scan steps of 20 (Phase A), 4 (tracking), 100 (Phase B), 30
FIG = {64: {"chain": (10, 1), "a": (20, 1), "track": (4, 2), "b": (100, 1), "c": (30, 1)}}
CH = {"chain": 64, "scan": 64}


def test_sums_as_documented():
    N, n, s = 8, 512, 132
    T = n * 64
    kw = dict(sms=s, figures=FIG, chunks=CH)
    assert xo.covariance_cycles("chain", N, T, 64, **kw) == n * 10
    assert xo.covariance_cycles("chain", 300, T, 64, **kw) == 3 * n * 10  # three waves
    # a chain kernel of 32-token chunks takes twice the steps
    assert xo.covariance_cycles("chain", N, T, 64, sms=s, figures=FIG, chunks=dict(CH, chain=32)) == 2 * n * 10
    S = math.ceil(n / choose_segment_chunks(N, n, T, sms=s))
    m = math.ceil(n / S)
    want = (math.ceil(N * S / s) * m * 20 + math.ceil(N * (S - 1) / (2 * s)) * m * 4 + (S - 1) * 100
            + math.ceil(N * S / s) * m * 30)
    assert xo.covariance_cycles("scan", N, T, 64, **kw) == want
    # one segment: the scan is Phase A's and C's kernels over the whole chain, no tracking, no Phase B
    assert xo.covariance_cycles("scan", N, T, 64, segments=1, **kw) == n * (20 + 30)


def test_crossover_is_the_last_count_where_the_scan_wins():
    T = 512 * 64
    star = xo.crossover_chains(T, 64, figures=FIG, chunks=CH)
    assert 0 < star < 132
    assert xo.scan_predicted_faster(star, T, 64, figures=FIG, chunks=CH)
    assert not any(xo.scan_predicted_faster(N, T, 64, figures=FIG, chunks=CH) for N in range(star + 1, 133))
    # one chain: 128 segments, Phase B's 127 serial steps cost more than the chain itself
    assert not xo.scan_predicted_faster(1, T, 64, figures=FIG, chunks=CH)
    # a chain step as slow as the scan's whole step: the scan wins wherever it splits
    slow = {64: dict(FIG[64], chain=(1000, 1))}
    assert xo.crossover_chains(T, 64, figures=slow, chunks=CH) > star
    # a chain step faster than any split can make up for: never the scan
    fast = {64: dict(FIG[64], chain=(1, 1))}
    assert xo.crossover_chains(T, 64, figures=fast, chunks=CH) == 0


def test_figures_are_the_records():
    from bayeslayer.ops.bayesian_layer.chunk_triton import CHAIN_CHUNK_SIZE

    rec = json.loads(RECORD.read_text())
    assert {int(d): {k: tuple(v) for k, v in f.items()} for d, f in rec["figures"].items()} == xo.STEP_CYCLES
    assert rec["chunks"] == xo.CHUNKS and xo.CHUNKS["chain"] == CHAIN_CHUNK_SIZE
    for D, by_T in rec["crossover_chains"].items():
        for T, n in by_T.items():
            assert xo.crossover_chains(int(T), int(D)) == n


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(path="both", n_chains=1, T=1, D=64), "path"),
    (dict(path="chain", n_chains=0, T=1, D=64), "n_chains"),
    (dict(path="chain", n_chains=1, T=True, D=64), "T must"),
    (dict(path="chain", n_chains=1, T=1, D=256), "D must be at most"),
    (dict(path="scan", n_chains=1, T=256, D=64, segments=0), "segments"),
])
def test_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        xo.covariance_cycles(**kwargs)
