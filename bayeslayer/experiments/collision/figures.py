"""``collision.json`` checked, drawn as the experiment's four figures and summarised as its table."""

from __future__ import annotations

import math
from pathlib import Path

from ..common.plotting import RefLine, Series, line_plot
from .protocol import (
    A_REPEATS,
    IDENTITIES,
    MODELS,
    ROUNDS,
)

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
