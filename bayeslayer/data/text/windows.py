"""Windows: a token stream packed into non-overlapping ``[N, seq_len]`` views, and a torch ``Dataset`` of them."""

from __future__ import annotations

import numpy as np
import torch
import torch.utils.data


def pack_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Pack a 1-D stream into non-overlapping windows ``[len(tokens) // seq_len, seq_len]``.

    The tail shorter than ``seq_len`` is dropped; a stream shorter than one
    window is an error, not an empty dataset.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D numpy array, got {getattr(tokens, 'shape', type(tokens))}")
    n = tokens.shape[0] // seq_len
    if n == 0:
        raise ValueError(f"a stream of {tokens.shape[0]} tokens holds no window of seq_len {seq_len}")
    return tokens[: n * seq_len].reshape(n, seq_len)


class PackedWindows(torch.utils.data.Dataset):
    """Packed windows as a map-style torch ``Dataset``.

    Item ``i`` is ``{"input_ids": LongTensor[L], "labels": LongTensor[L]}``
    with ``labels = input_ids`` (the model shifts them, as Hugging Face
    causal LMs do).  Works with ``DistributedSampler``.  Built from a cached
    stream (:meth:`from_stream`, what ``TextCorpus.dataset`` does), it pickles
    as the cache file's path, so DataLoader workers started with ``spawn``
    reopen the memmap instead of receiving a copy of the ids.
    """

    def __init__(self, windows: np.ndarray) -> None:
        if not isinstance(windows, np.ndarray) or windows.ndim != 2:
            raise ValueError(f"windows must be a 2-D numpy array [N, L], got {getattr(windows, 'shape', None)}")
        self.windows = windows
        self._source: tuple[str, str, int, int] | None = None

    @classmethod
    def from_stream(cls, stream, seq_len: int) -> PackedWindows:
        """Windows [N, seq_len] of a cached token stream (a :class:`~bayeslayer.data.text.cache.TokenStream`;
        not imported here, so that windows.py depends on nothing else of the package)."""
        dataset = cls(stream.windows(seq_len))
        dataset._source = (str(stream.path), stream.tokens.dtype.str, int(stream.tokens.shape[0]), int(seq_len))
        return dataset

    def __getstate__(self) -> dict:
        if self._source is not None:
            return {"source": self._source}
        return {"source": None, "windows": self.windows}

    def __setstate__(self, state: dict) -> None:
        self._source = state["source"]
        if self._source is None:
            self.windows = state["windows"]
        else:
            path, dtype, n_tokens, seq_len = self._source
            self.windows = pack_windows(np.memmap(path, dtype=np.dtype(dtype), mode="r", shape=(n_tokens,)), seq_len)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> dict:
        ids = torch.from_numpy(np.asarray(self.windows[index], dtype=np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


def epoch_permutation(n_windows: int, seed: int, epoch: int) -> np.ndarray:
    """The window order of one epoch: a permutation of ``range(n_windows)`` drawn from ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch, 0x4C4D]).permutation(n_windows)

class WindowSchedule:
    """Which train windows each optimiser step reads: a pure function of ``(seed, step)``.

    Global sample ``g = step · batch_size + i`` is window ``perm_e[g mod N]`` of epoch
    ``e = g div N``.  Rank ``r`` of ``W`` takes the ``r``-th contiguous ``batch_size / W`` share.
    """

    def __init__(self, n_windows: int, batch_size: int, seed: int) -> None:
        if n_windows < 1:
            raise ValueError("the train split has no complete window; use a shorter seq_len or more text")
        self.n_windows, self.batch_size, self.seed = n_windows, batch_size, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: epoch_permutation(self.n_windows, self.seed, epoch)}  # keep one epoch
        return self._perms[epoch]

    def step_windows(self, step: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        share = self.batch_size // world_size
        g = step * self.batch_size + rank * share + np.arange(share)
        out = np.empty(share, dtype=np.int64)
        for epoch in np.unique(g // self.n_windows):
            sel = g // self.n_windows == epoch
            out[sel] = self._perm(int(epoch))[g[sel] % self.n_windows]
        return out
