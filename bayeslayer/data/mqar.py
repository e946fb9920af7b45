"""Multi-query associative recall (MQAR) with one shared vocabulary: Base, Update and Block (docs/theory.md §8.4).

Zoology's MQAR (Arora, Eyuboglu et al., 2023) writes ``num_pairs`` key→value
pairs, then queries every key once; the model must emit the key's value at the
query position.  Zoology draws keys from one half of the vocabulary and values
from the other, so a model can tell a key from a value by its identity alone.
Here keys **and** values come from one shared vocabulary ``1..V-1``: a token
that is a key in one sequence is a value in the next, and only the position
says which role it plays.  Token 0 is the filler when fillers are not random.

Roles within one sequence (tested in ``tests/data/test_mqar.py``):

* every task: a token is **never both a key and a value in the same sequence**
  (keys and values are drawn as one set of distinct tokens, then split), and
  the keys of a sequence are distinct.  A token that is a key in one sequence
  can be a value in another: the roles are shared across sequences only;
* Base and Block: the values of a sequence are distinct, so no two keys share
  a value;
* Update: every write (first write or overwrite) takes a fresh value token, so
  an overwritten value never reappears, and the stale answer is always wrong;
* random fillers in the query region are never keys of their sequence, so a
  filler cannot look like a new write of a key ("``A x``" after the context would
  read as ``A→x``); fillers may equal values or unrelated tokens.

Layout of one sequence of length ``L`` (``W`` writes, ``n`` pairs)::

    [ context: 2W tokens of writes ][ query region: L - 2W tokens ]

The query region has ``(L - 2W) // 2`` two-token slots; each of the ``n`` keys is
queried once, in a slot drawn by Zoology's power law (``p(slot i) ∝ i^(a-1)``,
``a = power_a``; ``a = 1`` is uniform, small ``a`` favours slots near the
context) and in an order independent of the write order.  The label at a query
position is the **latest** value written for that key; everywhere else it is
``-100`` (ignored by the loss), following the usual ``labels[t]`` = target of
the prediction made after reading ``inputs[t]``.

Each generator is one vectorised, seeded function (no Python loop over tokens)
that returns :class:`MQARData`; :class:`MQARTask` and :func:`make_pool` build
mixed train/validation pools and :class:`MQARDataset` batches them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..checks import check_int

IGNORE_INDEX = -100
FILLER_TOKEN = 0
TASKS = ("base", "update", "block")

# Rows whose i.i.d. draws of k tokens collide are redrawn while that is cheap:
# P(k draws from n are distinct) ≈ exp(-k(k-1)/(2n)); below ~5% acceptance a
# random-score top-k over the whole vocabulary is cheaper.
_MAX_REJECTION_RATE = 3.0
_TOPK_ELEMENTS = 1 << 22


@dataclass
class MQARData:
    """A block of MQAR sequences of one length.

    Attributes:
        inputs: ``[N, L]`` int64 token ids.
        labels: ``[N, L]`` int64; the latest value of the queried key at query positions, ``-100`` elsewhere.
        slices: per-example metadata for per-slice accuracy, each ``[N]`` int64:
            ``num_pairs``, ``num_updates``, ``block_size``, ``seq_len``.
        query_writes: ``[N, L]`` int64; at a query position the number of writes the queried key
            received (1 = never updated), 0 elsewhere.
        vocab_size: the vocabulary size ``V`` the tokens were drawn from.
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    slices: dict[str, torch.Tensor]
    query_writes: torch.Tensor
    vocab_size: int

    def __len__(self) -> int:
        return self.inputs.shape[0]

    @property
    def seq_len(self) -> int:
        return self.inputs.shape[1]

    def select(self, index: torch.Tensor | slice) -> MQARData:
        """The sequences at ``index`` (a slice or a 1-D index tensor), as a new :class:`MQARData`."""
        return MQARData(
            inputs=self.inputs[index],
            labels=self.labels[index],
            slices={name: value[index] for name, value in self.slices.items()},
            query_writes=self.query_writes[index],
            vocab_size=self.vocab_size,
        )

    def show(self, i: int = 0) -> str:
        """Sequence ``i`` as three aligned rows: position, input token, label (``.`` = no loss)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence index {i} out of range for {len(self)} sequences")
        labels = ["." if y == IGNORE_INDEX else str(y) for y in self.labels[i].tolist()]
        cols = [
            (str(t), str(x), y) for t, (x, y) in enumerate(zip(self.inputs[i].tolist(), labels, strict=True))
        ]
        width = max(len(s) for col in cols for s in col)
        lines = []
        for r, head in enumerate(("pos", "input", "label")):
            lines.append(f"{head:<5} " + " ".join(col[r].rjust(width) for col in cols))
        return "\n".join(lines)


# -- argument checks ---------------------------------------------------------------------------------
def _check_common(vocab_size, num_examples, seq_len, num_pairs, seed, power_a) -> tuple:
    vocab_size = check_int("vocab_size", vocab_size, minimum=3)
    num_examples = check_int("num_examples", num_examples, minimum=1)
    seq_len = check_int("seq_len", seq_len, minimum=1)
    num_pairs = check_int("num_pairs", num_pairs, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    if isinstance(power_a, bool) or not isinstance(power_a, numbers.Real):
        raise TypeError(f"power_a must be a number, got {type(power_a).__name__} {power_a!r}")
    if not (math.isfinite(power_a) and power_a > 0):
        raise ValueError(f"power_a must be finite and > 0 (1 = uniform query slots), got {power_a}")
    return vocab_size, num_examples, seq_len, num_pairs, seed, float(power_a)


def _check_room(task: str, vocab_size: int, seq_len: int, num_pairs: int, num_writes: int) -> None:
    """Explain settings no sequence can satisfy: too short for writes + queries, too few distinct tokens."""
    context = 2 * num_writes
    need_len = context + 2 * num_pairs
    if seq_len < need_len:
        raise ValueError(
            f"{task} MQAR: seq_len={seq_len} is too short for num_pairs={num_pairs} with "
            f"{num_writes} writes: the writes take 2*{num_writes}={context} tokens and the {num_pairs} "
            f"queries need 2*{num_pairs}={2 * num_pairs} more (a query and a filler each), "
            f"so seq_len must be >= {need_len}"
        )
    need_tokens = num_pairs + num_writes
    if need_tokens > vocab_size - 1:
        raise ValueError(
            f"{task} MQAR: vocab_size={vocab_size} is too small: {num_pairs} distinct keys and {num_writes} "
            f"distinct values (one per write) need {need_tokens} distinct tokens, but only "
            f"{vocab_size - 1} (1..{vocab_size - 1}; token {FILLER_TOKEN} is the filler) exist"
        )


# -- vectorised sampling -----------------------------------------------------------------------------
def _distinct_tokens(gen: torch.Generator, rows: int, k: int, low: int, high: int) -> torch.Tensor:
    """``[rows, k]`` tokens, distinct within each row, uniform over ordered k-subsets of ``[low, high)``."""
    n = high - low
    if k * (k - 1) / (2 * n) <= _MAX_REJECTION_RATE:
        # i.i.d. draws conditioned on being distinct are uniform over ordered k-subsets: redraw bad rows.
        out = torch.randint(low, high, (rows, k), generator=gen)
        todo = torch.arange(rows)
        while True:
            srt = out[todo].sort(dim=1).values
            todo = todo[(srt[:, 1:] == srt[:, :-1]).any(dim=1)]
            if todo.numel() == 0:
                return out
            out[todo] = torch.randint(low, high, (todo.numel(), k), generator=gen)
    # the k largest of i.i.d. uniform scores, in score order: a uniform random ordered k-subset.
    step = max(1, _TOPK_ELEMENTS // n)
    parts = [
        torch.rand(min(step, rows - start), n, generator=gen, dtype=torch.float64).topk(k, dim=1).indices
        for start in range(0, rows, step)
    ]
    return torch.cat(parts) + low


def _random_order(gen: torch.Generator, rows: int, k: int) -> torch.Tensor:
    """``[rows, k]``: an independent uniform random permutation of ``0..k-1`` per row."""
    return torch.rand(rows, k, generator=gen).argsort(dim=1)


def _query_slots(
    gen: torch.Generator, rows: int, num_slots: int, num_pairs: int, power_a: float
) -> torch.Tensor:
    """``[rows, num_pairs]`` distinct slots, drawn without replacement with ``p(slot i) ∝ (i+1)^(a-1)``.

    Gumbel top-k: the top ``num_pairs`` of ``log p + Gumbel`` is a draw without replacement from ``p``.
    """
    logp = (power_a - 1.0) * torch.log(torch.arange(1, num_slots + 1, dtype=torch.float64))
    u = torch.rand(rows, num_slots, generator=gen, dtype=torch.float64).clamp_min(1e-300)
    slots = (logp - torch.log(-torch.log(u))).topk(num_pairs, dim=1).indices
    # topk sorts by score, and high scores favour early slots: decouple the query order from the write order
    return slots.gather(1, _random_order(gen, rows, num_pairs))


def _fillers(
    gen: torch.Generator, keys: torch.Tensor, shape: tuple[int, int], vocab_size: int
) -> torch.Tensor:
    """``[N, L]`` tokens uniform over ``[0, V)`` minus the row's keys (so a filler is never a key)."""
    sorted_keys = keys.sort(dim=1).values
    n = keys.shape[1]
    x = torch.randint(0, vocab_size - n, shape, generator=gen)
    # the x-th non-key token is x + #{i : s_i - i <= x}: the gaps before each sorted key are s_i - i
    gaps = (sorted_keys - torch.arange(n)).contiguous()
    return x + torch.searchsorted(gaps, x, right=True)


# -- the common assembly -----------------------------------------------------------------------------
def _assemble(
    task: str,
    *,
    vocab_size: int,
    num_examples: int,
    seq_len: int,
    num_pairs: int,
    seed: int,
    power_a: float,
    random_non_queries: bool,
    write_key: torch.Tensor,
    key_pos: torch.Tensor,
    value_pos: torch.Tensor,
    num_updates: int,
    block_size: int,
) -> MQARData:
    """Place the writes and queries of every sequence.

    ``write_key``: ``[N, W]`` or ``[W]`` index (0..n-1) of the key written by write ``w``;
    ``key_pos``/``value_pos``: ``[W]`` positions of write ``w``'s key and value in the context.
    """
    N, L, n, V = num_examples, seq_len, num_pairs, vocab_size
    W = key_pos.numel()
    gen = torch.Generator().manual_seed(seed)
    rows = torch.arange(N).unsqueeze(1)
    write_key = write_key.expand(N, W)

    tokens = _distinct_tokens(gen, N, n + W, 1, V)
    keys, values = tokens[:, :n], tokens[:, n:]  # values[:, w] is the value of write w

    inputs = torch.full((N, L), FILLER_TOKEN, dtype=torch.int64)
    inputs[:, key_pos] = keys.gather(1, write_key)
    inputs[:, value_pos] = values

    # the answer to key j is the value of its last write
    last_write = torch.full((N, n), -1, dtype=torch.int64).scatter_reduce(
        1, write_key, torch.arange(W).expand(N, W), reduce="amax"
    )
    answers = values.gather(1, last_write)
    ones = torch.ones(N, W, dtype=torch.int64)
    writes_per_key = torch.zeros(N, n, dtype=torch.int64).scatter_add(1, write_key, ones)

    context = 2 * W
    query_pos = context + 2 * _query_slots(gen, N, (L - context) // 2, n, power_a)
    if random_non_queries:
        inputs[:, context:] = _fillers(gen, keys, (N, L - context), V)
    inputs[rows, query_pos] = keys
    labels = torch.full((N, L), IGNORE_INDEX, dtype=torch.int64)
    labels[rows, query_pos] = answers
    query_writes = torch.zeros(N, L, dtype=torch.int64)
    query_writes[rows, query_pos] = writes_per_key

    def _const(x: int) -> torch.Tensor:
        return torch.full((N,), x, dtype=torch.int64)

    slices = {
        "num_pairs": _const(n),
        "num_updates": _const(num_updates),
        "block_size": _const(block_size),
        "seq_len": _const(L),
    }
    return MQARData(inputs, labels, slices, query_writes, V)


def _interleaved_positions(num_writes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``K V K V …``: write ``w`` puts its key at ``2w`` and its value at ``2w + 1``."""
    w = torch.arange(num_writes)
    return 2 * w, 2 * w + 1


# -- the three tasks ---------------------------------------------------------------------------------
def multiquery_ar(*, vocab_size: int, num_examples: int, seq_len: int, num_pairs: int, seed: int, power_a: float = 0.01,
                  random_non_queries: bool = True) -> MQARData:
    """Base MQAR with a shared vocabulary: ``n`` pairs ``k_1 v_1 … k_n v_n``, then each key queried once.

    Keys and values are ``2n`` distinct tokens of ``1..V-1`` (a token is never a key and a value of
    the same sequence); a query's label is its key's value.  Needs ``seq_len >= 4n`` and
    ``vocab_size - 1 >= 2n``.

    Example (two pairs, 0 = filler; ``15→9`` and ``10→1`` are written, then ``15`` and ``10`` are
    queried and must answer ``9`` and ``1``)::

        >>> d = multiquery_ar(vocab_size=16, num_examples=1, seq_len=12, num_pairs=2, seed=0,
        ...                   power_a=1.0, random_non_queries=False)
        >>> print(d.show(0))
        pos    0  1  2  3  4  5  6  7  8  9 10 11
        input 15  9 10  1  0  0 15  0  0  0 10  0
        label  .  .  .  .  .  .  9  .  .  .  1  .

    Args:
        vocab_size: ``V``; keys and values come from ``1..V-1``.
        num_examples: ``N`` sequences.
        seq_len: ``L`` tokens per sequence.
        num_pairs: ``n`` key→value pairs, each queried once.
        seed: the generator seed (same seed, same data).
        power_a: Zoology's power-law exponent for query slots (1 = uniform; 0.01 = Zoology's default).
        random_non_queries: fill non-query positions of the query region with random non-key tokens
            (otherwise with token 0).

    Returns:
        :class:`MQARData` with ``inputs``/``labels`` ``[N, L]``.
    """
    vocab_size, num_examples, seq_len, num_pairs, seed, power_a = _check_common(
        vocab_size, num_examples, seq_len, num_pairs, seed, power_a
    )
    _check_room("base", vocab_size, seq_len, num_pairs, num_pairs)
    key_pos, value_pos = _interleaved_positions(num_pairs)
    return _assemble(
        "base", vocab_size=vocab_size, num_examples=num_examples, seq_len=seq_len, num_pairs=num_pairs,
        seed=seed, power_a=power_a, random_non_queries=bool(random_non_queries),
        write_key=torch.arange(num_pairs), key_pos=key_pos, value_pos=value_pos, num_updates=0, block_size=1,
    )


def update_mqar(*, vocab_size: int, num_examples: int, seq_len: int, num_pairs: int, num_updates: int, seed: int,
                power_a: float = 0.01, random_non_queries: bool = True) -> MQARData:
    """Update-MQAR: ``n + u`` writes, ``u`` of them overwrite a written key; answer the latest value.

    The writes are ``K V`` pairs: every key once plus ``u`` extra writes of keys drawn uniformly (a key
    can be updated several times or not at all), in a random order per sequence, so a key's first
    write is its binding and every later write of it an update.  Every write takes a fresh value
    token (``n`` keys and ``n + u`` values, all distinct, a token is never a key and a value of one
    sequence), so ``A→4, B→5, A→4*`` must answer ``A→4*, B→5``: the label of a query is the value of
    the key's last write, and keys not updated keep theirs.  Needs ``seq_len >= 2(n + u) + 2n`` and
    ``vocab_size - 1 >= 2n + u``.

    Example (two pairs, one update: ``2→8``, ``9→13``, then ``2→11`` overwrites ``2``; the
    query of ``2`` must answer ``11``, not ``8``, and ``9`` keeps ``13``)::

        >>> d = update_mqar(vocab_size=16, num_examples=1, seq_len=12, num_pairs=2, num_updates=1,
        ...                 seed=3, power_a=1.0, random_non_queries=False)
        >>> print(d.show(0))
        pos    0  1  2  3  4  5  6  7  8  9 10 11
        input  2  8  9 13  2 11  2  0  9  0  0  0
        label  .  .  .  .  .  . 11  . 13  .  .  .
        >>> d.query_writes[0].tolist()  # writes received by each queried key
        [0, 0, 0, 0, 0, 0, 2, 0, 1, 0, 0, 0]

    Args:
        num_updates: ``u >= 0`` overwriting writes (``u = 0`` is Base MQAR with fresh randomness).
        Others as :func:`multiquery_ar`.
    """
    vocab_size, num_examples, seq_len, num_pairs, seed, power_a = _check_common(
        vocab_size, num_examples, seq_len, num_pairs, seed, power_a
    )
    num_updates = check_int("num_updates", num_updates, minimum=0)
    num_writes = num_pairs + num_updates
    _check_room("update", vocab_size, seq_len, num_pairs, num_writes)
    gen = torch.Generator().manual_seed(seed + 0x5EED)  # the write order; _assemble draws the tokens
    extra = torch.randint(0, num_pairs, (num_examples, num_updates), generator=gen)
    multiset = torch.cat([torch.arange(num_pairs).expand(num_examples, num_pairs), extra], dim=1)
    write_key = multiset.gather(1, _random_order(gen, num_examples, num_writes))
    key_pos, value_pos = _interleaved_positions(num_writes)
    return _assemble(
        "update", vocab_size=vocab_size, num_examples=num_examples, seq_len=seq_len, num_pairs=num_pairs,
        seed=seed, power_a=power_a, random_non_queries=bool(random_non_queries),
        write_key=write_key, key_pos=key_pos, value_pos=value_pos, num_updates=num_updates, block_size=1,
    )


def block_mqar(*, vocab_size: int, num_examples: int, seq_len: int, num_pairs: int, seed: int, block_size: int = 2,
               power_a: float = 0.01, random_non_queries: bool = True) -> MQARData:
    """Block-MQAR: a block of ``b`` keys, then a block of their ``b`` values, binding them in order.

    ``A B 4 5`` binds ``A→4, B→5`` (``b = 2``, the paper's block size).  Pairs are cut into blocks of
    ``block_size``; when ``b`` does not divide ``n`` the last block is shorter (``n = 3, b = 2``:
    ``A B 4 5 C 6``).  ``b = 1`` is Base MQAR.  Keys and values are ``2n`` distinct tokens (never a key
    and a value of one sequence).  Needs ``seq_len >= 4n`` and ``vocab_size - 1 >= 2n``.

    Example (``b = 2``, three pairs: ``8 15 14 9`` binds ``8→14, 15→9``; ``12 4`` is the short
    last block, ``12→4``)::

        >>> d = block_mqar(vocab_size=16, num_examples=1, seq_len=14, num_pairs=3, block_size=2,
        ...                seed=0, power_a=1.0, random_non_queries=False)
        >>> print(d.show(0))
        pos    0  1  2  3  4  5  6  7  8  9 10 11 12 13
        input  8 15 14  9 12  4 15  0  0  0 12  0  8  0
        label  .  .  .  .  .  .  9  .  .  .  4  . 14  .

    Args:
        block_size: ``b >= 1`` keys per block (a value block of the same size follows each key block).
        Others as :func:`multiquery_ar`.
    """
    vocab_size, num_examples, seq_len, num_pairs, seed, power_a = _check_common(
        vocab_size, num_examples, seq_len, num_pairs, seed, power_a
    )
    block_size = check_int("block_size", block_size, minimum=1)
    _check_room("block", vocab_size, seq_len, num_pairs, num_pairs)
    pair = torch.arange(num_pairs)
    start = (pair // block_size) * block_size  # first pair of this pair's block
    size = (num_pairs - start).clamp_max(block_size)  # the block's length (the last may be short)
    key_pos = 2 * start + (pair - start)
    value_pos = key_pos + size
    return _assemble(
        "block", vocab_size=vocab_size, num_examples=num_examples, seq_len=seq_len, num_pairs=num_pairs,
        seed=seed, power_a=power_a, random_non_queries=bool(random_non_queries),
        write_key=pair, key_pos=key_pos, value_pos=value_pos, num_updates=0, block_size=block_size,
    )


# -- pools and batches -------------------------------------------------------------------------------
@dataclass(frozen=True)
class MQARTask:
    """The structure of one segment of a pool: task kind, length, pairs, updates, block size.

    ``MQARTask("update", seq_len=128, num_pairs=16, num_updates=8)``; ``num_updates`` is only for
    ``update``, ``block_size`` only for ``block``.
    """

    kind: str
    seq_len: int
    num_pairs: int
    num_updates: int = 0
    block_size: int = 2

    def __post_init__(self):
        if self.kind not in TASKS:
            raise ValueError(f"MQARTask kind must be one of {TASKS}, got {self.kind!r}")
        if self.kind != "update" and self.num_updates != 0:
            raise ValueError(
                f"num_updates={self.num_updates} is only meaningful for kind='update', not {self.kind!r}"
            )

    def generate(
        self,
        num_examples: int,
        *,
        vocab_size: int,
        seed: int,
        power_a: float = 0.01,
        random_non_queries: bool = True,
    ) -> MQARData:
        """``num_examples`` sequences of this structure (see :func:`multiquery_ar` for the arguments)."""
        common = dict(vocab_size=vocab_size, num_examples=num_examples, seq_len=self.seq_len,
                      num_pairs=self.num_pairs, seed=seed, power_a=power_a,
                      random_non_queries=random_non_queries)
        if self.kind == "base":
            return multiquery_ar(**common)
        if self.kind == "update":
            return update_mqar(num_updates=self.num_updates, **common)
        return block_mqar(block_size=self.block_size, **common)


@dataclass
class MQARBatch:
    """One batch: ``inputs``/``labels``/``query_writes`` ``[B, L]`` and ``slices`` (each ``[B]``)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    slices: dict[str, torch.Tensor]
    query_writes: torch.Tensor

    def to(self, device: torch.device | str) -> MQARBatch:
        return MQARBatch(
            self.inputs.to(device), self.labels.to(device),
            {k: v.to(device) for k, v in self.slices.items()}, self.query_writes.to(device),
        )


@dataclass
class MQARDataset:
    """Segments of MQAR sequences (each of one length); batches never mix lengths.

    ``batches(batch_size, shuffle=True, seed=epoch)`` shuffles within each segment and the order of
    the batches across segments, reproducibly for a given seed.
    """

    segments: list[MQARData] = field(default_factory=list)

    def __post_init__(self):
        if not all(isinstance(s, MQARData) for s in self.segments):
            raise TypeError("MQARDataset segments must be MQARData objects")
        if len({s.vocab_size for s in self.segments}) > 1:
            raise ValueError(f"segments mix vocabularies {sorted({s.vocab_size for s in self.segments})}")

    def __len__(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def vocab_size(self) -> int:
        if not self.segments:
            raise ValueError("an empty MQARDataset has no vocabulary")
        return self.segments[0].vocab_size

    def num_batches(self, batch_size: int, *, drop_last: bool = False) -> int:
        batch_size = check_int("batch_size", batch_size, minimum=1)
        per = (len(s) // batch_size if drop_last else -(-len(s) // batch_size) for s in self.segments)
        return sum(per)

    def batches(
        self, batch_size: int, *, shuffle: bool = False, seed: int = 0, drop_last: bool = False
    ) -> Iterator[MQARBatch]:
        """Yield :class:`MQARBatch` es of at most ``batch_size`` sequences of one segment each."""
        batch_size = check_int("batch_size", batch_size, minimum=1)
        seed = check_int("seed", seed, minimum=0)
        gen = torch.Generator().manual_seed(seed)
        plan: list[tuple[int, torch.Tensor]] = []
        for s, seg in enumerate(self.segments):
            order = torch.randperm(len(seg), generator=gen) if shuffle else torch.arange(len(seg))
            for chunk in order.split(batch_size):
                if drop_last and chunk.numel() < batch_size:
                    continue
                plan.append((s, chunk))
        if shuffle:
            plan = [plan[i] for i in torch.randperm(len(plan), generator=gen).tolist()]
        for s, idx in plan:
            part = self.segments[s].select(idx)
            yield MQARBatch(part.inputs, part.labels, part.slices, part.query_writes)


def _segment_seed(seed: int, index: int) -> int:
    return int(np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint32)[0])


def make_pool(
    tasks: Sequence[MQARTask],
    *,
    num_examples: int,
    vocab_size: int,
    seed: int,
    val_fraction: float = 0.1,
    power_a: float = 0.01,
    random_non_queries: bool = True,
) -> tuple[MQARDataset, MQARDataset]:
    """A pool of ``num_examples`` sequences split evenly over ``tasks``, then into train and validation.

    Each task gets ``num_examples // len(tasks)`` sequences (the first ones one more for the
    remainder), generated from its own seed derived from ``seed``; ``val_fraction`` of every task's
    sequences (at least one) go to validation, so both splits cover every task.  E.g. the Update
    training pool ``[MQARTask("update", 64, 4, u) for u in (0, 1, 2, 4)] + …``.

    Returns:
        ``(train, validation)`` :class:`MQARDataset` s.
    """
    tasks = list(tasks)
    if not tasks or not all(isinstance(t, MQARTask) for t in tasks):
        raise TypeError(f"tasks must be a non-empty sequence of MQARTask, got {tasks!r}")
    num_examples = check_int("num_examples", num_examples, minimum=2 * len(tasks))
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, numbers.Real) \
            or not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be a number in (0, 1), got {val_fraction!r}")
    train, val = [], []
    base, extra = divmod(num_examples, len(tasks))
    for i, task in enumerate(tasks):
        count = base + (1 if i < extra else 0)
        data = task.generate(count, vocab_size=vocab_size, seed=_segment_seed(seed, i), power_a=power_a,
                             random_non_queries=random_non_queries)
        num_val = min(count - 1, max(1, round(val_fraction * count)))
        val.append(data.select(slice(0, num_val)))
        train.append(data.select(slice(num_val, count)))
    return MQARDataset(train), MQARDataset(val)


def accuracy_by_slice(
    predictions: torch.Tensor, labels: torch.Tensor, slice_values: torch.Tensor | None = None
) -> dict[int, tuple[int, int]]:
    """Query accuracy counts per slice value: ``{value: (correct, queries)}``.

    Args:
        predictions: ``[N, L]`` predicted token ids (e.g. ``logits.argmax(-1)``).
        labels: ``[N, L]`` with ``-100`` where there is no query.
        slice_values: ``[N]`` per-sequence slice (e.g. ``batch.slices["num_updates"]``) or ``[N, L]``
            per-position (e.g. ``batch.query_writes``); ``None`` puts every query in slice 0.

    Counts (not ratios) so batches can be summed before dividing.
    """
    if not isinstance(predictions, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("predictions and labels must be tensors")
    if predictions.shape != labels.shape or labels.dim() != 2:
        raise ValueError(f"predictions and labels must both be [N, L]; got {tuple(predictions.shape)}, "
                         f"{tuple(labels.shape)}")
    if slice_values is None:
        slice_values = torch.zeros(labels.shape[0], dtype=torch.int64, device=labels.device)
    if slice_values.dim() == 1 and slice_values.shape[0] == labels.shape[0]:
        slice_values = slice_values.unsqueeze(1).expand_as(labels)
    if slice_values.shape != labels.shape:
        raise ValueError(f"slice_values must be [N] = ({labels.shape[0]},) or [N, L] = "
                         f"{tuple(labels.shape)}, got {tuple(slice_values.shape)}")
    mask = labels != IGNORE_INDEX
    correct = (predictions == labels) & mask
    keys = slice_values[mask]
    out: dict[int, tuple[int, int]] = {}
    for value in keys.unique().tolist():
        sel = slice_values == value
        out[int(value)] = (int((correct & sel).sum()), int((mask & sel).sum()))
    return out


__all__ = [
    "FILLER_TOKEN", "IGNORE_INDEX", "MQARBatch", "MQARData", "MQARDataset", "MQARTask", "TASKS",
    "accuracy_by_slice", "block_mqar", "make_pool", "multiquery_ar", "update_mqar",
]
