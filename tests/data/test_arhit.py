"""AR-hit annotation against a brute-force reference, the docs/theory.md §8.5 rules one by one, and grouped PPL."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from bayeslayer.data.arhit import (
    BUCKETS,
    BigramCounts,
    GroupedCE,
    annotate_ar_hits,
    bucket_name,
    ppl_by_group,
)


def brute_force(windows, train_tokens, *, max_distance=1024, max_train_count=16, buckets=BUCKETS):
    """The definition, read literally: for each t scan back for the same bigram inside the window."""
    counts = Counter(zip(train_tokens[:-1].tolist(), train_tokens[1:].tolist(), strict=True))
    n, length = windows.shape
    hit = np.zeros((n, length), dtype=bool)
    distance = np.zeros((n, length), dtype=np.int64)
    bucket = np.full((n, length), -1, dtype=np.int64)
    for w in range(n):
        x = windows[w]
        first, second = x[:-1], x[1:]  # bigram ending at position s is (first[s-1], second[s-1])
        for t in range(1, length):
            earlier = np.flatnonzero((first[: t - 1] == x[t - 1]) & (second[: t - 1] == x[t]))
            if earlier.size:
                distance[w, t] = t - (earlier[-1] + 1)
            d = distance[w, t]
            if 1 <= d <= max_distance and counts[(int(x[t - 1]), int(x[t]))] <= max_train_count:
                hit[w, t] = True
                bucket[w, t] = next(i for i, (lo, hi) in enumerate(buckets) if lo <= d <= hi)
    return hit, distance, bucket


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("vocab_size, n_windows, length", [(3, 4, 50), (6, 3, 300), (40, 2, 1500)])
def test_matches_brute_force_on_random_streams(seed, vocab_size, n_windows, length):
    rng = np.random.default_rng(seed)
    train = rng.integers(0, vocab_size, 400 * vocab_size)
    windows = rng.integers(0, vocab_size, (n_windows, length))
    # Thresholds chosen so that hits, too-frequent repeats and too-far repeats all occur.
    max_count = int(np.median(list(Counter(zip(train[:-1], train[1:], strict=True)).values())))
    kwargs = dict(max_distance=200, max_train_count=max_count, buckets=((1, 8), (9, 64), (65, 200)))
    ann = annotate_ar_hits(windows, BigramCounts.from_tokens(train, vocab_size), **kwargs)
    hit, distance, bucket = brute_force(windows, train, **kwargs)
    np.testing.assert_array_equal(ann.distance, distance)
    np.testing.assert_array_equal(ann.is_hit, hit)
    np.testing.assert_array_equal(ann.bucket, bucket)
    assert 0 < hit.sum() < (distance > 0).sum()  # the test exercises both outcomes


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_brute_force_with_spec_defaults(seed):
    """Default thresholds (1024, 16) and buckets on long windows with repeats far apart."""
    rng = np.random.default_rng(seed)
    vocab_size = 60
    train = rng.integers(0, vocab_size, 20_000)  # about 5.6 occurrences per bigram: many are <= 16
    train = np.concatenate([train, np.tile([7, 8], 100)])  # (7, 8) and (8, 7) become frequent
    windows = rng.integers(0, vocab_size, (2, 2048))
    windows[0, 100:102] = [7, 8]
    windows[0, 1500:1502] = [7, 8]
    ann = annotate_ar_hits(windows, BigramCounts.from_tokens(train, vocab_size))
    hit, distance, bucket = brute_force(windows, train)
    np.testing.assert_array_equal(ann.distance, distance)
    np.testing.assert_array_equal(ann.is_hit, hit)
    np.testing.assert_array_equal(ann.bucket, bucket)
    assert set(np.unique(bucket[hit]).tolist()) == {0, 1, 2}
    assert ann.distance.max() > 1024 and not ann.is_hit[ann.distance > 1024].any()


def test_docstring_worked_example():
    counts = BigramCounts.from_tokens(np.array([3, 4, 3, 4, 3, 4]), 10)
    ann = annotate_ar_hits(np.array([[5, 6, 3, 4, 5, 6, 3, 4]]), counts, max_train_count=2)
    np.testing.assert_array_equal(ann.distance[0], [0, 0, 0, 0, 0, 4, 4, 4])
    np.testing.assert_array_equal(ann.train_count[0], [0, 0, 0, 3, 0, 0, 0, 3])
    np.testing.assert_array_equal(ann.is_hit[0], [0, 0, 0, 0, 0, 1, 1, 0])
    np.testing.assert_array_equal(ann.bucket[0], [-1, -1, -1, -1, -1, 0, 0, -1])


def test_hand_made_example_overlap_and_most_recent_occurrence():
    # t:      0  1  2  3  4  5  6  7  8
    window = [1, 1, 1, 2, 1, 1, 9, 1, 1]
    # (1,1) at t=1, 2, 5, 8: t=2 -> 1 (overlapping), t=5 -> 3, t=8 -> 3 (most recent, not 7 or 6).
    counts = BigramCounts.from_tokens(np.array([0, 0]), 10)
    ann = annotate_ar_hits(np.array([window]), counts)
    np.testing.assert_array_equal(ann.distance[0], [0, 0, 1, 0, 0, 3, 0, 0, 3])
    np.testing.assert_array_equal(ann.is_hit[0], ann.distance[0] > 0)


def test_no_hit_across_windows():
    counts = BigramCounts.from_tokens(np.array([0, 1]), 10)
    windows = np.array([[5, 6, 7, 8], [5, 6, 7, 8]])  # the second window repeats the first
    ann = annotate_ar_hits(windows, counts)
    assert not ann.is_hit.any() and not ann.distance.any()
    # The same tokens as one window of 8 are all hits at distance 4 (except the bridging bigram).
    ann = annotate_ar_hits(windows.reshape(1, 8), counts)
    np.testing.assert_array_equal(ann.distance[0], [0, 0, 0, 0, 0, 4, 4, 4])


def test_earlier_window_occurrence_does_not_hide_same_window_one():
    counts = BigramCounts.from_tokens(np.array([0, 1]), 10)
    windows = np.array([[5, 6, 0, 0, 0], [0, 5, 6, 5, 6]])
    ann = annotate_ar_hits(windows, counts)
    np.testing.assert_array_equal(ann.distance, [[0, 0, 0, 0, 1], [0, 0, 0, 0, 2]])


def test_count_threshold_is_inclusive():
    window = np.array([[4, 5, 4, 5]])
    for copies, expect_hit in [(0, True), (16, True), (17, False)]:
        train = np.array([0] + [4, 5, 0] * copies + [0])  # exactly `copies` occurrences of (4, 5)
        counts = BigramCounts.from_tokens(train, 10)
        assert counts.lookup([4], [5])[0] == copies
        ann = annotate_ar_hits(window, counts)
        assert ann.distance[0, 3] == 2
        assert bool(ann.is_hit[0, 3]) is expect_hit


def test_distance_threshold_and_buckets():
    counts = BigramCounts.from_tokens(np.array([0, 0]), 10)
    for d, expect_bucket in [(1, 0), (64, 0), (65, 1), (256, 1), (257, 2), (1024, 2), (1025, -1)]:
        window = np.zeros(d + 3, dtype=np.int64)
        if d == 1:  # only an overlapping repeat is 1 apart: 7 7 7 has (7, 7) at t = 2 and t = 3
            window[1:4] = 7
        else:  # (7, 8) ending at t = 2 and again at t = 2 + d
            window[[1, 1 + d]] = 7
            window[[2, 2 + d]] = 8
        ann = annotate_ar_hits(window[None, :], counts)
        t = 2 + d
        assert ann.distance[0, t] == d, d
        assert ann.bucket[0, t] == expect_bucket, d
        assert bool(ann.is_hit[0, t]) is (expect_bucket >= 0)


def test_masks_partition_and_shift():
    rng = np.random.default_rng(0)
    windows = rng.integers(0, 5, (3, 400))
    ann = annotate_ar_hits(windows, BigramCounts.from_tokens(rng.integers(0, 5, 50), 5))
    masks = ann.masks()
    assert set(masks) == {"all", "ar_hit", "other"} | {bucket_name(lo, hi) for lo, hi in BUCKETS}
    assert not masks["all"][:, 0].any() and masks["all"][:, 1:].all()
    np.testing.assert_array_equal(masks["ar_hit"] | masks["other"], masks["all"])
    assert not (masks["ar_hit"] & masks["other"]).any()
    buckets = sum(masks[bucket_name(lo, hi)].astype(int) for lo, hi in BUCKETS)
    np.testing.assert_array_equal(buckets, masks["ar_hit"].astype(int))
    shifted = ann.masks(shifted=True)
    for name in masks:
        np.testing.assert_array_equal(shifted[name], masks[name][:, 1:])


def test_bigram_counts_chunked_equals_whole_and_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 70_000, 5_000)  # vocab over 2**16: keys need more than two radix passes
    tokens[::7] = 3
    whole = BigramCounts.from_tokens(tokens, 70_000)
    chunked = BigramCounts.from_tokens(tokens, 70_000, chunk_tokens=333)
    np.testing.assert_array_equal(whole.keys, chunked.keys)
    np.testing.assert_array_equal(whole.counts, chunked.counts)
    ref = Counter(zip(tokens[:-1].tolist(), tokens[1:].tolist(), strict=True))
    assert whole.counts.sum() == len(tokens) - 1 and len(whole.keys) == len(ref)
    prev, cur = zip(*ref.keys(), strict=True)
    np.testing.assert_array_equal(whole.lookup(prev, cur), list(ref.values()))
    assert whole.lookup([1], [69_999])[0] == ref.get((1, 69_999), 0)
    whole.save(tmp_path / "counts.npz")
    loaded = BigramCounts.load(tmp_path / "counts.npz")
    np.testing.assert_array_equal(loaded.keys, whole.keys)
    assert (loaded.vocab_size, loaded.n_tokens) == (70_000, 5_000)


def test_damaged_counts_file(tmp_path):
    path = tmp_path / "counts.npz"
    BigramCounts.from_tokens(np.arange(100) % 7, 7).save(path)
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ValueError, match="damaged"):
        BigramCounts.load(path)
    with pytest.raises(FileNotFoundError):
        BigramCounts.load(tmp_path / "absent.npz")


def test_bad_inputs():
    counts = BigramCounts.from_tokens(np.array([0, 1, 2]), 5)
    with pytest.raises(ValueError, match=r"\[N, L\]"):
        annotate_ar_hits(np.zeros(8, dtype=np.int64), counts)
    with pytest.raises(TypeError, match="integer"):
        annotate_ar_hits(np.zeros((1, 8)), counts)
    with pytest.raises(ValueError, match="vocab_size 5"):
        annotate_ar_hits(np.full((1, 8), 5), counts)
    with pytest.raises(ValueError, match="negative"):
        annotate_ar_hits(np.full((1, 8), -1), counts)
    with pytest.raises(ValueError, match=">= 2 tokens"):
        annotate_ar_hits(np.zeros((3, 1), dtype=np.int64), counts)
    with pytest.raises(TypeError, match="BigramCounts"):
        annotate_ar_hits(np.zeros((1, 8), dtype=np.int64), {})
    with pytest.raises(ValueError, match="max_distance"):
        annotate_ar_hits(np.zeros((1, 8), dtype=np.int64), counts, max_distance=0)
    with pytest.raises(ValueError, match="max_train_count"):
        annotate_ar_hits(np.zeros((1, 8), dtype=np.int64), counts, max_train_count=-1)
    with pytest.raises(ValueError, match="contiguous"):
        annotate_ar_hits(np.zeros((1, 8), dtype=np.int64), counts, buckets=((1, 10), (12, 1024)))
    with pytest.raises(ValueError, match="end at max_distance"):
        annotate_ar_hits(np.zeros((1, 8), dtype=np.int64), counts, buckets=((1, 10),))
    with pytest.raises(ValueError, match="at least 2"):
        BigramCounts.from_tokens(np.array([1]), 5)
    with pytest.raises(ValueError, match="vocab_size"):
        BigramCounts.from_tokens(np.array([1, 2]), 0)
    with pytest.raises(ValueError, match=r"\[T\]"):
        BigramCounts.from_tokens(np.zeros((2, 2), dtype=np.int64), 5)


def test_accepts_torch_windows():
    counts = BigramCounts.from_tokens(np.array([0, 1]), 10)
    ann = annotate_ar_hits(torch.tensor([[5, 6, 5, 6]]), counts)
    np.testing.assert_array_equal(ann.distance, [[0, 0, 0, 2]])


# ------------------------------------------------------------------ ppl_by_group


def test_ppl_is_exp_mean_ce_over_exactly_the_selected_tokens():
    rng = np.random.default_rng(0)
    ce = rng.uniform(0.5, 6.0, (4, 31))
    masks = {"all": np.ones_like(ce, dtype=bool), "odd": np.zeros_like(ce, dtype=bool)}
    masks["odd"][:, 1::2] = True
    masks["one"] = np.zeros_like(ce, dtype=bool)
    masks["one"][2, 5] = True
    masks["none"] = np.zeros_like(ce, dtype=bool)
    result = ppl_by_group(ce, masks)
    assert result["all"]["ppl"] == pytest.approx(math.exp(ce.mean()), rel=1e-12)
    assert result["odd"]["ppl"] == pytest.approx(math.exp(ce[:, 1::2].mean()), rel=1e-12)
    assert result["one"]["ppl"] == pytest.approx(math.exp(ce[2, 5]), rel=1e-12)
    assert result["odd"]["n_tokens"] == 4 * 15
    assert result["none"]["n_tokens"] == 0 and math.isnan(result["none"]["ppl"])
    # NaN at unselected tokens (e.g. padding) must not leak in.
    ce2 = ce.copy()
    ce2[:, 0] = np.nan
    sel = {"rest": np.ones_like(ce, dtype=bool)}
    sel["rest"][:, 0] = False
    assert ppl_by_group(ce2, sel)["rest"]["ppl"] == pytest.approx(math.exp(ce[:, 1:].mean()), rel=1e-12)


def test_ppl_with_torch_inputs_and_annotation_masks():
    rng = np.random.default_rng(1)
    windows = rng.integers(0, 4, (2, 300))
    ann = annotate_ar_hits(windows, BigramCounts.from_tokens(rng.integers(0, 4, 40), 4))
    ce = torch.rand(2, 299, dtype=torch.float32) * 5
    masks = ann.masks(shifted=True)
    result = ppl_by_group(ce, {k: torch.from_numpy(v) for k, v in masks.items()})
    ce64 = ce.double().numpy()
    for name, mask in masks.items():
        if mask.any():
            assert result[name]["ppl"] == pytest.approx(math.exp(ce64[mask].mean()), rel=1e-12)
    assert result["all"]["n_tokens"] == 2 * 299
    assert result["ar_hit"]["n_tokens"] + result["other"]["n_tokens"] == 2 * 299


def test_grouped_ce_streams_batches():
    rng = np.random.default_rng(2)
    ce = rng.uniform(0, 3, (6, 10))
    mask = rng.random((6, 10)) < 0.3
    acc = GroupedCE()
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        acc.update(ce[rows], {"g": mask[rows]})
    assert acc.result()["g"]["ppl"] == pytest.approx(ppl_by_group(ce, {"g": mask})["g"]["ppl"], rel=1e-12)


def test_ppl_bad_inputs():
    ce = np.ones((2, 3))
    with pytest.raises(ValueError, match="shape"):
        ppl_by_group(ce, {"a": np.ones((2, 4), dtype=bool)})
    with pytest.raises(TypeError, match="boolean"):
        ppl_by_group(ce, {"a": np.ones((2, 3))})
    with pytest.raises(ValueError, match="NaN"):
        ppl_by_group(np.full((2, 3), np.nan), {"a": np.ones((2, 3), dtype=bool)})
    with pytest.raises(ValueError, match=">= 0"):
        ppl_by_group(-ce, {"a": np.ones((2, 3), dtype=bool)})
    with pytest.raises(ValueError, match="non-empty"):
        ppl_by_group(ce, {})
    with pytest.raises(TypeError, match="floating"):
        ppl_by_group(np.ones((2, 3), dtype=np.int64), {"a": np.ones((2, 3), dtype=bool)})
    with pytest.raises(TypeError, match="numpy"):
        ppl_by_group([[1.0]], {"a": np.ones((1, 1), dtype=bool)})


def test_a_perplexity_past_the_largest_float_is_inf_not_an_overflow():
    """A diverged but finite model's mean CE (~1e37 nats here) is past exp's range: ppl inf, read back from
    JSON as such; an inf CE (a probability that underflowed to 0) too; a NaN CE is refused by name."""
    import json

    from bayeslayer.data.arhit import perplexity, ppl_by_group

    mask = np.ones((2, 3), dtype=bool)
    out = ppl_by_group(np.full((2, 3), 1e37), {"all": mask})["all"]
    assert out["ppl"] == math.inf and out["mean_ce"] == 1e37 and out["n_tokens"] == 6
    assert json.loads(json.dumps(out))["ppl"] == math.inf
    assert ppl_by_group(np.array([[1.0, math.inf]]), {"all": np.ones((1, 2), bool)})["all"]["ppl"] == math.inf
    assert perplexity(709.0) == math.exp(709.0) and perplexity(710.0) == math.inf
    with pytest.raises(ValueError, match="NaN at 1 selected token"):
        ppl_by_group(np.array([[1.0, math.nan]]), {"all": np.ones((1, 2), bool)})
