"""``bayeslayer collision``: the deterministic key-collision experiment (docs/theory.md §8.1) and its closed forms.

No training, no data: six identities A..F with unit keys in ``D = 16`` dims and
one-hot values in ``m = 6`` dims are written into memory on a fixed schedule,

* steps 1–12: two rounds of A, B, C, D, E, F;
* steps 13–52: B forty times (B's value is confirmed);
* steps 53–112: A sixty times (A's key overlaps B's: interference),

with ``k_A = e_1``, ``k_B = ρ e_1 + √(1−ρ²) e_2``, C..F on ``e_3..e_6`` and
``v_i`` the one-hot vector of identity ``i``'s value class.  After every step the
memory is read at B's key, ``y = M_tᵀ k_B`` (``[m]``), and scored by the pairwise
retrieval probability of B's class against A's class,

    p^{AB}_t = e^{y_B} / (e^{y_A} + e^{y_B}) = sigmoid(y_B − y_A),   margin Δ_t = 2 p^{AB}_t − 1,

so 0.5 is a tie and a one-hot margin of exactly 1 gives sigmoid(1) ≈ 0.731 (this is
not a vocabulary accuracy).  The effective gain ``g_t = k_tᵀ K_t`` is recorded too.

Every model is a :mod:`bayeslayer.design` design model run by the project's
recurrent oracle (the chunked path is checked against it by
:func:`chunk_agreement`), all in float64, one head, ``A_t = I``:

=====================  ==========================================================
``bayesian``           exact Kalman filter, ``p0 = 3``, ``r² = ℓ² = 0.05``
``reset``              Delta rule: covariance reset ``P̄_t = λ I``, ``λ = 0.05``
                       (gain ``λ/(r² + λ) = 0.5`` for unit keys)
``linear_attention``   latent-input write with coefficient ``ω = λ/(λ + r²) = 0.5``
``diagonal``           the Bayesian filter keeping only ``diag(P̄_t)``, ``diag(P_t)``
=====================  ==========================================================

plus the fixed-isotropic-prior ablation ``P̄_t = c I`` for
``c ∈ {0.01, 0.05, 0.10, 0.50, 1, 3}`` and the overlap sweep (final ``p^{AB}`` vs ρ).

Closed forms (docs/theory.md §4) and how each is measured from the simulation
----------------------------------------------------------------------
``g_inf``           ``x_∞ = (ℓ² + √(ℓ⁴ + 4 r² ℓ²)) / 2``, ``g_∞ = x_∞ / (r² + x_∞)``.
                    Measured: the Bayesian filter's reported gain at step 112, the 60th
                    consecutive write of A.  (Conditioning on ``k_A`` changes ``k_Aᵀ P k_A``
                    by exactly the scalar recursion ``x ↦ r² x/(r² + x) + ℓ²``, whatever
                    the other directions hold, and that map contracts by
                    ``(r²/(r² + x_∞))² ≈ 0.15`` per step, so 60 steps reach machine precision.)
``delta_B_limit``   ``(1 − ρ²) ℓ²``: B's posterior variance change per write of A under long
                    repetition of A.  Measured: ``k_Bᵀ P_112 k_B − k_Bᵀ P_111 k_B``, read from
                    the filter's predictive variance ``1 + q_tᵀ P_t q_t`` at the query ``k_B``.
``angle_limit``     ``arcsin ρ`` (degrees): after *infinitely long* reinforcement of B the
                    next write of A points along the part of ``k_A`` orthogonal to ``k_B``.
                    Measured: the angle between ``k_A`` and the direction actually written
                    into memory at step 53 (the first A after B's 40 writes): the column
                    space of the rank-one update ``M_53 − M_52 = β u (v − M̄ᵀ k)ᵀ`` of the
                    filter's own states.  The limit needs ``σ̄²_B / σ̄²_⊥ → 0``; with process
                    noise ``σ̄²_B → x_∞`` while the unobserved orthogonal variance grows by
                    ``ℓ²`` per step, so the ratio falls only like ``1/n``: 40 writes of B do
                    not reach the limit, and the JSON reports the angle at step 53 as it is.
``reset_plateau``   Delta rule with gain ``γ``: ``b_n = b_0 − ρ (1 − (1 − γ)^n)(a_0 − v_A)``,
                    ``b_∞ = b_0 − ρ (a_0 − v_A)``, with ``a_0 = M_52ᵀ k_A``, ``b_0 = M_52ᵀ k_B`` the
                    reset filter's readouts before interference; reported as the
                    ``p^{AB}`` that ``b_∞`` gives.  Measured: the reset filter's ``p^{AB}`` at
                    step 112 (``(1 − γ)^60 ≈ 1e-18``: the plateau is reached).
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..design import (
    BAYESIAN,
    DELTANET,
    DIAGONAL_COVARIANCE,
    LINEAR_ATTENTION,
    DesignModel,
    fixed_prior,
    lowrank_diagonal,
)
from ..ops import FilterOutput
from .common.options import PLOT_ONLY_HELP, check_int, check_out_dir, plot_only_json, redrawing
from .common.plotting import RefLine, Series, line_plot, load_json
from .common.provenance import write_record
from .common.threads import SMALL, add_threads_option

DESCRIPTION = (
    "Write A..F twice, reinforce B 40×, then write the overlapping A 60×; read at B's key "
    "after every step.  Writes DIR/collision.json and PNG figures drawn from it."
)

# -- the paper's protocol (docs/theory.md §8.1) -------------------------------------------------------------
PAPER_CONFIG = {"D": 16, "m": 6, "rho": 0.92, "p0": 3.0, "r2": 0.05, "ell2": 0.05}
RESET_LAM = 0.05  # reset prior λ: gain λ/(r² + λ) = 0.5 at r² = 0.05
LA_OMEGA = 0.5  # linear attention's write coefficient ω
FIXED_PRIORS = (0.01, 0.05, 0.10, 0.50, 1.0, 3.0)
OVERLAP_RHOS = tuple(sorted({round(i / 100, 2) for i in range(100)} | {0.92}))
ROUNDS, B_REPEATS, A_REPEATS = 2, 40, 60
IDENTITIES = "ABCDEF"
A, B = 0, 1  # identity indices; identity i has key slot i and value class i
MODELS = ("bayesian", "reset", "linear_attention", "diagonal")
# labels of this study's filter configurations (a design with fixed noise, λ or ω), not of registry
# mixers (those are bayeslayer.layers.MIXER_LABELS)
MODEL_LABELS = {
    "bayesian": "Bayesian (BL)",
    "reset": "reset / Delta (λ = 0.05)",
    "linear_attention": "linear attention (ω = 0.5)",
    "diagonal": "diagonal covariance",
}
MODEL_STYLES = {
    "bayesian": {"color": "C0", "linewidth": 2.0},
    "reset": {"color": "C1"},
    "linear_attention": {"color": "C2", "linestyle": "--"},
    "diagonal": {"color": "C3", "linestyle": "-."},
}
FIGURES = ("collision_p_ab.png", "collision_gain.png", "collision_overlap.png", "collision_fixed_prior.png")
# the low-rank-plus-diagonal precision design (bayeslayer.ops.bayesian_layer.lowrank), written to collision_lowrank.json
LOWRANK_RANKS = (0, 1, 2, 4, 8, 16)
LOWRANK_PROJECTIONS = ("conservative", "lofi")
LOWRANK_REFERENCES = ("bayesian", "diagonal", "reset")
LOWRANK_FIGURES = ("collision_lowrank_p_ab.png", "collision_lowrank_gain.png", "collision_lowrank_floats.png",
                   "collision_lowrank_pairs.png")
MULTI_PAIRS = (1, 2, 4, 8)


# -- argument checks ------------------------------------------------------------------------------
def _positive(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be finite and > 0, got {x}")
    return float(x)


def _overlap(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    if not (math.isfinite(x) and 0.0 <= x < 1.0):
        # ρ = 1 is a different problem: identical keys with conflicting values (docs/theory.md §4.4).
        raise ValueError(f"{name} must be a key overlap in [0, 1), got {x}")
    return float(x)


def _dim(name: str, x, least: int) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < least:
        raise ValueError(f"{name} must be >= {least} (six identities need {least} slots), got {x}")
    return int(x)


def _repeats(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    return int(x)


def _protocol(rho, D, m, p0, r2, ell2) -> tuple[float, int, int, float, float, float]:
    """The collision protocol's scalars, checked (each error names its argument) and as float / int."""
    return (_overlap("rho", rho), _dim("D", D, len(IDENTITIES)), _dim("m", m, len(IDENTITIES)),
            _positive("p0", p0), _positive("r2", r2), _positive("ell2", ell2))


def prior_key(c: float) -> str:
    """JSON key of a fixed prior ``c``: two decimals (``"0.10"``, ``"1.00"``), more only when needed."""
    return f"{c:.2f}" if abs(c * 100 - round(c * 100)) < 1e-9 else f"{c:g}"


# -- inputs ---------------------------------------------------------------------------------------
def write_schedule(b_repeats: int = B_REPEATS, a_repeats: int = A_REPEATS) -> list[int]:
    """Identity index written at each step: ``[A..F] × 2``, then ``B × b_repeats``, then ``A × a_repeats``.

    >>> "".join(IDENTITIES[i] for i in write_schedule(2, 3))
    'ABCDEFABCDEFBBAAA'
    """
    b_repeats, a_repeats = _repeats("b_repeats", b_repeats), _repeats("a_repeats", a_repeats)
    return list(range(len(IDENTITIES))) * ROUNDS + [B] * b_repeats + [A] * a_repeats


def identity_keys(rho: torch.Tensor, D: int) -> torch.Tensor:
    """Unit keys ``[N, 6, D]`` for overlaps ``rho [N]``.

    ``k_A = e_1``, ``k_B = ρ e_1 + √(1−ρ²) e_2``, C..F on ``e_3..e_6``.
    """
    keys = torch.zeros(rho.shape[0], len(IDENTITIES), D, dtype=rho.dtype)
    for i in range(len(IDENTITIES)):
        keys[:, i, i] = 1.0
    keys[:, B, 0] = rho
    keys[:, B, 1] = torch.sqrt(1.0 - rho * rho)
    return keys


def collision_inputs(
    rhos: Sequence[float], *, D: int = 16, m: int = 6, b_repeats: int = B_REPEATS, a_repeats: int = A_REPEATS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The written sequence, one batch row per overlap ρ, float64, one head.

    Returns ``q [N, T, 1, D]`` (B's key at every step: the memory is read at B's key),
    ``k [N, T, 1, D]`` (the key of the identity written at each step) and ``v [N, T, 1, m]``
    (its one-hot value class).
    """
    rho = torch.tensor([_overlap("rho", r) for r in rhos], dtype=torch.float64)
    D, m = _dim("D", D, len(IDENTITIES)), _dim("m", m, len(IDENTITIES))
    schedule = torch.tensor(write_schedule(b_repeats, a_repeats))
    keys = identity_keys(rho, D)
    values = torch.eye(len(IDENTITIES), m, dtype=torch.float64)
    k = keys[:, schedule, None, :]  # [N, T, 1, D]
    q = keys[:, B, None, None, :].expand_as(k).contiguous()
    v = values[schedule][None, :, None, :].expand(rho.shape[0], -1, -1, -1).contiguous()
    return q, k, v


# -- models ---------------------------------------------------------------------------------------
def model_designs(r2: float, ell2: float, p0: float) -> dict[str, tuple[DesignModel, dict]]:
    """The four models as (design model, noise keywords).

    The reset filter derives its gain from its design, ``λ/(r² + λ‖k‖²)``; linear attention is
    given its write coefficient ``ω`` directly (``gain``), as the paper states it.
    """
    r2, ell2, p0 = _positive("r2", r2), _positive("ell2", ell2), _positive("p0", p0)
    return {
        "bayesian": (BAYESIAN, {"r2": r2, "ell2": ell2, "p0": p0}),
        "reset": (DELTANET, {"r2": r2, "lam": RESET_LAM}),
        "linear_attention": (LINEAR_ATTENTION, {"gain": LA_OMEGA}),
        "diagonal": (DIAGONAL_COVARIANCE, {"r2": r2, "ell2": ell2, "p0": p0}),
    }


def simulate(design: DesignModel, noise: dict, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *,
             steps: int | None = None, path: str = "recurrent", output_final_state: bool = False) -> FilterOutput:
    """Run ``design`` on the first ``steps`` tokens of ``inputs`` with the oracle or the chunked path."""
    q, k, v = inputs
    if steps is not None:
        q, k, v = q[:, :steps], k[:, :steps], v[:, :steps]
    if path == "recurrent":
        return design.recurrent(q, k, v, output_final_state=output_final_state, **noise)
    if path == "chunk":
        # 32 does not divide 112: the chunk boundary falls mid-phase, as it would in training.
        return design.chunk(
            q, k, v, output_final_state=output_final_state, return_variance=True, chunk_size=32, **noise
        )
    raise ValueError(f"path must be 'recurrent' or 'chunk', got {path!r}")


def retrieval(o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``p^{AB} = sigmoid(y_B − y_A)`` and margin ``2 p^{AB} − 1``; ``o [N, T, 1, m]`` → ``[N, T]``."""
    y = o[:, :, 0, :]
    p_ab = torch.sigmoid(y[..., B] - y[..., A])
    return p_ab, 2.0 * p_ab - 1.0


def delta_rule_readout(
    a0: torch.Tensor, b0: torch.Tensor, v_a: torch.Tensor, rho: float, gamma: float, n: float
) -> torch.Tensor:
    """docs/theory.md §4.5 Delta-rule readout at B's key after ``n`` writes of A with fixed gain ``γ``.

    ``n = inf`` gives the plateau.

    ``b_n = b_0 − ρ (1 − (1 − γ)^n)(a_0 − v_A)``; ``a0, b0, v_a``: ``[m]``.
    """
    return b0 - rho * (1.0 - (1.0 - gamma) ** n) * (a0 - v_a)


def _write_angle_deg(design: DesignModel, noise: dict, inputs, step: int) -> float:
    """Angle (degrees) between the key written at ``step`` (1-based) and the direction of that write.

    The direction is read off the filter's own states: ``M_step − M_{step−1} = β u (v − M̄ᵀ k)ᵀ`` is
    rank one and its column space is the write key ``u``.
    """
    M_before, P_before = simulate(design, noise, inputs, steps=step - 1, output_final_state=True).state
    q, k, v = (x[:, step - 1] for x in inputs)
    step_noise = {name: val for name, val in noise.items() if name != "p0"}  # p0 lives in the state
    M_after = design.step(q, k, v, state=(M_before, P_before), **step_noise).state[0]
    key = k[0, 0]
    delta = (M_after - M_before)[0, 0]
    u = torch.linalg.svd(delta, full_matrices=False).U[:, 0]
    cos = (u @ key).abs() / (u.norm() * key.norm())
    return math.degrees(math.acos(min(1.0, cos.item())))


# -- the experiment -------------------------------------------------------------------------------
def run_collision(*, rho: float = 0.92, D: int = 16, m: int = 6, p0: float = 3.0, r2: float = 0.05, ell2: float = 0.05,
                  fixed_priors: Sequence[float] = FIXED_PRIORS, overlap_rhos: Sequence[float] = OVERLAP_RHOS) -> dict:
    """Run the deterministic collision experiment and return its results (the ``collision.json`` dict).

    Lists are indexed by step: entry ``t − 1`` is the value after step ``t``.  Keys:
    ``config``; ``models[name] = {p_ab, margin, gain}`` for the four models; ``fixed_prior[c] =
    {gain, final_p_ab, final_margin}`` (gain of a unit key, ``c/(r² + c)``, as the filter reports it);
    ``overlap = {rho, <model>: final p_ab per ρ}``; ``closed_form`` (module docstring).
    """
    rho, D, m, p0, r2, ell2 = _protocol(rho, D, m, p0, r2, ell2)
    priors = [_positive("fixed_priors entry", c) for c in _nonempty("fixed_priors", fixed_priors)]
    if len({prior_key(c) for c in priors}) != len(priors):
        raise ValueError(f"fixed_priors must be distinct, got {list(fixed_priors)}")
    rhos = sorted({_overlap("overlap_rhos entry", r) for r in _nonempty("overlap_rhos", overlap_rhos)})

    designs = model_designs(r2, ell2, p0)
    inputs = collision_inputs([rho], D=D, m=m)
    steps = inputs[0].shape[1]
    results: dict = {
        "config": {"D": D, "m": m, "rho": rho, "p0": p0, "r2": r2, "ell2": ell2, "steps": steps},
        "models": {},
        "fixed_prior": {},
        "overlap": {"rho": rhos},
        "closed_form": {},
    }
    outputs = {}
    for name, (design, noise) in designs.items():
        out = simulate(design, noise, inputs)
        p_ab, margin = retrieval(out.o)
        outputs[name] = out
        results["models"][name] = {
            "p_ab": p_ab[0].tolist(),
            "margin": margin[0].tolist(),
            "gain": out.gain[0, :, 0, 0].tolist(),
        }

    for c in priors:
        out = simulate(fixed_prior(c), {"r2": r2}, inputs)
        p_ab, margin = retrieval(out.o)
        results["fixed_prior"][prior_key(c)] = {
            # the last step writes A with a unit key, so its gain is c/(r² + c)
            "gain": out.gain[0, -1, 0, 0].item(),
            "final_p_ab": p_ab[0, -1].item(),
            "final_margin": margin[0, -1].item(),
        }

    sweep = collision_inputs(rhos, D=D, m=m)
    for name, (design, noise) in designs.items():
        p_ab, _ = retrieval(simulate(design, noise, sweep).o)
        results["overlap"][name] = p_ab[:, -1].tolist()

    results["closed_form"] = _closed_form(results, designs, inputs, outputs["bayesian"])
    return results


def _nonempty(name: str, values) -> list:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of numbers, got {values!r}")
    return list(values)


def _closed_form(results: dict, designs: dict, inputs, bayes_out: FilterOutput) -> dict:
    """docs/theory.md §4's predictions next to the same quantities measured from the simulation (module docstring)."""
    cfg = results["config"]
    rho, r2, ell2 = cfg["rho"], cfg["r2"], cfg["ell2"]
    first_a = len(IDENTITIES) * ROUNDS + B_REPEATS + 1  # step 53: the first A after B's reinforcement
    k_a = inputs[1][0, first_a - 1, 0]
    v_a = inputs[2][0, first_a - 1, 0]
    k_b = inputs[0][0, 0, 0]

    x_inf = (ell2 + math.sqrt(ell2 * ell2 + 4.0 * r2 * ell2)) / 2.0
    g_inf = x_inf / (r2 + x_inf)

    # variance output = 1 + k_Bᵀ P_t k_B; the difference of the last two is B's per-write change
    var_b = bayes_out.variance[0, :, 0, 0]
    delta_b = (var_b[-1] - var_b[-2]).item()

    bayes, bayes_noise = designs["bayesian"]
    angle = _write_angle_deg(bayes, bayes_noise, inputs, first_a)

    reset, reset_noise = designs["reset"]
    M_reset = simulate(reset, reset_noise, inputs, steps=first_a - 1, output_final_state=True).state[0][0, 0]
    a0, b0 = M_reset.T @ k_a, M_reset.T @ k_b
    overlap = (k_a @ k_b).item()
    gamma = RESET_LAM / (r2 + RESET_LAM)  # the reset gain of A's unit key
    b_inf = delta_rule_readout(a0, b0, v_a, overlap, gamma, math.inf)
    return {
        "g_inf": g_inf,
        "g_inf_simulated": results["models"]["bayesian"]["gain"][-1],
        "delta_B_limit": (1.0 - rho * rho) * ell2,
        "delta_B_simulated": delta_b,
        "angle_limit": math.degrees(math.asin(rho)),
        "angle_simulated": angle,
        "reset_plateau": torch.sigmoid(b_inf[B] - b_inf[A]).item(),
        "reset_plateau_simulated": results["models"]["reset"]["p_ab"][-1],
    }


def chunk_agreement(*, rho: float = 0.92, D: int = 16, m: int = 6, p0: float = 3.0, r2: float = 0.05,
                    ell2: float = 0.05, overlap_rhos: Sequence[float] = OVERLAP_RHOS) -> dict[str, float]:
    """Max |oracle − chunked| over readouts and gains, per model, on the main run and the overlap sweep."""
    rhos = sorted({_overlap("rho", rho)} | {_overlap("overlap_rhos entry", r) for r in overlap_rhos})
    inputs = collision_inputs(rhos, D=D, m=m)
    diffs = {}
    for name, (design, noise) in model_designs(r2, ell2, p0).items():
        ref = simulate(design, noise, inputs, path="recurrent")
        fast = simulate(design, noise, inputs, path="chunk")
        diffs[name] = max((ref.o - fast.o).abs().max().item(), (ref.gain - fast.gain).abs().max().item())
    return diffs


def write_angle(rho: float, b_repeats: int, *, D: int = 16, m: int = 6, p0: float = 3.0, r2: float = 0.05,
                ell2: float = 0.05) -> float:
    """Angle (degrees) between ``k_A`` and the Bayesian filter's write of A after ``b_repeats`` writes of B.

    Shows how slowly the docs/theory.md §4.4 limit ``arcsin ρ`` (``b_repeats → ∞``) is approached.
    """
    inputs = collision_inputs([rho], D=D, m=m, b_repeats=b_repeats, a_repeats=1)
    design, noise = model_designs(r2, ell2, p0)["bayesian"]
    T = inputs[0].shape[1]
    return _write_angle_deg(design, noise, inputs, T)


def rotated_keys(rho: float = 0.92, seeds: Sequence[int] = tuple(range(8)), *, D: int = 16, m: int = 6, p0: float = 3.0,
                 r2: float = 0.05, ell2: float = 0.05) -> dict:
    """Final ``p^{AB}`` of each model when all keys are turned by a random orthogonal ``Q`` (one per seed).

    The paper's geometry puts ``k_A`` on a coordinate axis, the best case for a *diagonal*
    covariance: A's writes then stay on ``e_1``.  The dense Bayesian filter, the reset and the
    latent-input writes have isotropic priors and are unchanged by ``Q``; the diagonal ablation
    is not.  Returns ``{"rho", "seeds", <model>: [final p^AB per seed]}``.
    """
    seeds = [int(s) for s in _nonempty("seeds", seeds)]
    q, k, v = collision_inputs([rho], D=D, m=m)
    designs = model_designs(r2, ell2, p0)
    out: dict = {"rho": float(rho), "seeds": seeds, **{n: [] for n in MODELS}}
    for seed in seeds:
        turned = _turn((q, k, v), seed)
        for name, (design, noise) in designs.items():
            out[name].append(retrieval(simulate(design, noise, turned).o)[0][0, -1].item())
    return out


def _turn(inputs, seed: int):
    """Keys and queries turned by the random orthogonal ``Q`` of ``seed`` (QR of a Gaussian ``D×D``)."""
    q, k, v = inputs
    D = q.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))
    return q @ Q.T, k @ Q.T, v


def _with_turns(inputs, seeds: Sequence[int]):
    """Batch row 0: ``inputs`` (the paper's keys); row ``1 + i``: the keys turned by ``seeds[i]``."""
    turned = [_turn(inputs, seed) for seed in seeds]
    return tuple(torch.cat([inputs[j]] + [t[j] for t in turned], 0) for j in range(3))


def lowrank_key(projection: str, rank: int) -> str:
    return f"{projection}/{rank}"


def lowrank_designs(r2: float, ell2: float, p0: float, projections: Sequence[str],
                    ranks: Sequence[int]) -> dict[str, tuple[DesignModel, dict]]:
    """The references of :data:`LOWRANK_REFERENCES`, then the low-rank design of every projection and rank
    (:func:`lowrank_key` names them), as (design model, noise keywords)."""
    designs = {n: d for n, d in model_designs(r2, ell2, p0).items() if n in LOWRANK_REFERENCES}
    for proj in projections:
        for r in ranks:
            designs[lowrank_key(proj, r)] = (lowrank_diagonal(r, proj), {"r2": r2, "ell2": ell2, "p0": p0})
    return designs


def run_lowrank(*, rho: float = 0.92, D: int = 16, m: int = 6, p0: float = 3.0, r2: float = 0.05, ell2: float = 0.05,
                ranks: Sequence[int] = LOWRANK_RANKS, projections: Sequence[str] = LOWRANK_PROJECTIONS,
                seeds: Sequence[int] = tuple(range(8))) -> dict:
    """The rank sweep of the low-rank-plus-diagonal precision design on the collision schedule.

    For each projection and rank ``r``: ``p_ab`` and ``gain`` per step (the paper's keys) and the
    final ``p^{AB}`` under each random key rotation of :func:`rotated_keys`; the dense BL, the
    diagonal-covariance ablation and the Delta rule beside them (same inputs).  ``state_floats``
    counts the recurrent state of one head (``design.state_size(D, m)``).  ``chunk_agreement`` is
    the max |oracle − chunked| of readouts and gains over every low-rank run.  The result is
    ``collision_lowrank.json``.
    """
    rho, D, m, p0, r2, ell2 = _protocol(rho, D, m, p0, r2, ell2)
    ranks = [int(r) for r in _nonempty("ranks", ranks)]
    projections = list(_nonempty("projections", projections))
    seeds = [int(s) for s in _nonempty("seeds", seeds)]
    designs = lowrank_designs(r2, ell2, p0, projections, ranks)
    inputs = collision_inputs([rho], D=D, m=m)
    # batch row 0: the paper's keys; row 1 + i: keys turned by seed i (one filter call per design)
    batch = _with_turns(inputs, seeds)
    results: dict = {
        "config": {"D": D, "m": m, "rho": rho, "p0": p0, "r2": r2, "ell2": ell2, "steps": inputs[0].shape[1]},
        "ranks": ranks, "projections": projections, "seeds": seeds,
        "models": {}, "chunk_agreement": 0.0,
    }
    for name, (design, noise) in designs.items():
        out = simulate(design, noise, batch)
        p_ab, _ = retrieval(out.o)
        rotated = p_ab[1:, -1].tolist()
        results["models"][name] = {
            "state_floats": design.state_size(D, m),
            "p_ab": p_ab[0].tolist(),
            "gain": out.gain[0, :, 0, 0].tolist(),
            "final_p_ab": p_ab[0, -1].item(),
            "rotated_final_p_ab": rotated,
        }
        if design.write == "lowrank":
            fast = simulate(design, noise, batch, path="chunk")
            diff = max((out.o - fast.o).abs().max().item(), (out.gain - fast.gain).abs().max().item())
            results["chunk_agreement"] = max(results["chunk_agreement"], diff)
    return results


def multi_pair_inputs(pairs: int, rho: float, *, D: int = 16, b_repeats: int = B_REPEATS,
                      a_repeats: int = A_REPEATS) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``pairs`` colliding pairs at once: the collision schedule with every identity replaced by a round.

    Pair ``i`` has ``k_{A_i} = e_{2i}``, ``k_{B_i} = ρ e_{2i} + √(1−ρ²) e_{2i+1}`` (identity ``2i`` is
    A_i, ``2i+1`` is B_i, value class = identity).  Schedule: two rounds of all ``2·pairs``
    identities, ``b_repeats`` rounds of B_1..B_n, ``a_repeats`` rounds of A_1..A_n.  Returns
    ``((q, k, v) [1, T, 1, ·], keys [2·pairs, D])`` (queries = keys; only the final memory is read).
    """
    pairs = _repeats("pairs", pairs)
    if 2 * pairs > D:
        raise ValueError(f"pairs={pairs} needs 2·pairs <= D = {D} key dims")
    rho = _overlap("rho", rho)
    n = 2 * pairs
    keys = torch.zeros(n, D, dtype=torch.float64)
    for i in range(pairs):
        keys[2 * i, 2 * i] = 1.0
        keys[2 * i + 1, 2 * i] = rho
        keys[2 * i + 1, 2 * i + 1] = math.sqrt(1.0 - rho * rho)
    b_ids = [2 * i + 1 for i in range(pairs)]
    a_ids = [2 * i for i in range(pairs)]
    schedule = torch.tensor(list(range(n)) * ROUNDS + b_ids * _repeats("b_repeats", b_repeats)
                            + a_ids * _repeats("a_repeats", a_repeats))
    k = keys[schedule][None, :, None, :]
    v = torch.eye(n, dtype=torch.float64)[schedule][None, :, None, :]
    return (k.clone(), k, v), keys


def run_multi_pair(*, rho: float = 0.92, D: int = 16, p0: float = 3.0, r2: float = 0.05, ell2: float = 0.05,
                   pairs: Sequence[int] = MULTI_PAIRS, ranks: Sequence[int] = LOWRANK_RANKS,
                   projections: Sequence[str] = LOWRANK_PROJECTIONS, seeds: Sequence[int] = tuple(range(8)),
                   on_pairs_done: Callable[[int], None] | None = None) -> dict:
    """Final p^AB of every pair when ``n`` pairs collide at once (:func:`multi_pair_inputs`), per model.

    How much rank the protection needs as the number of confirmed directions grows.  For each
    model and ``n``: mean and min over pairs on axis-aligned keys like the paper's, and over the
    random rotations of :func:`rotated_keys` (mean over seeds and pairs, min over both).
    ``on_pairs_done(n)``, when given, is called after each ``n`` (a progress bar's update).
    """
    p0, r2, ell2 = _positive("p0", p0), _positive("r2", r2), _positive("ell2", ell2)
    pairs = [int(n) for n in _nonempty("pairs", pairs)]
    ranks = [int(r) for r in _nonempty("ranks", ranks)]
    seeds = [int(sd) for sd in _nonempty("seeds", seeds)]
    designs = lowrank_designs(r2, ell2, p0, _nonempty("projections", projections), ranks)
    out: dict = {"pairs": pairs, "b_repeats": B_REPEATS, "a_repeats": A_REPEATS, "seeds": seeds,
                 "models": {n: {"state_floats": [], "mean_p_ab": [], "min_p_ab": [], "rotated_mean_p_ab": [],
                                "rotated_min_p_ab": []} for n in designs}}
    for n_pairs in pairs:
        inputs, keys = multi_pair_inputs(n_pairs, rho, D=D)
        batch = _with_turns(inputs, seeds)
        # the B keys each batch row is read at: [N, n, D]
        kb = torch.cat([keys[1::2][None]] + [_turn((keys[1::2][None, None], keys[1::2][None, None], None),
                                                   seed)[0][0] for seed in seeds], 0)
        m = 2 * n_pairs
        for name, (design, noise) in designs.items():
            M = simulate(design, noise, batch, output_final_state=True).state[0][:, 0]  # [N, D, m]
            y = torch.einsum("ndm,nid->nim", M, kb)  # readout at each B_i
            idx = torch.arange(n_pairs)
            p_ab = torch.sigmoid(y[:, idx, 2 * idx + 1] - y[:, idx, 2 * idx])  # [N, n]
            e = out["models"][name]
            e["state_floats"].append(design.state_size(D, m))
            e["mean_p_ab"].append(p_ab[0].mean().item())
            e["min_p_ab"].append(p_ab[0].min().item())
            e["rotated_mean_p_ab"].append(p_ab[1:].mean().item())
            e["rotated_min_p_ab"].append(p_ab[1:].min().item())
        if on_pairs_done is not None:
            on_pairs_done(n_pairs)
    return out


def plot_lowrank(results: dict, out_dir: str | Path) -> list[Path]:
    """Three figures from ``collision_lowrank.json``: p^AB and gain over steps (conservative
    projection, each rank, beside dense/diagonal/Delta) and final p^AB against state floats."""
    for key in ("config", "ranks", "projections", "models"):
        if key not in results:
            raise ValueError(f"collision_lowrank results lack {key!r}; keys seen: {sorted(results)}")
    out_dir = Path(out_dir)
    cfg, models = results["config"], results["models"]
    steps = list(range(1, cfg["steps"] + 1))
    n_pre = len(IDENTITIES) * ROUNDS
    phases = [RefLine(n_pre + 0.5, f"B ×{B_REPEATS}"), RefLine(n_pre + B_REPEATS + 0.5, f"A ×{A_REPEATS}")]
    tie = RefLine(0.5, "tie (0.5)", {"color": "0.6"})
    proj = results["projections"][0]
    ranks = results["ranks"]
    cmap = ["#440154", "#414487", "#2a788e", "#22a884", "#7ad151", "#bddf26", "#fde725"]

    def traj(field: str) -> list[Series]:
        out = [Series(MODEL_LABELS[n], steps, models[n][field], style={**MODEL_STYLES[n], "linewidth": 2.5})
               for n in LOWRANK_REFERENCES]
        for i, r in enumerate(ranks):
            out.append(Series(f"low-rank r = {r} ({proj})", steps, models[lowrank_key(proj, r)][field],
                              style={"color": cmap[i % len(cmap)], "linewidth": 1.2}))
        return out

    title = f"D = {cfg['D']}, ρ = {cfg['rho']:g}, p0 = {cfg['p0']:g}, r² = ℓ² = {cfg['r2']:g}"
    paths = [
        line_plot(out_dir / LOWRANK_FIGURES[0], traj("p_ab"), xlabel="step t", ylabel="p^AB at B's key",
                  title=f"Low-rank + diagonal precision: retrieval of B ({title})", vlines=phases,
                  hlines=[tie], ylim=(0.0, 1.0), legend_loc="lower left", figsize=(7.5, 4.8)),
        line_plot(out_dir / LOWRANK_FIGURES[1], traj("gain"), xlabel="step t", ylabel="gain g_t = k_tᵀ K_t",
                  title=f"Low-rank + diagonal precision: gain ({title})", vlines=phases, ylim=(0.0, 1.0),
                  legend_loc="lower left", figsize=(7.5, 4.8)),
    ]
    floats = []
    styles = {"conservative": {"color": "C0", "marker": "o"}, "lofi": {"color": "C4", "marker": "s"}}
    for p in results["projections"]:
        keys = [lowrank_key(p, r) for r in ranks]
        xs = [models[k]["state_floats"] for k in keys]
        floats.append(Series(f"low-rank {p}, paper's keys", xs, [models[k]["final_p_ab"] for k in keys],
                             style=styles.get(p, {})))
        floats.append(Series(f"low-rank {p}, rotated keys (worst seed)", xs,
                             [min(models[k]["rotated_final_p_ab"]) for k in keys],
                             style={**styles.get(p, {}), "linestyle": "--", "markerfacecolor": "none"}))
    for n in LOWRANK_REFERENCES:
        x = [models[n]["state_floats"]]
        floats.append(Series(f"{MODEL_LABELS[n]}, paper's keys", x, [models[n]["final_p_ab"]],
                             style={"color": MODEL_STYLES[n]["color"], "marker": "*", "markersize": 12,
                                    "linestyle": "none"}))
        floats.append(Series(f"{MODEL_LABELS[n]}, rotated (worst)", x, [min(models[n]["rotated_final_p_ab"])],
                             style={"color": MODEL_STYLES[n]["color"], "marker": "x", "markersize": 10,
                                    "linestyle": "none"}))
    paths.append(line_plot(out_dir / LOWRANK_FIGURES[2], floats, xlabel="recurrent state floats per head",
                           ylabel="final p^AB (step 112)", title=f"Protection per float of state ({title})",
                           hlines=[tie], ylim=(0.0, 1.0), legend_loc="lower right", figsize=(7.5, 5.0)))
    multi = results.get("multi_pair")
    if multi:
        mm = multi["models"]
        series = [Series(f"{MODEL_LABELS[n]}", multi["pairs"], mm[n]["rotated_mean_p_ab"],
                         style={**MODEL_STYLES[n], "linewidth": 2.5, "marker": "*"}) for n in LOWRANK_REFERENCES]
        for i, r in enumerate(ranks):
            for p, ls in (("conservative", "-"), ("lofi", ":")):
                if lowrank_key(p, r) in mm:
                    series.append(Series(f"low-rank r = {r} ({p})", multi["pairs"],
                                         mm[lowrank_key(p, r)]["rotated_mean_p_ab"],
                                         style={"color": cmap[i % len(cmap)], "linestyle": ls, "marker": "o",
                                                "markersize": 3}))
        paths.append(line_plot(out_dir / LOWRANK_FIGURES[3], series, xlabel="colliding pairs written at once",
                               ylabel="final p^AB, mean over pairs and 8 key rotations",
                               title=f"n pairs collide at once (rotated keys; {title})", hlines=[tie],
                               xscale="log", xticks=multi["pairs"], ylim=(0.0, 1.0), legend_loc="outside",
                               figsize=(10.5, 5.0)))
    return paths


def format_lowrank_table(results: dict) -> str:
    """Final p^AB (paper's keys; min and max over rotations) and state floats per model."""
    models = results["models"]
    lines = [f"{'low-rank sweep (collision_lowrank.json)':<34}{'floats':>8}{'p^AB':>9}{'rot. min':>10}"
             f"{'rot. max':>10}{'gain t=112':>12}"]
    names = list(LOWRANK_REFERENCES) + [lowrank_key(p, r) for p in results["projections"] for r in results["ranks"]]
    for n in names:
        e = models[n]
        rot = e["rotated_final_p_ab"]
        lines.append(f"{MODEL_LABELS.get(n, 'low-rank ' + n):<34}{e['state_floats']:>8}{e['final_p_ab']:>9.4f}"
                     f"{min(rot):>10.4f}{max(rot):>10.4f}{e['gain'][-1]:>12.4f}")
    lines.append(f"low-rank oracle vs chunked path, max |Δ| of readouts and gains: {results['chunk_agreement']:.1e}")
    multi = results.get("multi_pair")
    if multi:
        lines.append("n pairs colliding at once: final p^AB, mean over pairs (axis keys | 8 rotations)")
        lines.append(f"{'model':<34}" + "".join(f"{'n=' + str(n):>16}" for n in multi["pairs"]))
        for n in names:
            e = multi["models"].get(n)
            if e is not None:
                lines.append(f"{MODEL_LABELS.get(n, 'low-rank ' + n):<34}" + "".join(
                    f"{a:>8.4f} |{b:>6.4f}" for a, b in zip(e["mean_p_ab"], e["rotated_mean_p_ab"], strict=True)))
    return "\n".join(lines)


def run_extras(*, rho: float = 0.92, p0: float = 3.0, r2: float = 0.05, ell2: float = 0.05,
               b_repeats: Sequence[int] = (40, 400, 4000), seeds: Sequence[int] = tuple(range(8))) -> dict:
    """Checks beyond ``collision.json``: the write angle vs the length of B's reinforcement, and
    the models under randomly rotated keys (one rotation per seed).  Written to ``collision_extra.json``."""
    kw = {"p0": p0, "r2": r2, "ell2": ell2}
    return {
        "angle_vs_reinforcement": {
            "rho": float(rho),
            "b_repeats": [int(n) for n in b_repeats],
            "angle": [write_angle(rho, n, **kw) for n in b_repeats],
            "angle_limit": math.degrees(math.asin(_overlap("rho", rho))),
        },
        "rotated_keys": rotated_keys(rho, seeds, **kw),
    }


# -- results: checks, figures, table --------------------------------------------------------------
def check_results(results: dict) -> None:
    """Raise ``ValueError`` naming what is missing when ``results`` is not a collision results dict."""
    if not isinstance(results, dict):
        raise ValueError(f"collision results must be a dict, got {type(results).__name__}")
    for key in ("config", "models", "fixed_prior", "overlap", "closed_form"):
        if key not in results:
            raise ValueError(f"collision results lack {key!r}; keys seen: {sorted(results)}")
    steps = results["config"].get("steps")
    for name in MODELS:
        entry = results["models"].get(name)
        if not isinstance(entry, dict) or any(
            len(entry.get(f, ())) != steps for f in ("p_ab", "margin", "gain")
        ):
            raise ValueError(
                f"collision results: models[{name!r}] needs p_ab, margin and gain of {steps} steps"
            )
        if len(results["overlap"].get(name, ())) != len(results["overlap"].get("rho", ())):
            raise ValueError(f"collision results: overlap[{name!r}] must have one entry per rho")


def plot_collision(results: dict, out_dir: str | Path) -> list[Path]:
    """Draw the four figures of the experiment from a results dict into ``out_dir`` (returns their paths)."""
    check_results(results)
    out_dir = Path(out_dir)
    cfg, models, cf = results["config"], results["models"], results["closed_form"]
    n_pre = len(IDENTITIES) * ROUNDS
    n_b = cfg["steps"] - n_pre - A_REPEATS
    steps = list(range(1, cfg["steps"] + 1))
    phases = [
        RefLine(n_pre + 0.5, f"B ×{n_b}"),
        RefLine(n_pre + n_b + 0.5, f"A ×{cfg['steps'] - n_pre - n_b}"),
    ]
    one_hot = 1.0 / (1.0 + math.exp(-1.0))
    tie = RefLine(0.5, "tie (0.5)", {"color": "0.6"})
    title = f"ρ = {cfg['rho']:g}, p0 = {cfg['p0']:g}, r² = {cfg['r2']:g}, ℓ² = {cfg['ell2']:g}"
    over_steps = {"xlabel": "step t", "vlines": phases, "ylim": (0.0, 1.0), "legend_loc": "lower left"}
    paths = [
        line_plot(out_dir / FIGURES[0],
                  [Series(MODEL_LABELS[n], steps, models[n]["p_ab"], style=MODEL_STYLES[n]) for n in MODELS],
                  ylabel="p^AB at B's key (B's class vs A's)", title=f"Retrieval of B while A is written ({title})",
                  hlines=[tie, RefLine(one_hot, "one-hot margin 1: sigmoid(1)", {"color": "0.75"})], **over_steps),
        line_plot(out_dir / FIGURES[1],
                  [Series(MODEL_LABELS[n], steps, models[n]["gain"], style=MODEL_STYLES[n]) for n in MODELS],
                  ylabel="gain g_t = k_tᵀ K_t", title=f"Effective gain ({title})",
                  hlines=[RefLine(cf["g_inf"], f"closed-form floor g_∞ = {cf['g_inf']:.4f}")], **over_steps),
        line_plot(out_dir / FIGURES[2],
                  [Series(MODEL_LABELS[n], results["overlap"]["rho"], results["overlap"][n], style=MODEL_STYLES[n])
                   for n in MODELS],
                  xlabel="key overlap ρ = k_Aᵀ k_B", ylabel="final p^AB (step 112)",
                  title="Final retrieval of B vs key overlap", vlines=[RefLine(cfg["rho"], f"ρ = {cfg['rho']:g}")],
                  hlines=[tie], ylim=(0.0, 1.0), legend_loc="lower left"),
    ]
    cs = sorted(results["fixed_prior"], key=float)
    xs = [float(c) for c in cs]
    fixed = [
        Series(
            "fixed prior P̄ = cI: final p^AB",
            xs,
            [results["fixed_prior"][c]["final_p_ab"] for c in cs],
            style={"marker": "o", "color": "C4"},
        ),
        Series(
            "fixed prior: gain c/(r² + c)",
            xs,
            [results["fixed_prior"][c]["gain"] for c in cs],
            style={"marker": "s", "linestyle": ":", "color": "C5"},
        ),
    ]
    paths.append(
        line_plot(
            out_dir / FIGURES[3],
            fixed,
            xlabel="fixed prior variance c",
            ylabel="final p^AB / gain",
            xscale="log",
            title="Fixed isotropic prior ablation (a reset with λ = c)",
            hlines=[
                RefLine(models["bayesian"]["p_ab"][-1], "Bayesian (BL) final p^AB", {"color": "C0"}),
                tie,
            ],
            ylim=(0.0, 1.0),
            legend_loc="upper left",
        )
    )
    return paths


def format_table(results: dict) -> str:
    """The compact printed summary of a results dict."""
    check_results(results)
    cfg, models, cf = results["config"], results["models"], results["closed_form"]
    n_pre = len(IDENTITIES) * ROUNDS
    n_b = cfg["steps"] - n_pre - A_REPEATS
    t1, t2, t3 = n_pre, n_pre + n_b, cfg["steps"]
    lines = [
        f"Deterministic collision (docs/theory.md §8.1): D={cfg['D']}, m={cfg['m']}, ρ={cfg['rho']:g}, "
        f"p0={cfg['p0']:g}, "
        f"r²={cfg['r2']:g}, ℓ²={cfg['ell2']:g}, {cfg['steps']} steps",
        f"{'model':<28}{'p^AB t=' + str(t1):>12}{'t=' + str(t2):>9}{'t=' + str(t3):>9}"
        f"{'margin':>9}{'gain':>9}",
    ]
    for n in MODELS:
        p = models[n]["p_ab"]
        lines.append(
            f"{MODEL_LABELS[n]:<28}{p[t1 - 1]:>12.4f}{p[t2 - 1]:>9.4f}{p[t3 - 1]:>9.4f}"
            f"{models[n]['margin'][-1]:>9.4f}{models[n]['gain'][-1]:>9.4f}"
        )
    cs = sorted(results["fixed_prior"], key=float)
    lines.append(f"{'fixed prior c':<28}" + "".join(f"{c:>8}" for c in cs))
    lines.append(
        f"{'  gain c/(r²+c)':<28}" + "".join(f"{results['fixed_prior'][c]['gain']:>8.4f}" for c in cs)
    )
    lines.append(
        f"{'  final p^AB':<28}" + "".join(f"{results['fixed_prior'][c]['final_p_ab']:>8.4f}" for c in cs)
    )
    ov = results["overlap"]
    show = [r for r in (0.0, 0.5, 0.8, 0.9, cfg["rho"], 0.99) if r in ov["rho"]]
    show = sorted(set(show))
    lines.append(f"{'final p^AB at ρ =':<28}" + "".join(f"{r:>8.2f}" for r in show))
    for n in MODELS:
        lines.append(f"{'  ' + n:<28}" + "".join(f"{ov[n][ov['rho'].index(r)]:>8.4f}" for r in show))
    lines += [
        f"{'closed form (docs/theory.md §4)':<36}{'predicted':>12}{'simulated':>12}",
        f"{'gain floor g_∞':<36}{cf['g_inf']:>12.6f}{cf['g_inf_simulated']:>12.6f}",
        f"{'Δ_B limit (1−ρ²)ℓ²':<36}{cf['delta_B_limit']:>12.6f}{cf['delta_B_simulated']:>12.6f}",
        f"{'write angle arcsin ρ (deg; t=53)':<36}{cf['angle_limit']:>12.2f}{cf['angle_simulated']:>12.2f}",
        f"{'reset plateau p^AB (t=112)':<36}{cf['reset_plateau']:>12.6f}"
        f"{cf['reset_plateau_simulated']:>12.6f}",
    ]
    return "\n".join(lines)


MEANING = (
    "How to read the table: p^AB = sigmoid(y_B − y_A) reads the memory at B's key and compares B's value\n"
    "class with A's: above 0.5 B is still retrieved, 0.5 is a tie, below 0.5 A has overwritten B (a one-hot\n"
    "margin of exactly 1 gives sigmoid(1) = 0.7311).  Columns: after two rounds of A..F (t=12), after B's\n"
    "40 writes (t=52), after A's 60 writes (t=112); margin = 2 p^AB − 1 and gain = k_tᵀK_t at t=112.\n"
    "The write-angle limit arcsin ρ needs infinitely long reinforcement of B; at t=53 (after 40 writes)\n"
    "the measured angle is smaller (see docs/experiments.md)."
)


# -- the whole experiment: config -> record -------------------------------------------------------
@dataclass(frozen=True)
class CollisionConfig:
    """What ``bayeslayer collision`` runs: the docs/theory.md §8.1 protocol at overlap ``rho`` with prior ``p0`` and
    noises ``r2``, ``ell2``; the sweeps (``fixed_priors``, ``overlap_rhos``, the low-rank ``lowrank_ranks``,
    the key-rotation ``rotation_seeds`` and the reinforcement lengths ``b_repeats`` of the write angle); and
    ``out``, the folder for the JSON files and figures (``None``: write nothing); ``progress``, a progress
    line on stderr, one tick per sweep.  The defaults are the paper's and the command's.  Every field is
    checked here, with its name in the error.
    """

    rho: float = PAPER_CONFIG["rho"]
    p0: float = PAPER_CONFIG["p0"]
    r2: float = PAPER_CONFIG["r2"]
    ell2: float = PAPER_CONFIG["ell2"]
    fixed_priors: tuple[float, ...] = FIXED_PRIORS
    overlap_rhos: tuple[float, ...] = OVERLAP_RHOS
    lowrank_ranks: tuple[int, ...] = LOWRANK_RANKS
    rotation_seeds: tuple[int, ...] = tuple(range(8))
    b_repeats: tuple[int, ...] = (40, 400, 4000)
    out: str | None = None
    progress: bool = False

    def __post_init__(self):
        _overlap("rho", self.rho)
        for name in ("p0", "r2", "ell2"):
            _positive(name, getattr(self, name))
        priors = tuple(_positive("fixed_priors entry", c) for c in _nonempty("fixed_priors", self.fixed_priors))
        if len({prior_key(c) for c in priors}) != len(priors):
            raise ValueError(f"fixed_priors must be distinct, got {list(self.fixed_priors)}")
        for name, minimum in (("lowrank_ranks", 0), ("rotation_seeds", 0), ("b_repeats", 1)):
            values = _nonempty(name, getattr(self, name))
            object.__setattr__(self, name, tuple(check_int(f"{name} entry", v, minimum=minimum) for v in values))
        object.__setattr__(self, "overlap_rhos", tuple(
            _overlap("overlap_rhos entry", r) for r in _nonempty("overlap_rhos", self.overlap_rhos)))
        object.__setattr__(self, "fixed_priors", tuple(self.fixed_priors))
        if self.out is not None and not isinstance(self.out, (str, os.PathLike)):
            raise TypeError(f"out must be a folder path or None, got {type(self.out).__name__}")

    def noise(self) -> dict:
        """``rho``, ``p0``, ``r2``, ``ell2`` as the keywords of the experiment's functions."""
        return {"rho": self.rho, "p0": self.p0, "r2": self.r2, "ell2": self.ell2}


def run(config: CollisionConfig) -> dict:
    """The whole experiment: ``{"collision": ..., "chunk_agreement": ..., "extra": ..., "lowrank": ...}``.

    ``collision`` is :func:`run_collision`'s dict (``collision.json``), ``chunk_agreement``
    :func:`chunk_agreement`'s, ``extra`` :func:`run_extras`'s (``collision_extra.json``) and ``lowrank``
    :func:`run_lowrank`'s with :func:`run_multi_pair`'s under ``multi_pair`` (``collision_lowrank.json``).
    With ``config.out`` the three JSON files and the figures are written there and ``figures`` lists them.
    """
    if not isinstance(config, CollisionConfig):
        raise TypeError(f"config must be a CollisionConfig, got {type(config).__name__}")
    kw = config.noise()
    with _sweep_progress(len(MULTI_PAIRS) + 4, config.progress) as tick:
        tick("collision schedule and sweeps")
        results = run_collision(**kw, fixed_priors=config.fixed_priors, overlap_rhos=config.overlap_rhos)
        tick("oracle vs chunked path")
        record = {"collision": results, "chunk_agreement": chunk_agreement(**kw, overlap_rhos=config.overlap_rhos)}
        tick("write angle, rotated keys")
        record["extra"] = run_extras(**kw, b_repeats=config.b_repeats, seeds=config.rotation_seeds)
        tick("low-rank ranks")
        lowrank = run_lowrank(**kw, ranks=config.lowrank_ranks, seeds=config.rotation_seeds)
        tick(f"multi-pair n = {MULTI_PAIRS[0]}")
        lowrank["multi_pair"] = run_multi_pair(**kw, ranks=config.lowrank_ranks, seeds=config.rotation_seeds,
                                               on_pairs_done=lambda n: tick(f"multi-pair, n = {n} done"))
        record["lowrank"] = lowrank
    if config.out is not None:
        out_dir = check_out_dir(config.out, option="out")
        seeds = list(config.rotation_seeds)
        write_record(out_dir / "collision.json", results, allow_nan=False)
        paths = plot_collision(results, out_dir)
        write_record(out_dir / "collision_extra.json", record["extra"], seeds=seeds, allow_nan=False)
        write_record(out_dir / "collision_lowrank.json", lowrank, seeds=seeds, allow_nan=False)
        paths += plot_lowrank(lowrank, out_dir)
        record["figures"] = [str(p) for p in paths]
    return record


class _sweep_progress:
    """``with _sweep_progress(total, on) as tick: tick(label)``: a tqdm line on stderr that counts finished
    sweeps and names the next; ``tick`` marks the one before it done.  Nothing is shown when ``on`` is false."""

    def __init__(self, total: int, on: bool):
        self.total, self.on, self.bar, self.started = total, on, None, False

    def __enter__(self):
        if self.on:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc="collision", unit="sweep", file=sys.stderr, leave=False,
                            bar_format="{desc}: {n}/{total} sweeps [{elapsed}] {postfix}")
        return self.tick

    def tick(self, label: str) -> None:
        if self.bar is None:
            return
        if self.started:
            self.bar.update(1)
        self.started = True
        self.bar.set_postfix_str(label)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
        return False


def config_from_args(args: argparse.Namespace) -> CollisionConfig:
    """The :class:`CollisionConfig` that ``bayeslayer collision`` arguments name (``--out`` checked first)."""
    out_dir = check_out_dir(args.out)
    return CollisionConfig(rho=args.rho, p0=args.p0, r2=args.r2, ell2=args.ell2, out=str(out_dir),
                           progress=not args.no_progress)


# -- command line ---------------------------------------------------------------------------------
def _main(args: argparse.Namespace) -> int:
    out_dir = check_out_dir(args.out)
    if args.plot_only:
        results = plot_only_json(out_dir, "collision")
        with redrawing(out_dir / "collision.json"):
            paths = plot_collision(results, out_dir)
            print(format_table(results))
        lowrank_paths = []
        if (out_dir / "collision_lowrank.json").exists():
            lowrank = load_json(out_dir / "collision_lowrank.json")
            with redrawing(out_dir / "collision_lowrank.json"):
                lowrank_paths = plot_lowrank(lowrank, out_dir)
                print(format_lowrank_table(lowrank))
        print(
            f"\nRedrew {len(paths)} figures from {out_dir / 'collision.json'}: "
            + ", ".join(str(p) for p in paths)
        )
        if lowrank_paths:
            print(f"Redrew {len(lowrank_paths)} low-rank figures from {out_dir / 'collision_lowrank.json'}")
        return 0
    record = run(config_from_args(args))
    results, diffs, extras, lowrank = (record[k] for k in ("collision", "chunk_agreement", "extra", "lowrank"))
    print(format_table(results))
    print(
        "oracle vs chunked path, max |Δ| of readouts and gains: "
        + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items())
    )
    av, rot = extras["angle_vs_reinforcement"], extras["rotated_keys"]
    print(
        "write angle after n writes of B (deg): "
        + ", ".join(f"n={n}: {a:.2f}" for n, a in zip(av["b_repeats"], av["angle"], strict=True))
        + f"; limit arcsin ρ = {av['angle_limit']:.2f}"
    )
    print(
        f"keys turned by {len(rot['seeds'])} random rotations, final p^AB: "
        + ", ".join(f"{n} {min(rot[n]):.4f}..{max(rot[n]):.4f}" for n in MODELS)
    )
    print(format_lowrank_table(lowrank))
    paths = [Path(p) for p in record["figures"]]
    print(
        f"\nWrote {out_dir / 'collision.json'} (and collision_extra.json, collision_lowrank.json) and "
        f"{len(paths)} figures: " + ", ".join(p.name for p in paths) + f" in {out_dir}."
    )
    print(MEANING)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "collision",
        help="deterministic key-collision experiment (docs/theory.md §8.1): BL vs Delta, LA, diagonal; seconds",
        description=DESCRIPTION,
    )
    p.add_argument(
        "--out",
        default="results/collision",
        metavar="DIR",
        help="folder for collision.json and the figures (default: results/collision)",
    )
    p.add_argument("--plot-only", action="store_true", help=PLOT_ONLY_HELP)
    p.add_argument(
        "--rho", type=float, default=PAPER_CONFIG["rho"], help="key overlap k_Aᵀk_B (default 0.92)"
    )
    p.add_argument(
        "--p0", type=float, default=PAPER_CONFIG["p0"], help="prior variance P_0 = p0 I (default 3)"
    )
    p.add_argument("--r2", type=float, default=PAPER_CONFIG["r2"], help="observation noise r² (default 0.05)")
    p.add_argument("--ell2", type=float, default=PAPER_CONFIG["ell2"], help="process noise ℓ² (default 0.05)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    add_threads_option(p, SMALL)
    p.set_defaults(func=_main)
