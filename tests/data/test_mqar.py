"""MQAR generators: docstring examples, latest-value labels by brute force, shared vocabulary, guards."""

from __future__ import annotations

import doctest

import pytest
import torch

from bayeslayer.data import mqar
from bayeslayer.data.mqar import (
    FILLER_TOKEN,
    IGNORE_INDEX,
    MQARData,
    MQARDataset,
    MQARTask,
    accuracy_by_slice,
    block_mqar,
    make_pool,
    multiquery_ar,
    update_mqar,
)


# -- an independent reading of a sequence -------------------------------------------------------------
def parse_writes(inputs: list[int], num_writes: int, block_size: int) -> list[tuple[int, int]]:
    """The (key, value) writes of a context, read position by position from the task's layout.

    Base/Update (block_size 1): ``K V K V …``; Block: ``b`` keys then their ``b`` values, the last block
    possibly short.  Written without the generator's index arithmetic.
    """
    writes, pos, left = [], 0, num_writes
    while left > 0:
        b = min(block_size, left)
        keys, values = inputs[pos:pos + b], inputs[pos + b:pos + 2 * b]
        writes.extend(zip(keys, values, strict=True))
        pos += 2 * b
        left -= b
    return writes


def check_sequences(data: MQARData, *, random_fillers: bool) -> None:
    """Every property of every sequence, by brute force over Python lists."""
    for i in range(len(data)):
        n = int(data.slices["num_pairs"][i])
        u = int(data.slices["num_updates"][i])
        b = int(data.slices["block_size"][i])
        L = int(data.slices["seq_len"][i])
        x = data.inputs[i].tolist()
        y = data.labels[i].tolist()
        qw = data.query_writes[i].tolist()
        assert len(x) == L
        W = n + u
        writes = parse_writes(x, W, b)
        keys = [k for k, _ in writes]
        values = [v for _, v in writes]
        distinct_keys = set(keys)
        assert len(distinct_keys) == n, "every key is written, and only n keys exist"
        assert len(set(values)) == W, "every write takes a fresh value"
        assert not distinct_keys & set(values), "a token is never both a key and a value in one sequence"
        assert all(1 <= t < data.vocab_size for t in keys + values)
        latest: dict[int, int] = {}
        count: dict[int, int] = {}
        for k, v in writes:
            latest[k] = v
            count[k] = count.get(k, 0) + 1
        assert sum(count.values()) - n == u, "exactly u writes overwrite an already written key"
        queried = []
        for t in range(2 * W, L):
            if y[t] != IGNORE_INDEX:
                assert y[t] == latest[x[t]], f"seq {i} pos {t}: label {y[t]}, latest value {latest[x[t]]}"
                assert qw[t] == count[x[t]]
                assert (t - 2 * W) % 2 == 0, "queries sit at the start of a two-token slot"
                queried.append(x[t])
            else:
                assert qw[t] == 0
                assert x[t] not in distinct_keys, "a filler is never a key of its sequence"
                if not random_fillers:
                    assert x[t] == FILLER_TOKEN
        assert sorted(queried) == sorted(distinct_keys), "every key is queried exactly once"
        assert all(v == IGNORE_INDEX for v in y[:2 * W]), "no loss inside the context"


# -- docstring examples -------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [multiquery_ar, update_mqar, block_mqar])
def test_docstring_example_is_literal(fn):
    tests = doctest.DocTestFinder().find(fn, globs=vars(mqar))
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    attempted = 0
    for t in tests:
        result = runner.run(t)
        assert result.failed == 0, f"{fn.__name__} docstring example no longer matches the generator"
        attempted += result.attempted
    assert attempted >= 2, f"{fn.__name__} must show a worked example"


def test_update_example_reads_as_the_issue_describes():
    # A→8, B→13, A→11  must answer A→11, B→13 (the paper's A→4, B→5, A→4*)
    d = update_mqar(vocab_size=16, num_examples=1, seq_len=12, num_pairs=2, num_updates=1,
                    seed=3, power_a=1.0, random_non_queries=False)
    x, y = d.inputs[0].tolist(), d.labels[0].tolist()
    A, B = x[0], x[2]
    assert x[:6] == [A, 8, B, 13, A, 11]
    answers = {x[t]: y[t] for t in range(6, 12) if y[t] != IGNORE_INDEX}
    assert answers == {A: 11, B: 13}


# -- labels are always the latest write ---------------------------------------------------------------
@pytest.mark.parametrize("random_fillers", [False, True])
@pytest.mark.parametrize(
    "make",
    [
        lambda s, r: multiquery_ar(vocab_size=40, num_examples=150, seq_len=40, num_pairs=8, seed=s,
                                   random_non_queries=r),
        lambda s, r: update_mqar(vocab_size=40, num_examples=150, seq_len=64, num_pairs=6, num_updates=9,
                                 seed=s, random_non_queries=r),
        lambda s, r: update_mqar(vocab_size=24, num_examples=150, seq_len=40, num_pairs=4, num_updates=12,
                                 seed=s, power_a=1.0, random_non_queries=r),  # many updates per key
        lambda s, r: block_mqar(vocab_size=40, num_examples=150, seq_len=40, num_pairs=7, block_size=2,
                                seed=s, random_non_queries=r),  # a short last block
        lambda s, r: block_mqar(vocab_size=40, num_examples=150, seq_len=48, num_pairs=9, block_size=4,
                                seed=s, random_non_queries=r),
    ],
    ids=["base", "update", "update-many", "block2-short-last", "block4"],
)
def test_labels_are_latest_value_brute_force(make, random_fillers):
    for seed in (0, 1):
        check_sequences(make(seed, random_fillers), random_fillers=random_fillers)


def test_minimal_lengths_and_vocabularies_are_accepted():
    # exactly at the guards: L = 2W + 2n, V - 1 = n + W
    check_sequences(multiquery_ar(vocab_size=9, num_examples=20, seq_len=16, num_pairs=4, seed=0),
                    random_fillers=True)
    check_sequences(update_mqar(vocab_size=12, num_examples=20, seq_len=22, num_pairs=4, num_updates=3,
                                seed=0), random_fillers=True)
    check_sequences(block_mqar(vocab_size=11, num_examples=20, seq_len=20, num_pairs=5, block_size=3,
                               seed=0, random_non_queries=False), random_fillers=False)


@pytest.mark.parametrize("rate", [0.0, float("inf")], ids=["topk", "rejection"])
def test_both_distinct_samplers_are_distinct_and_uniform(monkeypatch, rate):
    monkeypatch.setattr(mqar, "_MAX_REJECTION_RATE", rate)
    d = update_mqar(vocab_size=120, num_examples=300, seq_len=72, num_pairs=10, num_updates=15, seed=5)
    check_sequences(d, random_fillers=True)
    tokens = mqar._distinct_tokens(torch.Generator().manual_seed(0), 6000, 5, 1, 11)
    assert (tokens.sort(dim=1).values.diff(dim=1) > 0).all()
    # each of the 10 tokens at each of the 5 slots: expected 600, binomial std ≈ 23
    counts = torch.stack([torch.bincount(tokens[:, j] - 1, minlength=10) for j in range(5)]).double()
    assert (counts - 600).abs().max() < 6 * 600**0.5


def test_block_layout_binds_key_block_to_value_block():
    d = block_mqar(vocab_size=64, num_examples=50, seq_len=32, num_pairs=6, block_size=3, seed=2,
                   random_non_queries=False)
    for i in range(len(d)):
        x, y = d.inputs[i].tolist(), d.labels[i].tolist()
        binding = {x[0]: x[3], x[1]: x[4], x[2]: x[5], x[6]: x[9], x[7]: x[10], x[8]: x[11]}
        assert {x[t]: y[t] for t in range(12, 32) if y[t] != IGNORE_INDEX} == binding


def test_block_size_one_is_base_layout():
    a = block_mqar(vocab_size=50, num_examples=30, seq_len=24, num_pairs=5, block_size=1, seed=4)
    b = multiquery_ar(vocab_size=50, num_examples=30, seq_len=24, num_pairs=5, seed=4)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)


# -- the shared vocabulary ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["base", "update", "block"])
def test_every_token_plays_both_roles_across_sequences(kind):
    V = 48
    task = MQARTask(kind, seq_len=48, num_pairs=8, num_updates=4 if kind == "update" else 0)
    d = task.generate(400, vocab_size=V, seed=11)
    key_tokens, value_tokens = set(), set()
    for i in range(len(d)):
        W = 8 + int(d.slices["num_updates"][i])
        writes = parse_writes(d.inputs[i].tolist(), W, int(d.slices["block_size"][i]))
        key_tokens |= {k for k, _ in writes}
        value_tokens |= {v for _, v in writes}
    # no half of the vocabulary is reserved for one role (Zoology's split): both roles cover 1..V-1
    assert key_tokens == value_tokens == set(range(1, V))


def test_token_frequencies_are_uniform():
    V, n = 32, 6
    d = multiquery_ar(vocab_size=V, num_examples=4000, seq_len=24, num_pairs=n, seed=8,
                      random_non_queries=False)
    counts = torch.bincount(d.inputs[:, : 2 * n].reshape(-1), minlength=V)[1:].double()
    expected = 4000 * 2 * n / (V - 1)
    # binomial std ≈ sqrt(expected) ≈ 28; 6 sigma
    assert (counts - expected).abs().max() < 6 * expected**0.5


def test_query_order_is_independent_of_write_order():
    n = 4
    d = multiquery_ar(vocab_size=64, num_examples=3000, seq_len=64, num_pairs=n, seed=9,
                      random_non_queries=False)
    first_pos = (d.labels != IGNORE_INDEX).int().argmax(dim=1)  # position of the first query
    first_query = d.inputs[torch.arange(len(d)), first_pos]
    first_key_queried_first = (first_query == d.inputs[:, 0]).double().mean()
    assert abs(first_key_queried_first.item() - 1 / n) < 0.04


def test_power_law_favours_slots_near_the_context():
    kw = dict(vocab_size=64, num_examples=1000, seq_len=128, num_pairs=4, seed=1, random_non_queries=False)
    pos = lambda d: (d.labels != IGNORE_INDEX).nonzero()[:, 1].double().mean().item()
    uniform, skewed = pos(multiquery_ar(power_a=1.0, **kw)), pos(multiquery_ar(power_a=0.01, **kw))
    assert abs(uniform - (8 + 127) / 2) < 3  # slots 0..59 at positions 8, 10, …, 126
    assert skewed < uniform - 20


def test_seeded_and_reproducible():
    kw = dict(vocab_size=100, num_examples=20, seq_len=40, num_pairs=5, num_updates=3)
    a, b, c = update_mqar(seed=7, **kw), update_mqar(seed=7, **kw), update_mqar(seed=8, **kw)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.inputs, c.inputs)


def test_slices_record_structure():
    d = update_mqar(vocab_size=100, num_examples=5, seq_len=64, num_pairs=5, num_updates=3, seed=0)
    assert d.slices["num_updates"].tolist() == [3] * 5 and d.slices["num_pairs"].tolist() == [5] * 5
    assert d.slices["seq_len"].tolist() == [64] * 5 and d.inputs.dtype == d.labels.dtype == torch.int64


# -- guards -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: multiquery_ar(vocab_size=100, num_examples=2, seq_len=15, num_pairs=4, seed=0),
         r"seq_len=15 is too short.*>= 16"),
        (lambda: update_mqar(vocab_size=100, num_examples=2, seq_len=20, num_pairs=4, num_updates=3, seed=0),
         r"seq_len=20 is too short.*>= 22"),
        (lambda: multiquery_ar(vocab_size=8, num_examples=2, seq_len=64, num_pairs=4, seed=0),
         r"vocab_size=8 is too small.*8 distinct tokens.*only 7"),
        (lambda: update_mqar(vocab_size=11, num_examples=2, seq_len=64, num_pairs=4, num_updates=3, seed=0),
         r"vocab_size=11 is too small"),
        (lambda: block_mqar(vocab_size=100, num_examples=2, seq_len=64, num_pairs=4, block_size=0, seed=0),
         r"block_size must be an integer >= 1"),
        (lambda: update_mqar(vocab_size=100, num_examples=2, seq_len=64, num_pairs=4, num_updates=-1, seed=0),
         r"num_updates must be an integer >= 0"),
        (lambda: multiquery_ar(vocab_size=100, num_examples=0, seq_len=64, num_pairs=4, seed=0),
         r"num_examples must be an integer >= 1"),
        (lambda: multiquery_ar(vocab_size=100, num_examples=2, seq_len=64, num_pairs=0, seed=0),
         r"num_pairs must be an integer >= 1"),
        (lambda: multiquery_ar(vocab_size=100, num_examples=2, seq_len=64, num_pairs=4, seed=-1),
         r"seed must be an integer >= 0"),
        (lambda: multiquery_ar(vocab_size=100, num_examples=2, seq_len=64, num_pairs=4, seed=0, power_a=0.0),
         r"power_a must be finite and > 0"),
        (lambda: multiquery_ar(vocab_size=100, num_examples=2, seq_len=64, num_pairs=4, seed=0,
                               power_a=float("nan")), r"power_a"),
        (lambda: MQARTask("copy", 64, 4), r"kind must be one of"),
        (lambda: MQARTask("base", 64, 4, num_updates=2), r"only meaningful for kind='update'"),
        (lambda: make_pool([MQARTask("base", 32, 4)], num_examples=10, vocab_size=64, seed=0,
                           val_fraction=1.0), r"val_fraction"),
        (lambda: accuracy_by_slice(torch.zeros(2, 3), torch.zeros(2, 4)), r"\[N, L\]"),
        (lambda: accuracy_by_slice(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3)), r"slice_values"),
    ],
)
def test_guards_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(seq_len=64.0), "seq_len"),
        (dict(num_pairs=True), "num_pairs"),
        (dict(vocab_size="8192"), "vocab_size"),
        (dict(power_a="0.01"), "power_a"),
    ],
)
def test_guards_raise_type_error(kwargs, name):
    base = dict(vocab_size=100, num_examples=2, seq_len=64, num_pairs=4, seed=0)
    with pytest.raises(TypeError, match=name):
        multiquery_ar(**{**base, **kwargs})


def test_dataset_rejects_mixed_vocabularies_and_bad_segments():
    a = multiquery_ar(vocab_size=100, num_examples=2, seq_len=16, num_pairs=2, seed=0)
    b = multiquery_ar(vocab_size=50, num_examples=2, seq_len=16, num_pairs=2, seed=0)
    with pytest.raises(ValueError, match="mix vocabularies"):
        MQARDataset([a, b])
    with pytest.raises(TypeError):
        MQARDataset([a.inputs])
    with pytest.raises(TypeError):
        make_pool([], num_examples=10, vocab_size=64, seed=0)


# -- pools, batches, accuracy -------------------------------------------------------------------------
def test_make_pool_splits_every_task_and_batches_cover_once():
    tasks = [MQARTask("update", 32, 4, u) for u in (0, 2)] + [MQARTask("update", 64, 8, 4)]
    train, val = make_pool(tasks, num_examples=301, vocab_size=128, seed=3, val_fraction=0.2)
    assert len(train) + len(val) == 301 and len(train.segments) == len(val.segments) == 3
    assert [len(s) for s in val.segments] == [20, 20, 20]
    assert sorted(int(s.slices["num_updates"][0]) for s in train.segments) == [0, 2, 4]
    # train and validation hold different sequences
    for tr, va in zip(train.segments, val.segments, strict=True):
        assert not (tr.inputs.unsqueeze(1) == va.inputs.unsqueeze(0)).all(-1).any()
    seen = []
    batches = list(train.batches(16, shuffle=True, seed=1))
    assert len(batches) == train.num_batches(16)
    for batch in batches:
        assert batch.inputs.shape[0] <= 16 and batch.inputs.shape == batch.labels.shape
        assert len(set(batch.slices["seq_len"].tolist())) == 1, "a batch never mixes lengths"
        seen.extend(map(tuple, batch.inputs.tolist()))
    all_rows = [tuple(r) for s in train.segments for r in s.inputs.tolist()]
    assert sorted(seen) == sorted(all_rows)
    again = [b.inputs for b in train.batches(16, shuffle=True, seed=1)]
    assert all(torch.equal(x.inputs, y) for x, y in zip(batches, again, strict=True))
    other = [b.inputs for b in train.batches(16, shuffle=True, seed=2)]
    assert not all(x.inputs.shape == y.shape and torch.equal(x.inputs, y) for x, y in zip(batches, other,
                                                                                          strict=True))
    assert all(b.inputs.shape[0] == 16 for b in train.batches(16, drop_last=True))
    assert train.num_batches(16, drop_last=True) == sum(len(s) // 16 for s in train.segments)


def test_accuracy_by_slice_counts():
    d = update_mqar(vocab_size=64, num_examples=4, seq_len=32, num_pairs=3, num_updates=2, seed=0)
    perfect = torch.where(d.labels == IGNORE_INDEX, 0, d.labels)
    assert accuracy_by_slice(perfect, d.labels, d.slices["num_updates"]) == {2: (12, 12)}
    wrong_first = perfect.clone()
    wrong_first[0] = 0  # every query of sequence 0 wrong
    by_writes = accuracy_by_slice(wrong_first, d.labels, d.query_writes)
    assert sum(c for c, _ in by_writes.values()) == 9 and sum(t for _, t in by_writes.values()) == 12
    assert set(by_writes) <= {1, 2, 3}
    assert accuracy_by_slice(perfect, d.labels) == {0: (12, 12)}


def test_paper_scale_segment_is_fast_enough():
    # Update eval shape at the paper's vocabulary: L=128, 16 pairs, 16 updates
    d = update_mqar(vocab_size=8192, num_examples=4000, seq_len=128, num_pairs=16, num_updates=16, seed=0)
    assert d.inputs.shape == (4000, 128)
    check_sequences(d.select(slice(0, 50)), random_fillers=True)
