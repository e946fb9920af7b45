"""Perplexity of a causal LM over windows of a token stream: the windows, and the PPL per token group.

:func:`grouped_perplexity` (all, AR-hit, other, ...) is what ``lm train`` evaluates with and ``lm eval`` and
``heldout`` report.  :func:`window_plan` cuts a stream of ``T`` tokens into windows of length ``L`` by one
of two rules (:data:`WINDOW_MODES`), and :func:`heldout_perplexity` scores them:

* ``non-overlapping`` (the paper's protocol): windows ``x_i = stream[iL : (i+1)L]`` for
  ``i < N = ⌊T/L⌋`` (the tail shorter than one window is dropped).  Each window is scored from an
  empty state and its first token is context only, so every other token is predicted exactly once,
  with 1 … L−1 tokens of context (the context resets every L tokens)::

      PPL_L = exp( Σ_i Σ_{t=1}^{L−1} CE(x_{i,t} | x_{i,<t}) / (N·(L−1)) )

* ``sliding`` with stride ``S`` (1 ≤ S < L; Hugging Face's strided perplexity): windows
  ``stream[kS : kS+L]`` for ``k < K = ⌊(T−L)/S⌋ + 1``; window 0 scores its L−1 predictions,
  window k ≥ 1 only its last S, so every token of ``stream[1 : (K−1)S+L]`` is predicted exactly once,
  all but the first L−1 of them with at least L−S tokens of context.  Costs ≈ L/S times as much.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..checks import check_int, check_optional_int
from ..training.distributed import DistContext, autocast, resolve_precision
from ..training.parallel import is_sharded

SINGLE_PROCESS = DistContext()  # the default context: one process on the CPU
WINDOW_MODES = ("non-overlapping", "sliding")


def token_cross_entropy(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token CE ``[b, L−1]`` (fp32) of predicting ``input_ids[:, 1:]`` from the prefix (every window from an
    empty state; no cache is kept, whatever the model's ``use_cache``)."""
    logits = model(input_ids=input_ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten(),
                           reduction="none").view(input_ids.shape[0], -1)


def grouped_perplexity(model, windows: np.ndarray, masks: dict[str, np.ndarray], *, batch_size: int = 4,
                       ctx: DistContext = SINGLE_PROCESS, precision: str = "fp32") -> dict[str, dict]:
    """PPL ``exp(Σ ce·mask / Σ mask)`` per group over packed ``windows [N, L]`` (docs/theory.md §8.5).

    ``masks``: group → boolean ``[N, L−1]`` aligned with the next-token loss
    (``annotation.masks(shifted=True)``).  Windows are shared out across ranks (``rank::world``)
    and the float64 sums all-reduced, so every rank returns the same numbers (a model sharded with FSDP is run
    in lockstep: every rank the same number of batches).  The model runs in
    eval mode under ``torch.no_grad``; its previous mode is restored.  Returns
    ``{group: {"ppl", "mean_ce", "n_tokens"}}``; a group with no token has ``ppl = mean_ce = None``.
    """
    from ..data.arhit import GroupedCE

    if not isinstance(windows, np.ndarray) or windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be a numpy array [N, L >= 2], got {getattr(windows, 'shape', windows)}")
    if not masks:
        raise ValueError("masks must name at least one group")
    for name, mask in masks.items():
        if tuple(mask.shape) != (windows.shape[0], windows.shape[1] - 1):
            raise ValueError(f"masks[{name!r}] has shape {tuple(mask.shape)}; windows {windows.shape} need "
                             f"[N, L-1] = {(windows.shape[0], windows.shape[1] - 1)}")
    check_int("batch_size", batch_size, minimum=1)
    dtype = resolve_precision(precision, ctx.device)
    mine = np.arange(ctx.rank, windows.shape[0], ctx.world_size)
    # a sharded model's forward is collective (each block's parameters are gathered from every rank): every
    # rank runs as many batches as the rank with the most windows, the surplus windows (window 0) unscored
    share = -(-windows.shape[0] // ctx.world_size) if ctx.distributed and is_sharded(model) else len(mine)
    rows = np.concatenate([mine, np.zeros(share - len(mine), dtype=mine.dtype)])
    groups = GroupedCE()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                idx = rows[start:start + batch_size]
                ids = torch.from_numpy(np.asarray(windows[idx], dtype=np.int64)).to(ctx.device)
                with autocast(ctx.device, dtype):
                    ce = token_cross_entropy(model, ids)
                scored = max(0, min(len(idx), len(mine) - start))
                if scored:
                    idx = idx[:scored]
                    groups.update(ce[:scored].float().cpu(), {k: m[idx] for k, m in masks.items()})
    finally:
        model.train(was_training)
    names = sorted(masks)
    sums = torch.tensor([[groups.sum_ce.get(k, 0.0), float(groups.n_tokens.get(k, 0))] for k in names],
                        dtype=torch.float64)
    if ctx.distributed:
        dist.all_reduce(sums)  # gloo and nccl both reduce float64 on this tensor's device
    groups.sum_ce = {k: float(sums[i, 0]) for i, k in enumerate(names)}
    groups.n_tokens = {k: int(round(float(sums[i, 1]))) for i, k in enumerate(names)}
    # an empty group (e.g. no hit beyond distance 256 in short windows) is null, so results stay strict JSON
    return {k: v if v["n_tokens"] else {**v, "ppl": None, "mean_ce": None} for k, v in groups.result().items()}


def window_plan(tokens: np.ndarray, length: int, *, windows: str = "non-overlapping",
                stride: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Windows ``[N, L]`` of a 1-D token stream and the boolean ``scored [N, L−1]`` mask of their predictions.

    ``scored[i, t]`` says whether the prediction of ``windows[i, t+1]`` counts (see the module
    docstring for both rules).  Both arrays are views where they can be (no copy of the stream).
    A stream shorter than one window raises ``ValueError``.
    """
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D integer numpy array, got {getattr(tokens, 'shape', type(tokens))}")
    length = check_int("length", length, minimum=2)
    if windows not in WINDOW_MODES:
        raise ValueError(f"windows must be one of {WINDOW_MODES}, got {windows!r}")
    if tokens.shape[0] < length:
        raise ValueError(f"a stream of {tokens.shape[0]} tokens holds no window of length {length}")
    if windows == "non-overlapping":
        if stride is not None:
            raise ValueError(f"stride applies to windows='sliding' only, got stride={stride!r}")
        n = tokens.shape[0] // length
        out = tokens[: n * length].reshape(n, length)
        return out, np.broadcast_to(np.True_, (n, length - 1))
    if stride is None:
        raise ValueError("windows='sliding' needs a stride")
    stride = check_int("stride", stride, minimum=1)
    if stride >= length:
        raise ValueError(f"stride must be < length for sliding windows (stride = length is non-overlapping "
                         f"with the first token of each window unscored), got stride {stride}, length {length}")
    out = np.lib.stride_tricks.sliding_window_view(tokens, length)[::stride]
    scored = np.zeros((out.shape[0], length - 1), dtype=bool)
    scored[0] = True
    scored[1:, length - 1 - stride:] = True  # the S tokens the previous window did not reach
    return out, scored


def heldout_perplexity(model: torch.nn.Module, windows: np.ndarray, *, batch_size: int = 1,
                       ctx: DistContext = SINGLE_PROCESS, precision: str = "fp32", max_windows: int | None = None,
                       scored: np.ndarray | None = None) -> dict:
    """PPL ``exp(Σ CE / n)`` of next-token predictions over ``windows [N, L]`` (each from an empty state).

    Every window is one independent forward pass: the model starts from an empty state and the
    window's first token is context only, so with ``scored=None`` the ``n = N·(L−1)`` predictions
    ``x_{i,t} | x_{i,<t}`` (``t = 1 … L−1``) all count.  ``scored [N, L−1]`` (boolean) keeps only
    some of them (the sliding rule of :func:`window_plan`).  ``max_windows`` keeps the first
    ``max_windows`` windows.  Sums are float64; windows are shared out across ranks and the sums
    all-reduced by :func:`bayeslayer.evaluation.perplexity.grouped_perplexity`, so every rank returns the
    same numbers.

    Returns ``{"ppl", "mean_ce", "n_tokens", "windows"}``.
    """
    if not callable(model):
        raise TypeError(f"model must be a causal LM module, got {type(model).__name__}")
    if not isinstance(windows, np.ndarray) or windows.ndim != 2 or windows.shape[1] < 2 or windows.shape[0] < 1:
        raise ValueError(f"windows must be a numpy array [N >= 1, L >= 2], got {getattr(windows, 'shape', windows)}")
    if not np.issubdtype(windows.dtype, np.integer):
        raise TypeError(f"windows must hold integer token ids, got dtype {windows.dtype}")
    max_windows = check_optional_int("max_windows", max_windows, minimum=1)
    n_windows, length = windows.shape
    if scored is None:
        scored = np.broadcast_to(np.True_, (n_windows, length - 1))
    if not isinstance(scored, np.ndarray) or scored.dtype != np.bool_ or scored.shape != (n_windows, length - 1):
        raise ValueError(f"scored must be a boolean numpy array [N, L-1] = {(n_windows, length - 1)}, got "
                         f"{getattr(scored, 'dtype', type(scored))} {getattr(scored, 'shape', '')}")
    if max_windows is not None:
        windows, scored = windows[:max_windows], scored[:max_windows]
    result = grouped_perplexity(model, windows, {"scored": scored}, batch_size=batch_size, ctx=ctx,
                                precision=precision)["scored"]
    if not result["n_tokens"]:
        raise ValueError("scored selects no prediction; nothing to average")
    return {"ppl": result["ppl"], "mean_ce": result["mean_ce"], "n_tokens": result["n_tokens"],
            "windows": int(windows.shape[0])}


__all__ = ["WINDOW_MODES", "grouped_perplexity", "heldout_perplexity", "token_cross_entropy", "window_plan"]
