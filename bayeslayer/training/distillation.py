"""Distillation objectives of the retrofit (docs/theory.md §8.6): what ``bayeslayer distill`` trains with.

A pretrained Gated DeltaNet (the teacher) has layers ``L`` (default {5, 11, 17, 23})
swapped for Bayesian Layers (:func:`bayeslayer.models.replace_layers`); the student is
trained in two phases.  Writing ``y_l`` ``[B, T, d]`` for the student's layer-``l``
mixer output, ``ŷ_l`` for the teacher's on the same tokens, and ``𝓜`` for the valid
tokens (``mask``):

* **Phase A, layer matching** (all replaced layers at once)::

      NMSE_l = Σ_{t∈𝓜,c} (y_l − ŷ_l)²_{tc} / Σ_{t∈𝓜,c} (ŷ_l − μ_l)²_{tc},   μ_{l,c} = mean_{t∈𝓜} ŷ_{l,tc}
      cos_l  = mean_{t∈𝓜} ⟨y_{l,t}, ŷ_{l,t}⟩ / (‖y_{l,t}‖ ‖ŷ_{l,t}‖)
      loss_A = mean_l [ NMSE_l + 0.05 · (1 − cos_l) ]

  i.e. the mean squared error divided by the teacher output's variance, the variance
  taken over the valid tokens of the batch around each channel's mean and averaged
  over channels (so a student that outputs the teacher's per-channel mean scores 1).

* **Phase B, joint**::

      KL     = mean_{t∈𝓜} Σ_v p̂_t(v) (log p̂_t(v) − log p_t(v)),   p̂ = softmax(teacher logits / τ)
      loss_B = w_kl · τ² · KL + w_mse · mean_l NMSE_l

  ``KL(p_teacher ‖ p_student)`` (forward KL: the student must cover every token the
  teacher gives mass to), τ = 1 in the paper; weights ``(w_kl, w_mse)`` are
  (0.8, 0.2) and then (0.9, 0.1) (:func:`phase_b_weights`).

Also here: :class:`MixerOutputCapture` (forward hooks on ``model.model.layers[i].attn``),
:func:`mixer_outputs_on` (Phase A on the teacher's inputs to each replaced layer),
:func:`select_trainable` (the paper's trainable set, as optimizer parameter groups; also
the GDN-FT control's) and :class:`ParameterSnapshot` (freeze, then verify frozen); the teacher
(:func:`resolve_teacher`, :func:`load_teacher`, :func:`teacher_config`, :func:`teacher_tokenizer`); the
trainees of the two phases (:class:`LayerMatchTrainee`, :class:`JointTrainee`) and
:class:`RetrofitObjective`, each stage as an :class:`~bayeslayer.training.lm.Objective` that an LM run folder
trains (``bayeslayer distill train``).
"""

from __future__ import annotations

import copy
import hashlib
import math
import numbers
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_int
from ..files import sha256_file
from .lm import NextTokenTrainee, Objective
from .lm_config import LMConfig

#: Weight of the cosine term in the Phase A loss.
COSINE_WEIGHT = 0.05
#: Phase B weights (KL, NMSE) before and after the switch.
PHASE_B_WEIGHTS = ((0.8, 0.2), (0.9, 0.1))
#: The paper's replaced layers in the 24-layer 340M teacher.
PAPER_LAYERS = (5, 11, 17, 23)
#: Learning-rate multiplier of the selected MLP parts.
MLP_LR_SCALE = 0.1
#: The retrofit's stages: Phase A, Phase B and the GDN-FT control.
STAGES = ("phase_a", "phase_b", "gdn_ft")
_EPS = 1e-8


# ----------------------------------------------------------------------------- checks


def _check_pair(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor, ndim: int) -> None:
    for name, x in ((name_a, a), (name_b, b)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {x.dtype}")
        if x.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dims [B, T, ...], got shape {tuple(x.shape)}")
    if a.shape != b.shape:
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must have the same shape")
    if a.device != b.device:
        raise ValueError(f"{name_a} is on {a.device} but {name_b} is on {b.device}")
    if not torch.isfinite(b).all():
        raise ValueError(f"{name_b} has non-finite values")


def _check_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A float [B, T] mask of valid tokens (all ones when ``mask`` is None)."""
    B, T = like.shape[:2]
    if mask is None:
        return torch.ones(B, T, device=like.device, dtype=torch.float32)
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.shape != (B, T):
        raise ValueError(f"mask must have shape [B, T] = {(B, T)}, got {tuple(mask.shape)}")
    if mask.device != like.device:
        raise ValueError(f"mask is on {mask.device} but the outputs are on {like.device}")
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or mask.is_complex():
            raise TypeError(f"mask must be bool or integer 0/1, got {mask.dtype}")
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError("mask must hold only 0 and 1")
    mask = mask.to(torch.float32)
    if mask.sum() == 0:
        raise ValueError("mask selects no token: nothing to average over")
    return mask


# ----------------------------------------------------------------------------- Phase A terms


def normalized_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Variance-normalised squared error of one layer's outputs ``[B, T, d]`` (scalar)::

        Σ_{t∈mask,c} (student − teacher)²  /  Σ_{t∈mask,c} (teacher − μ_c)²,   μ_c = mean_{t∈mask} teacher_{tc}

    The teacher is detached (it is a target); arithmetic in float32 or wider.
    """
    _check_pair("student", student, "teacher", teacher, 3)
    m = _check_mask(mask, teacher)[..., None]
    dtype = torch.promote_types(student.dtype, torch.float32)
    s, t = student.to(dtype), teacher.detach().to(dtype)
    m = m.to(dtype)
    count = m.sum()
    mean = (t * m).sum(dim=(0, 1)) / count                       # [d] per-channel mean
    variance = (((t - mean) ** 2) * m).sum()
    if variance <= 0:
        raise ValueError("the teacher output is constant over the valid tokens: its variance is 0")
    return (((s - t) ** 2) * m).sum() / variance


def cosine_distance(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``1 − mean_{t∈mask} cos(student_t, teacher_t)``, the cosine taken over the hidden dim (scalar)."""
    _check_pair("student", student, "teacher", teacher, 3)
    m = _check_mask(mask, teacher)
    dtype = torch.promote_types(student.dtype, torch.float32)
    cos = F.cosine_similarity(student.to(dtype), teacher.detach().to(dtype), dim=-1, eps=_EPS)   # [B, T]
    m = m.to(dtype)
    return 1.0 - (cos * m).sum() / m.sum()


def _check_layer_dicts(student: dict, teacher: dict) -> list:
    if not isinstance(student, dict) or not isinstance(teacher, dict):
        raise TypeError("student_outputs and teacher_outputs must be dicts {layer: tensor [B, T, d]}")
    if not student:
        raise ValueError("no layer outputs given")
    if set(student) != set(teacher):
        raise ValueError(f"student layers {sorted(student)} and teacher layers {sorted(teacher)} differ")
    return sorted(student)


def layer_matching_loss(
    student_outputs: dict[int, torch.Tensor],
    teacher_outputs: dict[int, torch.Tensor],
    mask: torch.Tensor | None = None,
    *,
    cosine_weight: float = COSINE_WEIGHT,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Phase A: ``mean_l [NMSE_l + cosine_weight · (1 − cos_l)]`` over the replaced layers.

    Args:
        student_outputs, teacher_outputs: ``{layer: mixer output [B, T, d]}`` for the same layers.
        mask: ``[B, T]`` valid tokens (bool or 0/1), ``None`` for all.
    Returns:
        ``(loss, parts)`` with ``parts = {"nmse": mean_l NMSE_l, "cos_distance": mean_l (1 − cos_l),
        "nmse/<l>": ..., "cos_distance/<l>": ...}`` as floats for logging.
    """
    if isinstance(cosine_weight, bool) or not isinstance(cosine_weight, numbers.Real) or cosine_weight < 0:
        raise ValueError(f"cosine_weight must be a number >= 0, got {cosine_weight!r}")
    layers = _check_layer_dicts(student_outputs, teacher_outputs)
    nmse = [normalized_mse(student_outputs[i], teacher_outputs[i], mask) for i in layers]
    cos = [cosine_distance(student_outputs[i], teacher_outputs[i], mask) for i in layers]
    loss = torch.stack([a + cosine_weight * b for a, b in zip(nmse, cos, strict=True)]).mean()
    parts = {"nmse": float(torch.stack(nmse).detach().mean()), "cos_distance": float(torch.stack(cos).detach().mean())}
    for i, a, b in zip(layers, nmse, cos, strict=True):
        parts[f"nmse/{i}"] = float(a.detach())
        parts[f"cos_distance/{i}"] = float(b.detach())
    return loss, parts


# ----------------------------------------------------------------------------- Phase B terms


def kl_teacher_student(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``τ² · mean_{t∈mask} KL(p_teacher,t ‖ p_student,t)`` over next-token distributions (scalar).

    ``p = softmax(logits / τ)``; logits ``[B, T, V]``; computed in float32 or wider, the
    teacher detached.  Forward KL: ``Σ_v p_teacher (log p_teacher − log p_student)``.
    """
    _check_pair("student_logits", student_logits, "teacher_logits", teacher_logits, 3)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    m = _check_mask(mask, teacher_logits)
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_p = F.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)
    log_q = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)                 # [B, T]
    m = m.to(dtype)
    return temperature ** 2 * (kl * m).sum() / m.sum()


def phase_b_weights(step: int, switch_step: int) -> tuple[float, float]:
    """``(w_kl, w_mse)`` at ``step``: (0.8, 0.2) before ``switch_step``, (0.9, 0.1) from it on.

    The paper gives the two settings in this order but not when it switches; ``bayeslayer
    distill`` switches halfway through Phase B by default (``switch_step = steps // 2``).
    """
    for name, v in (("step", step), ("switch_step", switch_step)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    return PHASE_B_WEIGHTS[0] if step < switch_step else PHASE_B_WEIGHTS[1]


def joint_loss(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    student_outputs: dict[int, torch.Tensor],
    teacher_outputs: dict[int, torch.Tensor],
    mask: torch.Tensor | None = None,
    *,
    weights: tuple[float, float] = PHASE_B_WEIGHTS[0],
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Phase B: ``w_kl · KL(p_teacher ‖ p_student) + w_mse · mean_l NMSE_l``.

    Returns ``(loss, {"kl", "nmse", "w_kl", "w_mse"})``.
    """
    if (not isinstance(weights, (tuple, list)) or len(weights) != 2
            or not all(isinstance(w, numbers.Real) and not isinstance(w, bool) and w >= 0 for w in weights)):
        raise ValueError(f"weights must be two numbers >= 0 (w_kl, w_mse), got {weights!r}")
    kl = kl_teacher_student(teacher_logits, student_logits, mask, temperature=temperature)
    layers = _check_layer_dicts(student_outputs, teacher_outputs)
    nmse = torch.stack([normalized_mse(student_outputs[i], teacher_outputs[i], mask) for i in layers]).mean()
    w_kl, w_mse = float(weights[0]), float(weights[1])
    loss = w_kl * kl + w_mse * nmse
    return loss, {"kl": float(kl.detach()), "nmse": float(nmse.detach()), "w_kl": w_kl, "w_mse": w_mse}


# ----------------------------------------------------------------------------- hooks


def _model_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"model must have model.model.layers (a BayesLayerForCausalLM), got {type(model).__name__}")
    return layers


def _check_layer_indices(indices: Iterable[int], num_layers: int) -> list[int]:
    if isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable):
        raise TypeError(f"layers must be a list of ints, got {type(indices).__name__}")
    out = list(indices)
    if not out:
        raise ValueError("layers is empty")
    if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in out):
        raise TypeError(f"layers must be ints, got {out!r}")
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layers {bad} are out of range for a model of {num_layers} layers")
    if len(set(out)) != len(out):
        raise ValueError(f"layers has duplicates: {out}")
    return sorted(int(i) for i in out)


class MixerOutputCapture:
    """Forward hooks on ``model.model.layers[i].attn`` that keep, for the latest forward, each
    mixer's output ``o`` ``[B, T, d]`` in ``outputs[i]``, its input (the normed hidden states)
    in ``inputs[i]`` and the ``attention_mask`` it was given in ``masks[i]``::

        with MixerOutputCapture(student, [5, 11]) as s, MixerOutputCapture(teacher, [5, 11]) as t:
            student_logits = student(ids).logits
            with torch.no_grad():
                teacher_logits = teacher(ids).logits
            loss, parts = joint_loss(teacher_logits, student_logits, s.outputs, t.outputs, mask)

    The outputs keep their graph (gradients flow to the student).  Leaving the ``with``
    block (or :meth:`remove`) removes the hooks and drops the tensors.
    """

    def __init__(self, model: nn.Module, layers: Iterable[int]) -> None:
        blocks = _model_layers(model)
        self.layers = _check_layer_indices(layers, len(blocks))
        self.outputs: dict[int, torch.Tensor] = {}
        self.inputs: dict[int, torch.Tensor] = {}
        self.masks: dict[int, torch.Tensor | None] = {}
        self._handles = [blocks[i].attn.register_forward_hook(self._hook(i), with_kwargs=True)
                         for i in self.layers]

    def _hook(self, index: int):
        def hook(module, args, kwargs, output):
            self.inputs[index] = args[0] if args else kwargs["hidden_states"]
            self.masks[index] = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
            self.outputs[index] = getattr(output, "o", output[0] if isinstance(output, tuple) else output)
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.outputs, self.inputs, self.masks = {}, {}, {}

    def __enter__(self) -> MixerOutputCapture:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def mixer_outputs_on(
    model: nn.Module,
    inputs: dict[int, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
) -> dict[int, torch.Tensor]:
    """Run only the mixers ``model.model.layers[i].attn`` on given inputs ``{i: [B, T, d]}``.

    Phase A "on the same inputs": feed each student mixer the teacher's input to that layer
    (``MixerOutputCapture.inputs`` of a teacher forward), so every replaced layer learns to
    map the teacher's hidden states to the teacher's output independently of the other
    replaced layers, and no full student forward is needed::

        with torch.no_grad(), MixerOutputCapture(teacher, layers) as t:
            teacher(ids, attention_mask=mask)
            targets, inputs = dict(t.outputs), dict(t.inputs)
        loss, parts = layer_matching_loss(mixer_outputs_on(student, inputs, mask), targets, mask)
    """
    blocks = _model_layers(model)
    if not isinstance(inputs, dict) or not inputs:
        raise ValueError("inputs must be a non-empty dict {layer: hidden states [B, T, d]}")
    idxs = _check_layer_indices(list(inputs), len(blocks))
    return {i: blocks[i].attn(inputs[i], attention_mask=attention_mask).o for i in idxs}


# ----------------------------------------------------------------------------- trainable set


#: Names (prefixes within a mixer) of each part of the paper's trainable set.  Anything else
#: in a replaced mixer is a *new* projection (the Bayesian Layer's noise maps r2/ell2/theta).
_RECURRENCE = ("A_log", "dt_bias", "a_proj.", "b_proj.", "r2_bias", "ell2_bias", "theta_bias", "p0")
_OLD_PROJECTIONS = ("q_proj.", "k_proj.", "v_proj.", "q_conv1d.", "k_conv1d.", "v_conv1d.", "o_proj.")
_OUTPUT_GATE = ("g_proj.", "o_norm.")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


def _mixer_part(name: str) -> str:
    for part, prefixes in (("recurrence", _RECURRENCE), ("old_projections", _OLD_PROJECTIONS),
                           ("output_gate", _OUTPUT_GATE)):
        if name.startswith(prefixes):
            return part
    return "new_projections"


@dataclass
class TrainableSelection:
    """What :func:`select_trainable` chose.

    param_groups: for ``torch.optim.AdamW(selection.param_groups)``; each group has
        ``params``, ``lr``, ``weight_decay`` and a ``name``.
    names: full parameter names per part: ``recurrence``, ``old_projections``,
        ``new_projections``, ``output_gate`` (the replaced mixers) and ``mlp``.
    frozen: names of every other parameter (``requires_grad`` is now False).
    """

    param_groups: list[dict]
    names: dict[str, list[str]]
    frozen: list[str] = field(repr=False)

    @property
    def trainable(self) -> list[str]:
        return [n for part in self.names.values() for n in part]


def select_trainable(
    model: nn.Module,
    layers: Iterable[int] = PAPER_LAYERS,
    *,
    lr: float,
    mlp_parts: Sequence[str] = (),
    mlp_lr_scale: float = MLP_LR_SCALE,
    weight_decay: float = 0.0,
) -> TrainableSelection:
    """Freeze ``model`` except the paper's trainable set, and return its optimizer groups.

    Trainable: every parameter of the mixers ``model.model.layers[i].attn`` for ``i`` in
    ``layers`` — the recurrence (decay ``A_log``/``dt_bias``/``a_proj``, a Bayesian Layer's
    noise biases or a GDN's ``b_proj``), the old projections (``q/k/v/o_proj`` and short
    convolutions, initialised from the teacher), the new projections (the Bayesian Layer's
    ``r2_proj``/``ell2_proj``/``theta_proj``) and the output gate (``g_proj``, ``o_norm``);
    optionally ``mlp_parts`` (any of ``gate_proj``, ``up_proj``, ``down_proj``) of the same
    layers' MLPs, at ``mlp_lr_scale · lr``.  Norms outside the mixers, embeddings, the head
    and all other layers are frozen.

    The same call on the unmodified teacher gives the GDN-FT control's trainable set
    (its GDN mixers at the same layers, the same MLP parts).

    ``weight_decay`` applies to matrices only (parameters with ≥ 2 dims); vectors (biases,
    norm weights, ``A_log``, ``dt_bias``) get none.
    """
    blocks = _model_layers(model)
    idxs = _check_layer_indices(layers, len(blocks))
    for name, v, positive in (("lr", lr, True), ("mlp_lr_scale", mlp_lr_scale, True),
                              ("weight_decay", weight_decay, False)):
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
        if not ok or (v <= 0 if positive else v < 0):
            raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}")
    if isinstance(mlp_parts, str) or not all(p in MLP_PARTS for p in mlp_parts):
        raise ValueError(f"mlp_parts must be a list drawn from {MLP_PARTS}, got {mlp_parts!r}")

    names: dict[str, list[str]] = {"recurrence": [], "old_projections": [], "new_projections": [],
                                   "output_gate": [], "mlp": []}
    chosen: dict[str, nn.Parameter] = {}
    for i in idxs:
        for n, p in blocks[i].attn.named_parameters():
            full = f"model.layers.{i}.attn.{n}"
            names[_mixer_part(n)].append(full)
            chosen[full] = p
        for part in mlp_parts:
            for n, p in getattr(blocks[i].mlp, part).named_parameters():
                full = f"model.layers.{i}.mlp.{part}.{n}"
                names["mlp"].append(full)
                chosen[full] = p
    if not any(names[k] for k in names if k != "mlp"):
        raise ValueError(f"the mixers of layers {idxs} have no parameters to train")

    ids = {id(p) for p in chosen.values()}
    frozen = []
    for n, p in model.named_parameters():
        p.requires_grad_(id(p) in ids)
        if id(p) not in ids:
            frozen.append(n)

    mlp_names = set(names["mlp"])
    groups = []
    for label, group_lr, pick in (("mixers", float(lr), lambda n: n not in mlp_names),
                                  ("mlp", float(lr) * float(mlp_lr_scale), lambda n: n in mlp_names)):
        for decay in (True, False):
            params = [p for n, p in chosen.items() if pick(n) and (p.ndim >= 2) == decay]
            if params:
                groups.append({"params": params, "lr": group_lr,
                               "weight_decay": float(weight_decay) if decay else 0.0,
                               "name": f"{label}{'' if decay else '/no_decay'}"})
    return TrainableSelection(groups, names, frozen)


# ----------------------------------------------------------------------------- freeze and verify


def _digest(t: torch.Tensor) -> str:
    full = getattr(t, "full_tensor", None)  # a sharded parameter (FSDP): gathered (collective)
    t = full() if full is not None else t
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


class ParameterSnapshot:
    """Bit-exact fingerprints (SHA-256 of the bytes) of parameters, to check later which changed.

    Stores 64 hex characters per tensor, not a copy, so it costs no memory on a 340M model::

        frozen = ParameterSnapshot(model, selection.frozen)
        ... train ...
        frozen.assert_unchanged(model)        # AssertionError naming any frozen tensor that moved
    """

    def __init__(self, model: nn.Module, names: Iterable[str] | None = None) -> None:
        params = dict(model.named_parameters())
        names = list(params) if names is None else list(names)
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"model has no parameters named {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        self.digests = {n: _digest(params[n]) for n in names}

    def changed(self, model: nn.Module) -> list[str]:
        """Names whose values differ (bit for bit) from the snapshot."""
        params = dict(model.named_parameters())
        missing = [n for n in self.digests if n not in params]
        if missing:
            raise ValueError(f"model no longer has parameters {missing[:5]}")
        return [n for n, d in self.digests.items() if _digest(params[n]) != d]

    def assert_unchanged(self, model: nn.Module) -> None:
        """Raise ``AssertionError`` listing every parameter that changed since the snapshot."""
        moved = self.changed(model)
        if moved:
            raise AssertionError(f"{len(moved)} frozen parameter(s) changed: {moved[:10]}")


def freeze_and_snapshot(model: nn.Module, selection: TrainableSelection) -> ParameterSnapshot:
    """Check that exactly the selection requires grad, and snapshot everything else."""
    frozen = set(selection.frozen)
    wrong = [n for n, p in model.named_parameters() if p.requires_grad == (n in frozen)]
    if wrong:
        raise AssertionError(f"requires_grad does not match the selection for {wrong[:10]}")
    return ParameterSnapshot(model, selection.frozen)


# ----------------------------------------------------------------------------- the teacher


def check_retrofit(layers: Sequence[int], mlp_parts: Sequence[str] = ()) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(layers, mlp_parts)`` as tuples once checked: distinct non-negative layer indices, MLP parts drawn
    from :data:`MLP_PARTS`."""
    layers, mlp_parts = tuple(layers), tuple(mlp_parts)
    if not layers or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 for i in layers) \
            or len(set(layers)) != len(layers):
        raise ValueError(f"layers must be distinct non-negative layer indices, got {layers!r}")
    bad = [p for p in mlp_parts if p not in MLP_PARTS]
    if bad:
        raise ValueError(f"mlp_parts must be drawn from {MLP_PARTS}, got {list(mlp_parts)}")
    return layers, mlp_parts


def resolve_teacher(path_or_repo_id: str | os.PathLike) -> Path:
    """The teacher's model directory: a local path, or a hub id ``owner/name`` fetched with its tokenizer
    (:func:`~bayeslayer.models.fla_import.resolve_checkpoint_dir`)."""
    from ..models.fla_import import resolve_checkpoint_dir

    return resolve_checkpoint_dir(path_or_repo_id, None)


def load_teacher(directory: str | os.PathLike, *, device: str | torch.device = "cpu") -> nn.Module:
    """The teacher as a frozen float32 :class:`BayesLayerForCausalLM` in eval mode.

    ``directory`` holds a flash-linear-attention Gated DeltaNet checkpoint (``model_type:
    gated_deltanet``, via :func:`~bayeslayer.models.load_gdn_checkpoint`) or one of our model
    directories (``model_type: bayeslayer``).
    """
    from ..models import BayesLayerForCausalLM
    from ..models.pretrained import load_model

    model = load_model(directory, device=str(device), dtype=torch.float32)
    if not isinstance(model, BayesLayerForCausalLM):
        raise TypeError(f"the teacher at {directory} loaded as {type(model).__name__}; a Gated DeltaNet "
                        "checkpoint or a BayesLayerForCausalLM directory is needed")
    model.requires_grad_(False)
    return model.eval()


def teacher_config(directory: str | os.PathLike):
    """The teacher's :class:`~bayeslayer.models.BayesLayerConfig`, read from its ``config.json`` without loading
    weights: a Gated DeltaNet checkpoint's (converted) or one of our model directories'.  A damaged folder the
    package wrote is named first (its manifest)."""
    from ..models import BayesLayerConfig
    from ..models.loading import read_model_config, verify_model_dir

    verify_model_dir(directory)
    raw = read_model_config(directory)
    if raw.get("model_type") == "gated_deltanet":
        from ..models.fla_import import gdn_config_to_bayeslayer

        return gdn_config_to_bayeslayer(raw)
    read_model_config(directory, model_type=BayesLayerConfig.model_type)
    return BayesLayerConfig.from_pretrained(directory)


def teacher_tokenizer(teacher_dir: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> str:
    """The tokenizer file: ``tokenizer`` (a ``tokenizer.json`` or a directory holding one) or the teacher's own
    ``tokenizer.json``."""
    if tokenizer is not None:
        path = Path(tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer {str(tokenizer)!r} is not a tokenizer.json file or a directory "
                                    "holding one")
        return str(path)
    if (Path(teacher_dir) / "tokenizer.json").is_file():
        return str(Path(teacher_dir) / "tokenizer.json")
    raise FileNotFoundError(f"the teacher directory {teacher_dir} has no tokenizer.json; pass --tokenizer (the "
                            "student must read text exactly as the teacher was trained to)")


def _no_dropout(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    for name in ("embedding_dropout", "mixer_dropout", "mlp_dropout", "mlp_hidden_dropout"):
        if hasattr(model.config, name):
            setattr(model.config, name, 0.0)


# ----------------------------------------------------------------------------- trainees and objectives


class _WithTeacher(nn.Module):
    """A student and a frozen teacher; the teacher stays in eval mode whatever ``train()`` says."""

    def __init__(self, student: nn.Module, teacher: nn.Module, layers: tuple[int, ...]) -> None:
        super().__init__()
        self.model, self.teacher, self.layers = student, teacher, list(layers)

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()
        return self


class LayerMatchTrainee(_WithTeacher):
    """Phase A: each replaced student mixer, fed the teacher's input to that layer, matches the
    teacher mixer's output; ``loss = mean_l [NMSE_l + cosine_weight · (1 − cos_l)]``."""

    def __init__(self, student, teacher, layers, cosine_weight: float = COSINE_WEIGHT) -> None:
        super().__init__(student, teacher, layers)
        self.cosine_weight = cosine_weight

    def forward(self, input_ids: torch.Tensor):
        with torch.no_grad(), MixerOutputCapture(self.teacher, self.layers) as t:
            self.teacher(input_ids=input_ids, use_cache=False)
            targets, inputs = dict(t.outputs), dict(t.inputs)
        outputs = mixer_outputs_on(self.model, inputs)
        return layer_matching_loss(outputs, targets, cosine_weight=self.cosine_weight)


class JointTrainee(_WithTeacher):
    """Phase B: ``w_kl · τ² KL(p_teacher ‖ p_student) + w_mse · mean_l NMSE_l`` on full forward passes;
    the weights follow :func:`phase_b_weights`."""

    def __init__(self, student, teacher, layers, switch_step: int, temperature: float = 1.0) -> None:
        super().__init__(student, teacher, layers)
        self.switch_step, self.temperature, self.step = switch_step, temperature, 0

    def set_step(self, step: int) -> None:
        self.step = step

    def forward(self, input_ids: torch.Tensor):
        with torch.no_grad(), MixerOutputCapture(self.teacher, self.layers) as t:
            teacher_logits = self.teacher(input_ids=input_ids, use_cache=False).logits
            targets = dict(t.outputs)
        with MixerOutputCapture(self.model, self.layers) as s:
            student_logits = self.model(input_ids=input_ids).logits
            outputs = dict(s.outputs)
        return joint_loss(teacher_logits, student_logits, outputs, targets,
                          weights=phase_b_weights(self.step, self.switch_step), temperature=self.temperature)


class RetrofitObjective(Objective):
    """One stage of the retrofit (``phase_a``, ``phase_b`` or ``gdn_ft``) as a training objective.

    ``teacher_dir``: the teacher's model directory (:func:`resolve_teacher`); ``teacher``: how it was named
    (a path or hub id, recorded in :meth:`describe`; default the directory).  ``init_dir``: the model Phase B
    starts from (Phase A's ``final/``).  ``layers`` are swapped for Bayesian Layers built with
    ``mixer_kwargs``; ``mlp_parts`` of the same layers' MLPs train in Phase B and the control at
    ``mlp_lr_scale`` × the learning rate; Phase B's loss weights switch at ``switch_step`` and its KL term
    uses ``temperature``.
    """

    find_unused_parameters = True  # frozen layers and (Phase A) the MLPs are off the loss path

    def __init__(self, stage: str, teacher_dir: str | os.PathLike, init_dir: str | os.PathLike | None = None, *,
                 teacher: str | None = None, layers: Sequence[int] = PAPER_LAYERS, mixer_kwargs: dict | None = None,
                 mlp_parts: Sequence[str] = (), mlp_lr_scale: float = MLP_LR_SCALE, switch_step: int = 0,
                 temperature: float = 1.0) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        if stage == "phase_b" and init_dir is None:
            raise ValueError("phase_b starts from Phase A's model: give init_dir (phase_a/final)")
        layers, mlp_parts = check_retrofit(layers, mlp_parts)
        for name, value in (("mlp_lr_scale", mlp_lr_scale), ("temperature", temperature)):
            if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        self.stage, self.teacher_dir, self.init_dir = stage, Path(teacher_dir), init_dir
        self.teacher = str(teacher_dir) if teacher is None else teacher
        self.layers, self.mixer_kwargs = layers, dict(mixer_kwargs or {})
        self._mlp_parts, self.mlp_lr_scale = mlp_parts, mlp_lr_scale
        self.switch_step = check_int("switch_step", switch_step, minimum=0)
        self.temperature = temperature
        self.name = f"distill_{stage}"
        self.selection = self.frozen = self.trainable = self.teacher_digest = None

    @property
    def mlp_parts(self) -> tuple[str, ...]:
        return () if self.stage == "phase_a" else self._mlp_parts  # Phase A's loss never reaches the MLPs

    def describe(self) -> dict:
        out = {"name": self.name, "teacher": self.teacher, "layers": list(self.layers),
               "mlp_parts": list(self.mlp_parts), "mlp_lr_scale": self.mlp_lr_scale}
        if self.stage != "gdn_ft":
            out["mixer_kwargs"] = self.mixer_kwargs
        if self.stage == "phase_a":
            out["cosine_weight"] = COSINE_WEIGHT
        if self.stage == "phase_b":
            # the Phase A model by content, so a resume from another working directory still matches
            out.update(switch_step=self.switch_step, temperature=self.temperature,
                       init_sha256=sha256_file(Path(self.init_dir) / "model.safetensors"))
        return out

    def build(self, config: LMConfig, corpus, device: torch.device) -> nn.Module:
        from ..models import replace_layers

        teacher = load_teacher(self.teacher_dir, device=device)
        if corpus.vocab_size > teacher.config.vocab_size:
            raise ValueError(f"the tokenizer has {corpus.vocab_size} ids but the teacher's embedding only "
                             f"{teacher.config.vocab_size}: not the teacher's tokenizer")
        n_layers = teacher.config.num_hidden_layers
        if max(self.layers) >= n_layers:
            raise ValueError(f"layers {list(self.layers)} are out of range for the teacher's {n_layers} layers")
        if self.stage == "gdn_ft":
            model = teacher  # the control fine-tunes this fresh copy of the teacher itself; no target model
        else:
            self.teacher_digest = ParameterSnapshot(teacher)  # the target must stay untouched
            model = copy.deepcopy(teacher)
            replace_layers(model, self.layers, "bayesian", **self.mixer_kwargs)
            if self.init_dir is not None:
                from ..models.loading import load_model_weights

                load_model_weights(model, Path(self.init_dir))
        _no_dropout(model)
        self.selection = select_trainable(model, self.layers, lr=config.lr, mlp_parts=self.mlp_parts,
                                          mlp_lr_scale=self.mlp_lr_scale, weight_decay=config.weight_decay)
        self.frozen = freeze_and_snapshot(model, self.selection)
        self.trainable = ParameterSnapshot(model, self.selection.trainable)
        model.train()
        if self.stage == "gdn_ft":
            return NextTokenTrainee(model)
        if self.stage == "phase_a":
            return LayerMatchTrainee(model, teacher, self.layers)
        return JointTrainee(model, teacher, self.layers, self.switch_step, self.temperature)

    def param_groups(self, trainee: nn.Module, config: LMConfig) -> list[dict]:
        return self.selection.param_groups

    def shard_unsupported(self) -> str | None:
        if self.stage == "phase_a":
            return ("Phase A runs the student's replaced mixers one by one outside the model's forward pass, "
                    "where FSDP gathers no block's parameters; run it with shard='none' (Phase B and the control "
                    "shard)")
        return None

    def finish(self, trainee: nn.Module) -> dict:
        """Frozen parameters bit-identical, the teacher untouched, trainable ones moved (else raise)."""
        model = trainee.model
        self.frozen.assert_unchanged(model)
        if hasattr(trainee, "teacher"):
            self.teacher_digest.assert_unchanged(trainee.teacher)
        moved = self.trainable.changed(model)
        if not moved:
            raise AssertionError(f"{self.stage}: no trainable parameter changed during training")
        names = self.selection.names
        return {"frozen_parameters": len(self.selection.frozen), "frozen_unchanged": True,
                "trainable_parameters": len(self.selection.trainable), "trainable_changed": len(moved),
                "trainable_unchanged": sorted(set(self.selection.trainable) - set(moved)),
                "trainable_elements": {part: sum(dict(model.named_parameters())[n].numel() for n in ns)
                                       for part, ns in names.items()}}
