"""The language model's generation cache: one mixer-state dict per layer.

A recurrent mixer's state is its fixed-size memory (``{"recurrent": (M, P), "conv": ...}``);
an attention mixer's is its growing key/value cache.  The model hands each layer's
dict back to its mixer on the next call (the mixer contract in
:mod:`bayeslayer.layers`); this class only stores the dicts, counts tokens, and
implements what ``transformers``' ``generate()`` asks of a cache (beam reordering,
batch expansion).  A recurrent state cannot be rolled back, so ``crop`` refuses to
shorten it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..checks import check_int


def _map_tensors(value: Any, fn) -> Any:
    """Apply ``fn`` to every tensor in a nest of dicts/tuples/lists (other leaves pass through)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_map_tensors(item, fn) for item in value)
    if isinstance(value, list):
        return [_map_tensors(item, fn) for item in value]
    if value is None or isinstance(value, (int, float, bool, str)):
        return value
    raise TypeError(f"cannot map a mixer state entry of type {type(value).__name__}")


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


class MixerStateLayer(CacheLayerMixin):
    """The cache of one layer: the mixer's state dict (``None`` before the first call) and a token count."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self) -> None:
        super().__init__()
        self.state: dict | None = None
        self.seen_tokens = 0

    def lazy_initialization(self, key_states, value_states=None) -> None:  # pragma: no cover - unused
        raise NotImplementedError("a mixer-state cache layer is filled by the mixer's returned state dict")

    def update(self, *args, **kwargs):  # pragma: no cover - unused
        raise NotImplementedError(
            "MixerStateLayer stores the state dict a bayeslayer mixer returns; use BayesLayerCache.set_state"
        )

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def _map(self, fn) -> None:
        if self.state is not None:
            self.state = _map_tensors(self.state, fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices.to(t.device)])

    def crop(self, max_length: int) -> None:
        target = self.seen_tokens + max_length if max_length < 0 else max_length
        if target >= self.seen_tokens:
            return
        raise NotImplementedError(
            f"cannot roll a recurrent mixer state back from {self.seen_tokens} to {target} tokens"
        )

    def offload(self) -> None:
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self.state = None
        self.seen_tokens = 0


class BayesLayerCache(Cache):
    """Per-layer mixer states for :class:`~bayeslayer.models.BayesLayerForCausalLM`.

    ``cache[i]`` is layer ``i``'s state dict (``None`` before its first forward);
    ``cache.get_seq_length()`` the number of tokens consumed so far (padding included).
    """

    is_compileable = False

    def __init__(self, num_layers: int) -> None:
        num_layers = check_int("num_layers", num_layers, minimum=1)
        super().__init__(layers=[MixerStateLayer() for _ in range(num_layers)])

    def __getitem__(self, layer_idx: int) -> dict | None:
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"the cache has {len(self.layers)} layers, asked for layer {layer_idx}")
        return self.layers[layer_idx].state

    def set_state(self, layer_idx: int, state: dict | None, num_new_tokens: int) -> None:
        """Store the state a mixer returned after reading ``num_new_tokens`` more tokens."""
        if state is not None and not isinstance(state, dict):
            raise TypeError(f"a mixer state must be a dict or None, got {type(state).__name__}")
        layer = self.layers[layer_idx]
        layer.state = state
        layer.seen_tokens += int(num_new_tokens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if not 0 <= layer_idx < len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    @property
    def batch_size(self) -> int:
        for layer in self.layers:
            if layer.state is not None:
                first = _first_tensor(layer.state)
                if first is not None:
                    return first.shape[0]
        return -1
