"""AR-hit annotation of packed evaluation windows (docs/theory.md §8.5) and grouped perplexity.

Definitions (``x`` is one packed window of ``L`` tokens, positions ``t = 0..L-1``):

* the *bigram at t* (for ``t >= 1``) is ``(x[t-1], x[t])``;
* its *earlier occurrence* is the largest ``s < t``, ``s >= 1``, in the **same
  window** with ``(x[s-1], x[s]) == (x[t-1], x[t])``; occurrences may overlap
  (in ``a a a`` the bigram ``(a, a)`` at ``t = 2`` has its earlier occurrence at
  ``s = 1``);
* its *distance* is ``t - s``: the number of positions between the second token
  of the earlier occurrence and the second token of this one (``0`` when there
  is no earlier occurrence in the window);
* token ``t`` is an **AR-hit** when an earlier occurrence exists, its distance
  is ``<= 1024``, and the bigram occurs ``<= 16`` times in the training token
  stream (a bigram never seen in training has count 0 and qualifies);
* an AR-hit falls in a *distance bucket*: 1-64, 65-256 or 257-1024.

Position 0 of every window has no bigram and no prediction from inside the
window, so it is in no group (not even ``all``).  Bigrams never cross windows:
a repeat whose earlier occurrence lies in a previous window is not a hit.

The annotation is vectorised numpy and linear in the number of tokens: bigrams
are encoded as int64 keys ``x[t-1] * vocab_size + x[t]``, put in key order by a
least-significant-digit radix argsort (16-bit digits, each pass a stable numpy
radix sort), and in that order each position's predecessor with the same key is
its most recent earlier occurrence.  Training counts come from the same sort
over the training stream, computed once (:meth:`BigramCounts.from_tokens`) and
looked up by binary search for the evaluation tokens.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bayeslayer.checks import check_int
from bayeslayer.files import atomic_write

MAX_DISTANCE = 1024
MAX_TRAIN_COUNT = 16
BUCKETS: tuple[tuple[int, int], ...] = ((1, 64), (65, 256), (257, 1024))
GROUPS_ORDER = ("all", "ar_hit", "other")


def bucket_name(low: int, high: int) -> str:
    """Name of the AR-hit group for distances ``low..high``, e.g. ``ar_hit_1_64``."""
    return f"ar_hit_{low}_{high}"


# --------------------------------------------------------------------------- validation


def _check_int_array(name: str, x, *, ndim: int, vocab_size: int | None = None) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy array (or torch tensor), got {type(x).__name__}")
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"{name} must hold integer token ids, got dtype {x.dtype}")
    if x.ndim != ndim:
        want = "[T]" if ndim == 1 else "[N, L]"
        raise ValueError(f"{name} must be {want} ({ndim}-D), got shape {x.shape}")
    if x.size:
        low, high = int(x.min()), int(x.max())
        if low < 0:
            raise ValueError(f"{name} holds negative token ids (min {low})")
        if vocab_size is not None and high >= vocab_size:
            raise ValueError(f"{name} holds token id {high} >= vocab_size {vocab_size}")
    return x


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_vocab_size(vocab_size) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if not 1 <= int(vocab_size) <= 3_000_000_000:  # keys vocab_size**2 must fit in int64
        raise ValueError(f"vocab_size must be in [1, 3e9], got {vocab_size}")
    return int(vocab_size)


def _check_buckets(buckets, max_distance: int) -> tuple[tuple[int, int], ...]:
    out = tuple((int(lo), int(hi)) for lo, hi in buckets)
    prev_hi = 0
    for lo, hi in out:
        if not (lo == prev_hi + 1 and hi >= lo):
            raise ValueError(f"buckets must be contiguous ranges starting at 1, got {out}")
        prev_hi = hi
    if prev_hi != max_distance:
        raise ValueError(f"buckets must end at max_distance {max_distance}, got {out}")
    return out


# --------------------------------------------------------------------------- keys and sorting


def _radix_argsort(keys: np.ndarray, max_key: int) -> np.ndarray:
    """Stable argsort of non-negative int64 ``keys < max_key`` in O(n · ceil(bits/16)).

    Least-significant digit first; numpy's stable sort of a uint16 array is a
    radix sort, so each pass is linear and stability carries the lower digits.
    """
    perm = np.arange(keys.shape[0], dtype=np.int64)
    bits = max(1, int(max_key - 1).bit_length())
    for shift in range(0, bits, 16):
        digit = ((keys[perm] >> shift) & 0xFFFF).astype(np.uint16)
        perm = perm[np.argsort(digit, kind="stable")]
    return perm


def _bigram_keys(prev: np.ndarray, cur: np.ndarray, vocab_size: int) -> np.ndarray:
    return prev.astype(np.int64) * vocab_size + cur.astype(np.int64)


# --------------------------------------------------------------------------- training counts


@dataclass(frozen=True)
class BigramCounts:
    """How often each bigram occurs in a training token stream.

    ``keys``: int64 [U], sorted unique bigram keys ``prev * vocab_size + cur``;
    ``counts``: int64 [U], occurrences of each; ``n_tokens``: stream length.
    """

    keys: np.ndarray
    counts: np.ndarray
    vocab_size: int
    n_tokens: int

    @classmethod
    def from_tokens(cls, tokens, vocab_size: int, *, chunk_tokens: int = 1 << 24) -> BigramCounts:
        """Count every bigram ``(tokens[i-1], tokens[i])``, ``i = 1..T-1``, of a 1-D stream.

        Runs in chunks of ``chunk_tokens`` (chunks overlap by one token so no
        bigram is lost at a seam); memory stays O(chunk + unique bigrams).
        """
        vocab_size = _check_vocab_size(vocab_size)
        chunk_tokens = check_int("chunk_tokens", chunk_tokens, minimum=2)
        tokens = _check_int_array("tokens", tokens, ndim=1, vocab_size=vocab_size)
        n = tokens.shape[0]
        if n < 2:
            raise ValueError(f"tokens must hold at least 2 tokens to have a bigram, got {n}")
        max_key = vocab_size * vocab_size
        parts_keys, parts_counts = [], []
        for start in range(0, n - 1, chunk_tokens):
            chunk = np.asarray(tokens[start : min(n, start + chunk_tokens + 1)])
            keys, counts = _unique_counts(_bigram_keys(chunk[:-1], chunk[1:], vocab_size), max_key)
            parts_keys.append(keys)
            parts_counts.append(counts)
        if len(parts_keys) == 1:
            keys, counts = parts_keys[0], parts_counts[0]
        else:
            keys, counts = _unique_counts(np.concatenate(parts_keys), max_key, np.concatenate(parts_counts))
        return cls(keys=keys, counts=counts, vocab_size=vocab_size, n_tokens=int(n))

    def lookup(self, prev, cur) -> np.ndarray:
        """Training count of each bigram ``(prev[i], cur[i])``; int64, 0 when unseen."""
        prev = np.asarray(prev)
        cur = np.asarray(cur)
        if prev.shape != cur.shape:
            raise ValueError(f"prev and cur must have one shape, got {prev.shape} and {cur.shape}")
        return self.lookup_keys(_bigram_keys(prev, cur, self.vocab_size))

    def lookup_keys(self, keys: np.ndarray) -> np.ndarray:
        """Training count of each bigram key; int64, 0 when unseen.

        Binary search; pass sorted keys when you can: the search then walks
        ``self.keys`` in order and stays in cache.
        """
        if self.keys.size == 0:
            return np.zeros(keys.shape, dtype=np.int64)
        idx = np.minimum(np.searchsorted(self.keys, keys), self.keys.size - 1)
        return np.where(self.keys[idx] == keys, self.counts[idx], 0).astype(np.int64)

    def save(self, path: str | os.PathLike) -> None:
        """Write to ``path`` (``.npz``) atomically and durably (:func:`bayeslayer.files.atomic_write`)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, "wb") as fh:
            np.savez(
                fh,
                keys=self.keys,
                counts=self.counts,
                meta=np.array(json.dumps({"vocab_size": self.vocab_size, "n_tokens": self.n_tokens})),
            )

    @classmethod
    def load(cls, path: str | os.PathLike) -> BigramCounts:
        """Read what :meth:`save` wrote; a damaged file raises ``ValueError`` naming it."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no bigram counts at {path}")
        try:
            with np.load(path, allow_pickle=False) as data:
                keys, counts = data["keys"], data["counts"]
                meta = json.loads(str(data["meta"]))
        except Exception as exc:  # zip/npy errors come in many types; all mean "damaged"
            raise ValueError(f"bigram counts file {path} is damaged ({exc}); delete it to rebuild") from exc
        increasing = keys.size < 2 or bool(np.all(keys[1:] > keys[:-1]))
        if keys.shape != counts.shape or keys.ndim != 1 or not increasing:
            raise ValueError(f"bigram counts file {path} is inconsistent; delete it to rebuild")
        vocab_size, n_tokens = int(meta["vocab_size"]), int(meta["n_tokens"])
        return cls(keys=keys, counts=counts, vocab_size=vocab_size, n_tokens=n_tokens)


def _unique_counts(keys: np.ndarray, max_key: int, weights: np.ndarray | None = None):
    """Sorted unique keys and their (weighted) counts, by radix sort: linear time."""
    if keys.size == 0:
        return keys.astype(np.int64), np.zeros(0, dtype=np.int64)
    order = _radix_argsort(keys, max_key)
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    if weights is None:
        counts = np.diff(np.r_[starts, sorted_keys.size])
    else:
        counts = np.add.reduceat(weights[order], starts)
    return sorted_keys[starts], counts.astype(np.int64)


# --------------------------------------------------------------------------- annotation


@dataclass(frozen=True)
class ARHitAnnotation:
    """Per-token AR-hit annotation of packed windows; every array is [N, L].

    ``distance``: ``t - s`` to the most recent earlier occurrence of the same
    bigram in the window (0 when none; recorded even past ``max_distance``);
    ``train_count``: the bigram's training count (0 at ``t = 0``);
    ``is_hit``: the AR-hit flag; ``bucket``: index into ``buckets`` for hits,
    -1 otherwise.
    """

    is_hit: np.ndarray
    distance: np.ndarray
    train_count: np.ndarray
    bucket: np.ndarray
    buckets: tuple[tuple[int, int], ...] = BUCKETS

    def masks(self, *, shifted: bool = False) -> dict[str, np.ndarray]:
        """Boolean masks per group: ``all``, ``ar_hit``, ``other`` and one per bucket.

        ``shifted=False``: [N, L], aligned with token positions (column 0 is
        always False).  ``shifted=True``: [N, L-1], aligned with the usual
        next-token loss ``CE(logits[:, :-1], input_ids[:, 1:])`` whose column
        ``j`` scores token ``j + 1``.
        """
        evaluated = np.ones(self.is_hit.shape, dtype=bool)
        evaluated[:, 0] = False
        out = {"all": evaluated, "ar_hit": self.is_hit.copy(), "other": evaluated & ~self.is_hit}
        for i, (low, high) in enumerate(self.buckets):
            out[bucket_name(low, high)] = self.bucket == i
        if shifted:
            out = {name: np.ascontiguousarray(mask[:, 1:]) for name, mask in out.items()}
        return out


def annotate_ar_hits(
    windows,
    train_counts: BigramCounts,
    *,
    max_distance: int = MAX_DISTANCE,
    max_train_count: int = MAX_TRAIN_COUNT,
    buckets: Sequence[tuple[int, int]] = BUCKETS,
) -> ARHitAnnotation:
    """Annotate every token of packed windows ``[N, L]`` with its AR-hit flag and bucket.

    Worked example (one window, ``vocab_size = 10``; the training stream
    ``3 4 3 4 3 4`` has bigram ``(3, 4)`` 3 times and ``(4, 3)`` twice, so the
    window's other bigrams have count 0; with ``max_train_count = 2``, ``(3, 4)``
    is too frequent to be a hit)::

        t            0  1  2  3  4  5  6  7
        window       5  6  3  4  5  6  3  4
        bigram       -  56 63 34 45 56 63 34
        distance     0  0  0  0  0  4  4  4     each of 56, 63, 34 repeats 4 later
        train count  0  0  0  3  0  0  0  3
        is_hit       .  .  .  .  .  X  X  .     t=7 repeats (3,4) but it is too frequent
        bucket      -1 -1 -1 -1 -1  0  0 -1     distance 4 is in 1-64

    Args:
        windows: int array [N, L] of token ids ``< train_counts.vocab_size``.
        train_counts: bigram counts of the training stream (compute once).
        max_distance: largest distance that counts as a hit (1024 in the paper).
        max_train_count: largest training count that counts as a hit (16).
        buckets: contiguous ``(low, high)`` distance ranges from 1 to
            ``max_distance``.

    Returns:
        :class:`ARHitAnnotation` with [N, L] arrays.
    """
    if not isinstance(train_counts, BigramCounts):
        raise TypeError(f"train_counts must be a BigramCounts, got {type(train_counts).__name__}")
    windows = _check_int_array("windows", windows, ndim=2, vocab_size=train_counts.vocab_size)
    if not _is_int(max_distance) or max_distance < 1:
        raise ValueError(f"max_distance must be an int >= 1, got {max_distance!r}")
    if not _is_int(max_train_count) or max_train_count < 0:
        raise ValueError(f"max_train_count must be an int >= 0, got {max_train_count!r}")
    buckets = _check_buckets(buckets, int(max_distance))
    n_windows, length = windows.shape
    if length < 2:
        raise ValueError(f"windows must be >= 2 tokens long to hold a bigram, got shape {windows.shape}")

    vocab_size = train_counts.vocab_size
    windows = np.asarray(windows)
    prev, cur = windows[:, :-1].reshape(-1), windows[:, 1:].reshape(-1)
    keys = _bigram_keys(prev, cur, vocab_size)
    # Flat position of each bigram's second token; increasing, so a stable sort
    # by key keeps equal keys in position order.
    positions = (np.arange(n_windows, dtype=np.int64)[:, None] * length + np.arange(1, length)).reshape(-1)

    order = _radix_argsort(keys, vocab_size * vocab_size)
    sorted_keys, sorted_pos = keys[order], positions[order]
    # The predecessor in key order with the same key is the most recent earlier
    # occurrence anywhere; if it lies in another window, this window has none.
    repeat = np.r_[False, sorted_keys[1:] == sorted_keys[:-1]]
    prev_pos = np.r_[0, sorted_pos[:-1]]
    same_window = repeat & (prev_pos // length == sorted_pos // length)
    distance_flat = np.zeros(keys.size, dtype=np.int64)
    distance_flat[order] = np.where(same_window, sorted_pos - prev_pos, 0)
    # Look each distinct bigram up once, in key order (cache-friendly), then spread.
    first = ~repeat
    count_flat = np.zeros(keys.size, dtype=np.int64)
    count_flat[order] = train_counts.lookup_keys(sorted_keys[first])[np.cumsum(first) - 1]
    hit_flat = (distance_flat >= 1) & (distance_flat <= max_distance) & (count_flat <= max_train_count)
    bucket_flat = np.full(keys.size, -1, dtype=np.int8)
    for i, (low, high) in enumerate(buckets):
        bucket_flat[hit_flat & (distance_flat >= low) & (distance_flat <= high)] = i

    def full(flat: np.ndarray, fill) -> np.ndarray:
        out = np.full((n_windows, length), fill, dtype=flat.dtype)
        out[:, 1:] = flat.reshape(n_windows, length - 1)
        return out

    return ARHitAnnotation(
        is_hit=full(hit_flat, False),
        distance=full(distance_flat, 0),
        train_count=full(count_flat, 0),
        bucket=full(bucket_flat, -1),
        buckets=buckets,
    )


# --------------------------------------------------------------------------- grouped perplexity


def _as_numpy(name: str, x) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu()
        x = x.double().numpy() if x.is_floating_point() else x.numpy()
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")
    return x


class GroupedCE:
    """Running sums of token cross-entropy per group, for streaming evaluation.

    ``update(token_ce, masks)`` adds a batch; ``result()`` returns what
    :func:`ppl_by_group` returns for all batches together.  Sums are float64.
    """

    def __init__(self) -> None:
        self.sum_ce: dict[str, float] = {}
        self.n_tokens: dict[str, int] = {}

    def update(self, token_ce, masks: Mapping[str, object]) -> None:
        token_ce = _as_numpy("token_ce", token_ce)
        if not np.issubdtype(token_ce.dtype, np.floating):
            raise TypeError(f"token_ce must be floating point, got dtype {token_ce.dtype}")
        if not isinstance(masks, Mapping) or not masks:
            raise ValueError("masks must be a non-empty mapping of group name -> boolean mask")
        checked = {}
        for name, mask in masks.items():
            mask = _as_numpy(f"masks[{name!r}]", mask)
            if mask.dtype != np.bool_:
                raise TypeError(f"masks[{name!r}] must be boolean, got dtype {mask.dtype}")
            if mask.shape != token_ce.shape:
                raise ValueError(f"masks[{name!r}] has shape {mask.shape}, token_ce {token_ce.shape}")
            checked[name] = mask
        selected = np.zeros(token_ce.shape, dtype=bool)
        for mask in checked.values():
            selected |= mask
        values = token_ce[selected].astype(np.float64)
        if np.isnan(values).any():
            raise ValueError(f"token_ce holds NaN at {int(np.isnan(values).sum())} selected token(s): the model's "
                             "outputs are not numbers there (its logits overflowed)")
        if values.size and values.min() < -1e-6:
            raise ValueError(f"token_ce must be >= 0 (a cross-entropy), got min {values.min():.3g}")
        for name, mask in checked.items():
            self.sum_ce[name] = self.sum_ce.get(name, 0.0) + float(token_ce[mask].astype(np.float64).sum())
            self.n_tokens[name] = self.n_tokens.get(name, 0) + int(mask.sum())

    def result(self) -> dict[str, dict[str, float | int]]:
        out: dict[str, dict[str, float | int]] = {}
        for name, total in self.sum_ce.items():
            n = self.n_tokens[name]
            mean = total / n if n else math.nan
            out[name] = {"ppl": perplexity(mean) if n else math.nan, "mean_ce": mean, "n_tokens": n}
        return out


def perplexity(mean_ce: float) -> float:
    """``exp(mean_ce)``, and ``inf`` where that is past the largest float (a mean CE above ~709.78 nats: a
    diverged model), never an ``OverflowError``."""
    try:
        return math.exp(mean_ce)
    except OverflowError:
        return math.inf


def ppl_by_group(token_ce, masks: Mapping[str, object]) -> dict[str, dict[str, float | int]]:
    """Perplexity ``exp(mean CE)`` over exactly the tokens each mask selects.

    Args:
        token_ce: per-token cross-entropy (nats), numpy or torch, any shape;
            typically [N, L-1] from ``F.cross_entropy(..., reduction="none")``.
        masks: group name -> boolean mask of ``token_ce``'s shape, e.g.
            ``annotate_ar_hits(...).masks(shifted=True)``.

    Returns:
        ``{group: {"ppl": exp(sum(ce·mask)/sum(mask)), "mean_ce": ..., "n_tokens": ...}}``;
        a group selecting no token has ``ppl = mean_ce = nan`` and ``n_tokens = 0``.  A diverged model's
        perplexity past the largest float (or a CE of ``inf``, a probability that underflowed to 0) is
        ``inf`` (:func:`perplexity`); a NaN CE is a ``ValueError``.
    """
    groups = GroupedCE()
    groups.update(token_ce, masks)
    return groups.result()
