"""The collision protocol (docs/theory.md §8.1): its write schedule and inputs, the four models, the
simulation, and the closed forms measured from it (:mod:`bayeslayer.experiments.collision` describes each).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from ...design import (
    BAYESIAN,
    DELTANET,
    DIAGONAL_COVARIANCE,
    LINEAR_ATTENTION,
    DesignModel,
    fixed_prior,
)
from ...ops import FilterOutput

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


# -- argument checks ------------------------------------------------------------------------------
def check_positive(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be finite and > 0, got {x}")
    return float(x)


def check_overlap(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    if not (math.isfinite(x) and 0.0 <= x < 1.0):
        # ρ = 1 is a different problem: identical keys with conflicting values (docs/theory.md §4.4).
        raise ValueError(f"{name} must be a key overlap in [0, 1), got {x}")
    return float(x)


def check_dim(name: str, x, least: int) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < least:
        raise ValueError(f"{name} must be >= {least} (six identities need {least} slots), got {x}")
    return int(x)


def check_repeats(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    return int(x)


def check_protocol(rho, D, m, p0, r2, ell2) -> tuple[float, int, int, float, float, float]:
    """The collision protocol's scalars, checked (each error names its argument) and as float / int."""
    return (check_overlap("rho", rho), check_dim("D", D, len(IDENTITIES)), check_dim("m", m, len(IDENTITIES)),
            check_positive("p0", p0), check_positive("r2", r2), check_positive("ell2", ell2))


def prior_key(c: float) -> str:
    """JSON key of a fixed prior ``c``: two decimals (``"0.10"``, ``"1.00"``), more only when needed."""
    return f"{c:.2f}" if abs(c * 100 - round(c * 100)) < 1e-9 else f"{c:g}"


# -- inputs ---------------------------------------------------------------------------------------
def write_schedule(b_repeats: int = B_REPEATS, a_repeats: int = A_REPEATS) -> list[int]:
    """Identity index written at each step: ``[A..F] × 2``, then ``B × b_repeats``, then ``A × a_repeats``.

    >>> "".join(IDENTITIES[i] for i in write_schedule(2, 3))
    'ABCDEFABCDEFBBAAA'
    """
    b_repeats, a_repeats = check_repeats("b_repeats", b_repeats), check_repeats("a_repeats", a_repeats)
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
    rho = torch.tensor([check_overlap("rho", r) for r in rhos], dtype=torch.float64)
    D, m = check_dim("D", D, len(IDENTITIES)), check_dim("m", m, len(IDENTITIES))
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
    r2, ell2, p0 = check_positive("r2", r2), check_positive("ell2", ell2), check_positive("p0", p0)
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
    ``overlap = {rho, <model>: final p_ab per ρ}``; ``closed_form`` (:mod:`bayeslayer.experiments.collision`).
    """
    rho, D, m, p0, r2, ell2 = check_protocol(rho, D, m, p0, r2, ell2)
    priors = [check_positive("fixed_priors entry", c) for c in check_nonempty("fixed_priors", fixed_priors)]
    if len({prior_key(c) for c in priors}) != len(priors):
        raise ValueError(f"fixed_priors must be distinct, got {list(fixed_priors)}")
    rhos = sorted({check_overlap("overlap_rhos entry", r) for r in check_nonempty("overlap_rhos", overlap_rhos)})

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


def check_nonempty(name: str, values) -> list:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of numbers, got {values!r}")
    return list(values)


def _closed_form(results: dict, designs: dict, inputs, bayes_out: FilterOutput) -> dict:
    """docs/theory.md §4's predictions next to the same quantities measured from the simulation (package docstring)."""
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
    rhos = sorted({check_overlap("rho", rho)} | {check_overlap("overlap_rhos entry", r) for r in overlap_rhos})
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
    seeds = [int(s) for s in check_nonempty("seeds", seeds)]
    q, k, v = collision_inputs([rho], D=D, m=m)
    designs = model_designs(r2, ell2, p0)
    out: dict = {"rho": float(rho), "seeds": seeds, **{n: [] for n in MODELS}}
    for seed in seeds:
        turned = turn_keys((q, k, v), seed)
        for name, (design, noise) in designs.items():
            out[name].append(retrieval(simulate(design, noise, turned).o)[0][0, -1].item())
    return out


def turn_keys(inputs, seed: int):
    """Keys and queries turned by the random orthogonal ``Q`` of ``seed`` (QR of a Gaussian ``D×D``)."""
    q, k, v = inputs
    D = q.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))
    return q @ Q.T, k @ Q.T, v


def with_turns(inputs, seeds: Sequence[int]):
    """Batch row 0: ``inputs`` (the paper's keys); row ``1 + i``: the keys turned by ``seeds[i]``."""
    turned = [turn_keys(inputs, seed) for seed in seeds]
    return tuple(torch.cat([inputs[j]] + [t[j] for t in turned], 0) for j in range(3))


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
            "angle_limit": math.degrees(math.asin(check_overlap("rho", rho))),
        },
        "rotated_keys": rotated_keys(rho, seeds, **kw),
    }
