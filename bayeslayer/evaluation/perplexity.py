"""Perplexity of a causal LM over packed windows, per token group (all, AR-hit, other, ...).

``grouped_perplexity`` is what ``lm train`` evaluates with and ``lm eval`` and ``heldout`` report.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..checks import check_int
from ..training.distributed import DistContext, autocast, resolve_precision

SINGLE_PROCESS = DistContext()  # the default context: one process on the CPU


def token_cross_entropy(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token CE ``[b, L−1]`` (fp32) of predicting ``input_ids[:, 1:]`` from the prefix."""
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten(),
                           reduction="none").view(input_ids.shape[0], -1)

def grouped_perplexity(model, windows: np.ndarray, masks: dict[str, np.ndarray], *, batch_size: int = 4,
                       ctx: DistContext = SINGLE_PROCESS, precision: str = "fp32") -> dict[str, dict]:
    """PPL ``exp(Σ ce·mask / Σ mask)`` per group over packed ``windows [N, L]`` (docs/theory.md §8.5).

    ``masks``: group → boolean ``[N, L−1]`` aligned with the next-token loss
    (``annotation.masks(shifted=True)``).  Windows are shared out across ranks (``rank::world``)
    and the float64 sums all-reduced, so every rank returns the same numbers.  The model runs in
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
    groups = GroupedCE()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(mine), batch_size):
                idx = mine[start:start + batch_size]
                ids = torch.from_numpy(np.asarray(windows[idx], dtype=np.int64)).to(ctx.device)
                with autocast(ctx.device, dtype):
                    ce = token_cross_entropy(model, ids)
                groups.update(ce.float().cpu(), {k: m[idx] for k, m in masks.items()})
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


__all__ = ["grouped_perplexity", "token_cross_entropy"]
