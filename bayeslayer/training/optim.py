"""AdamW parameter groups: which parameters weight decay pulls towards zero.

Decoupled weight decay shrinks a parameter ``θ ← θ − lr·λ·θ`` every step.  That is a sensible prior
for the weight matrices of projections, embeddings and convolutions, and a wrong one for:

* parameters a layer flags with ``p._no_weight_decay = True`` — the recurrence's own parameters,
  whose value *is* a time scale or a noise level, not a weight: ``A_log`` and ``dt_bias`` (decay
  ``α = exp(−exp(A_log)·softplus(a + dt_bias))``), the Bayesian Layer's noise biases ``r2_bias``,
  ``ell2_bias`` and rotation ``theta_bias``, Mamba-2's skip ``D``.  Decaying ``A_log`` towards 0 pulls
  every head's decay rate towards ``exp(0) = 1`` — a learned timescale drifts to a fixed one; the
  package's own normalisation gain (``GatedRMSNorm.weight``) carries the same flag;
* the weights (and biases) of PyTorch's normalisation layers, whose neutral value is 1, not 0;
* every bias (a shift, not an interaction).

This is the convention the ``_no_weight_decay`` flag comes from — the flash-attention / Mamba training
code's ``group_parameters_for_optimizer`` (``training/src/optim/param_grouping.py`` in
Dao-AILab/flash-attention) — and the flag is what flash-linear-attention's layers set on the same
parameters.  (That code also exempts embeddings; here embeddings are decayed like other weights.
fla's ``flame`` trainer passes one ``weight_decay`` to every parameter, flags notwithstanding.)

:func:`param_groups` is the one place that rule lives; the one optimiser in bayeslayer, built by
:func:`bayeslayer.training.loop.train_loop` (which ``harness.train`` and ``lm_run.train_lm`` call), takes its
groups from it.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch.nn as nn

#: PyTorch's normalisation module types, whose parameters are never decayed (their weights scale a
#: normalised signal).  The package's own norms flag their gains ``_no_weight_decay`` instead, so this
#: module needs to know no layer class.
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)

#: Recorded in results configs so a reader (and a run cache) can tell which rule trained a model.
DECAY_POLICY = "no decay: _no_weight_decay-flagged, norm and bias parameters; decay: all others"


def no_decay_reason(name: str, param: nn.Parameter, owner: nn.Module) -> str | None:
    """Why ``param`` (called ``name`` inside ``owner``, the module that holds it directly) is not decayed.

    Returns ``"flagged"``, ``"norm"``, ``"bias"`` or ``None`` (decayed).
    """
    if getattr(param, "_no_weight_decay", False):
        return "flagged"
    if isinstance(owner, NORM_TYPES):
        return "norm"
    if name == "bias" or name.endswith("_bias"):
        return "bias"
    return None


def decay_split(model: nn.Module) -> dict[str, str | None]:
    """``{qualified parameter name: no_decay_reason(...)}`` for every trainable parameter of ``model``.

    A parameter shared by two modules (tied weights) is listed once, under its first name, and is not
    decayed if either owner would exempt it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    reasons: dict[int, str | None] = {}
    names: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for local, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            key = id(p)
            names.setdefault(key, f"{module_name}.{local}" if module_name else local)
            why = no_decay_reason(local, p, module)
            if key not in reasons or (reasons[key] is None and why is not None):
                reasons[key] = why
    return {names[k]: reasons[k] for k in names}


def param_groups(model: nn.Module, weight_decay: float, groups: Sequence[dict] | None = None) -> list[dict]:
    """AdamW parameter groups of ``model``: ``weight_decay`` on weights, 0 on the exempt parameters.

    Args:
        model: the module whose parameters are trained (names and owning modules come from it).
        weight_decay: the decay of the non-exempt parameters (``>= 0``).
        groups: optional groups chosen by the caller (``{"params": [...], **options}``, e.g. one learning
            rate per part); each is split in two with its options kept.  A group that sets its own
            ``"weight_decay"`` is passed through unchanged (its author chose).  ``None``: one group of every
            trainable parameter of ``model``.

    Returns:
        ``[{"params", "weight_decay", "decay": bool, **options}, ...]`` for ``torch.optim.AdamW``; empty
        halves are left out; parameters keep ``model.named_parameters()`` order inside a group (so a
        resumed optimiser state lines up).  Raises ``ValueError`` when a group holds a parameter that is
        not in ``model`` or when a parameter appears in two groups.
    """
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, numbers.Real) or not (
            0 <= float(weight_decay) < float("inf")):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    split = decay_split(model)
    by_id = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    order = {n: i for i, n in enumerate(by_id.values())}
    if groups is None:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if isinstance(groups, dict) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise TypeError("groups must be a list of dicts, each with a 'params' list")
    seen: set[int] = set()
    out: list[dict] = []
    for group in groups:
        params = list(group["params"])
        for p in params:
            if id(p) not in by_id:
                raise ValueError(f"groups hold a parameter of shape {tuple(p.shape)} that is not a trainable "
                                 f"parameter of the model")
            if id(p) in seen:
                raise ValueError(f"parameter {by_id[id(p)]!r} appears in two groups")
            seen.add(id(p))
        options = {k: v for k, v in group.items() if k != "params"}
        if "weight_decay" in options:
            out.append({"params": params, **options})
            continue
        params.sort(key=lambda p: order[by_id[id(p)]])
        decay = [p for p in params if split[by_id[id(p)]] is None]
        keep = [p for p in params if split[by_id[id(p)]] is not None]
        for chosen, wd, flag in ((decay, float(weight_decay), True), (keep, 0.0, False)):
            if chosen:
                out.append({"params": chosen, **options, "weight_decay": wd, "decay": flag})
    return out


__all__ = ["DECAY_POLICY", "NORM_TYPES", "decay_split", "no_decay_reason", "param_groups"]
