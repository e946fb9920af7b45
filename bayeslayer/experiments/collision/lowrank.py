"""The low-rank-plus-diagonal precision design on the collision schedule: the rank sweep, the
multi-pair variant, their figures and table (``collision_lowrank.json``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ...design import (
    DesignModel,
    lowrank_diagonal,
)
from ..common.plotting import RefLine, Series, line_plot
from .figures import (
    MODEL_LABELS,
    MODEL_STYLES,
)
from .protocol import (
    A_REPEATS,
    B_REPEATS,
    IDENTITIES,
    ROUNDS,
    check_nonempty,
    check_overlap,
    check_positive,
    check_protocol,
    check_repeats,
    collision_inputs,
    model_designs,
    retrieval,
    simulate,
    turn_keys,
    with_turns,
)

# the low-rank-plus-diagonal precision design (bayeslayer.ops.bayesian_layer.lowrank), written to collision_lowrank.json
LOWRANK_RANKS = (0, 1, 2, 4, 8, 16)
LOWRANK_PROJECTIONS = ("conservative", "lofi")
LOWRANK_REFERENCES = ("bayesian", "diagonal", "reset")
LOWRANK_FIGURES = ("collision_lowrank_p_ab.png", "collision_lowrank_gain.png", "collision_lowrank_floats.png",
                   "collision_lowrank_pairs.png")
MULTI_PAIRS = (1, 2, 4, 8)


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
    rho, D, m, p0, r2, ell2 = check_protocol(rho, D, m, p0, r2, ell2)
    ranks = [int(r) for r in check_nonempty("ranks", ranks)]
    projections = list(check_nonempty("projections", projections))
    seeds = [int(s) for s in check_nonempty("seeds", seeds)]
    designs = lowrank_designs(r2, ell2, p0, projections, ranks)
    inputs = collision_inputs([rho], D=D, m=m)
    # batch row 0: the paper's keys; row 1 + i: keys turned by seed i (one filter call per design)
    batch = with_turns(inputs, seeds)
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
    pairs = check_repeats("pairs", pairs)
    if 2 * pairs > D:
        raise ValueError(f"pairs={pairs} needs 2·pairs <= D = {D} key dims")
    rho = check_overlap("rho", rho)
    n = 2 * pairs
    keys = torch.zeros(n, D, dtype=torch.float64)
    for i in range(pairs):
        keys[2 * i, 2 * i] = 1.0
        keys[2 * i + 1, 2 * i] = rho
        keys[2 * i + 1, 2 * i + 1] = math.sqrt(1.0 - rho * rho)
    b_ids = [2 * i + 1 for i in range(pairs)]
    a_ids = [2 * i for i in range(pairs)]
    schedule = torch.tensor(list(range(n)) * ROUNDS + b_ids * check_repeats("b_repeats", b_repeats)
                            + a_ids * check_repeats("a_repeats", a_repeats))
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
    p0, r2, ell2 = check_positive("p0", p0), check_positive("r2", r2), check_positive("ell2", ell2)
    pairs = [int(n) for n in check_nonempty("pairs", pairs)]
    ranks = [int(r) for r in check_nonempty("ranks", ranks)]
    seeds = [int(sd) for sd in check_nonempty("seeds", seeds)]
    designs = lowrank_designs(r2, ell2, p0, check_nonempty("projections", projections), ranks)
    out: dict = {"pairs": pairs, "b_repeats": B_REPEATS, "a_repeats": A_REPEATS, "seeds": seeds,
                 "models": {n: {"state_floats": [], "mean_p_ab": [], "min_p_ab": [], "rotated_mean_p_ab": [],
                                "rotated_min_p_ab": []} for n in designs}}
    for n_pairs in pairs:
        inputs, keys = multi_pair_inputs(n_pairs, rho, D=D)
        batch = with_turns(inputs, seeds)
        # the B keys each batch row is read at: [N, n, D]
        kb = torch.cat([keys[1::2][None]] + [turn_keys((keys[1::2][None, None], keys[1::2][None, None], None),
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
