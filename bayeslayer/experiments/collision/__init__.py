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

The package: :mod:`~bayeslayer.experiments.collision.protocol` (the schedule, the models, the simulation and
the closed forms), :mod:`~bayeslayer.experiments.collision.lowrank` (the low-rank precision sweeps),
:mod:`~bayeslayer.experiments.collision.figures` (``collision.json``'s figures and table),
:mod:`~bayeslayer.experiments.collision.tables` (the docs' tables of both records) and
:mod:`~bayeslayer.experiments.collision.command` (``run(CollisionConfig) -> record`` and the command line);
their public names are importable from here.
"""

from .command import (
    DESCRIPTION,
    CollisionConfig,
    add_parser,
    config_from_args,
    run,
)
from .figures import (
    FIGURES,
    MEANING,
    MODEL_LABELS,
    MODEL_STYLES,
    check_results,
    format_table,
    plot_collision,
)
from .lowrank import (
    LOWRANK_FIGURES,
    LOWRANK_PROJECTIONS,
    LOWRANK_RANKS,
    LOWRANK_REFERENCES,
    MULTI_PAIRS,
    format_lowrank_table,
    lowrank_designs,
    lowrank_key,
    multi_pair_inputs,
    plot_lowrank,
    run_lowrank,
    run_multi_pair,
)
from .protocol import (
    A_REPEATS,
    B_REPEATS,
    FIXED_PRIORS,
    IDENTITIES,
    LA_OMEGA,
    MODELS,
    OVERLAP_RHOS,
    PAPER_CONFIG,
    RESET_LAM,
    ROUNDS,
    A,
    B,
    check_dim,
    check_nonempty,
    check_overlap,
    check_positive,
    check_protocol,
    check_repeats,
    chunk_agreement,
    collision_inputs,
    delta_rule_readout,
    identity_keys,
    model_designs,
    prior_key,
    retrieval,
    rotated_keys,
    run_collision,
    run_extras,
    simulate,
    turn_keys,
    with_turns,
    write_angle,
    write_schedule,
)
from .tables import (
    closed_form_table,
    fixed_prior_table,
    lowrank_table,
    overlap_table,
    pairs_table,
    steps_table,
)

__all__ = [
    "A",
    "A_REPEATS",
    "B",
    "B_REPEATS",
    "CollisionConfig",
    "DESCRIPTION",
    "FIGURES",
    "FIXED_PRIORS",
    "IDENTITIES",
    "LA_OMEGA",
    "LOWRANK_FIGURES",
    "LOWRANK_PROJECTIONS",
    "LOWRANK_RANKS",
    "LOWRANK_REFERENCES",
    "MEANING",
    "MODELS",
    "MODEL_LABELS",
    "MODEL_STYLES",
    "MULTI_PAIRS",
    "OVERLAP_RHOS",
    "PAPER_CONFIG",
    "RESET_LAM",
    "ROUNDS",
    "add_parser",
    "check_dim",
    "check_nonempty",
    "check_overlap",
    "check_positive",
    "check_protocol",
    "check_repeats",
    "check_results",
    "chunk_agreement",
    "closed_form_table",
    "collision_inputs",
    "config_from_args",
    "delta_rule_readout",
    "fixed_prior_table",
    "format_lowrank_table",
    "format_table",
    "identity_keys",
    "lowrank_designs",
    "lowrank_key",
    "lowrank_table",
    "model_designs",
    "multi_pair_inputs",
    "overlap_table",
    "pairs_table",
    "plot_collision",
    "plot_lowrank",
    "prior_key",
    "retrieval",
    "rotated_keys",
    "run",
    "run_collision",
    "run_extras",
    "run_lowrank",
    "run_multi_pair",
    "simulate",
    "steps_table",
    "turn_keys",
    "with_turns",
    "write_angle",
    "write_schedule",
]
