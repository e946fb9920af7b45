"""The docs' tables of the collision study's records: ``collision.json`` (the four filters' trajectories, the
fixed prior, the overlap sweep and the closed forms) and ``collision_lowrank.json`` (the rank sweep and ``n``
collisions at once).  Each takes the record as read from its JSON and returns Markdown; ``tools/build_tables.py``
finds the committed records and splices the tables into the docs."""

from __future__ import annotations

from ..common.tables import check_record, markdown_row, minus, separator
from .figures import MODEL_LABELS
from .lowrank import LOWRANK_REFERENCES, lowrank_key
from .protocol import MODELS


def _f4(value: float) -> str:
    return minus(f"{value:.4f}")


def steps_table(record: dict) -> str:
    """``p^AB`` after steps 12, 52 and 112, the final margin and gain, per model of ``collision.json``."""
    models = check_record(record)["models"]
    lines = [markdown_row(["model", "t = 12", "t = 52", "t = 112", "margin t = 112", "gain t = 112"]), separator(6)]
    for key in MODELS:
        m = models[key]
        lines.append(markdown_row([MODEL_LABELS[key], *(_f4(m["p_ab"][t - 1]) for t in (12, 52, 112)),
                                   _f4(m["margin"][-1]), _f4(m["gain"][-1])]))
    return "\n".join(lines)


def fixed_prior_table(record: dict) -> str:
    """Gain and final ``p^AB`` of the fixed isotropic prior ``c``, one column per ``c`` of ``collision.json``."""
    prior = check_record(record)["fixed_prior"]
    cs = list(prior)
    return "\n".join([markdown_row(["fixed prior c", *(f"{float(c):g}" if float(c) >= 1 else c for c in cs)]),
                      separator(len(cs) + 1),
                      markdown_row(["gain c/(r² + c)", *(_f4(prior[c]["gain"]) for c in cs)]),
                      markdown_row(["final p^AB", *(_f4(prior[c]["final_p_ab"]) for c in cs)])])


#: the overlaps ρ whose final ``p^AB`` the overlap table shows (the nearest of the sweep's)
OVERLAPS_SHOWN = (0.0, 0.5, 0.8, 0.9, 0.92, 0.99)


def overlap_table(record: dict) -> str:
    """Final ``p^AB`` at the overlaps :data:`OVERLAPS_SHOWN`, and the first ρ of the sweep where it drops below
    0.5, per model of ``collision.json``."""
    overlap = check_record(record)["overlap"]
    rhos = overlap["rho"]
    idx = [min(range(len(rhos)), key=lambda i, r=r: abs(rhos[i] - r)) for r in OVERLAPS_SHOWN]
    lines = [markdown_row(["final p^AB at ρ =", *(f"{r:.2f}" for r in OVERLAPS_SHOWN), "first ρ with p^AB < 0.5"]),
             separator(len(OVERLAPS_SHOWN) + 2)]
    for key in MODELS:
        values = overlap[key]
        first = next((rhos[i] for i, v in enumerate(values) if v < 0.5), None)
        label = MODEL_LABELS[key] if key == "bayesian" else MODEL_LABELS[key].split(" (")[0]
        lines.append(markdown_row([label, *(_f4(values[i]) for i in idx),
                                   f"none (≤ {rhos[-1]:.2f})" if first is None else f"{first:.2f}"]))
    return "\n".join(lines)


def _diff(predicted: float, simulated: float) -> str:
    d = abs(predicted - simulated)
    return "diff < 1e-15" if d == 0 else f"diff {d:.0e}"


#: the closed forms of docs/theory.md §4: label, key of ``closed_form``, decimals, how the simulation measures it
CLOSED_FORMS = (
    ("gain floor `g_∞ = x_∞/(r² + x_∞)`", "g_inf", 7,
     "BL gain at step 112, the 60th consecutive A; `r² = ℓ²` makes `g_∞ = 1/φ`"),
    ("`Δ_B → (1 − ρ²) ℓ²`", "delta_B", 7,
     "`k_Bᵀ P_112 k_B − k_Bᵀ P_111 k_B`, from the filter's predictive variance at query `k_B`"),
    ("write angle `arcsin ρ` (deg)", "angle", 2,
     "angle between `k_A` and the column space of `M_53 − M_52` (the write actually applied at the "
     "first A after B's reinforcement)"),
    ("Delta plateau `b_∞ = b_0 − ρ(a_0 − v_A)`, as `p^AB`", "reset_plateau", 6,
     "reset `p^AB` at step 112; `a_0, b_0` are the reset filter's readouts after step 52"))


def closed_form_table(record: dict) -> str:
    """The closed forms of the collision study against the simulation (``closed_form`` of ``collision.json``):
    a prediction the simulation does not reach to 1e-12 is in bold."""
    cf = check_record(record)["closed_form"]
    lines = [markdown_row(["quantity", "predicted", "simulated", "measurement"]), separator(4)]
    for label, key, digits, how in CLOSED_FORMS:
        predicted = cf[key if key in ("g_inf", "reset_plateau") else f"{key}_limit"]
        simulated = cf[f"{key}_simulated"]
        if abs(predicted - simulated) < 1e-12:
            sim = f"{simulated:.{digits}f} ({_diff(predicted, simulated)})"
        else:  # a prediction the simulation does not reach: in bold
            sim = f"**{simulated:.{digits}f}**"
        lines.append(markdown_row([label, f"{predicted:.{digits}f}", sim, how]))
    return "\n".join(lines)


_LOWRANK_LABELS = {"bayesian": "dense BL", "diagonal": "diagonal covariance", "reset": "Delta (λ = 0.05)"}


def _lowrank_rows(record: dict, *, max_rank: int) -> list[tuple[str, str]]:
    rows = [(key, _LOWRANK_LABELS[key]) for key in LOWRANK_REFERENCES]
    for projection in record["projections"]:
        rows += [(lowrank_key(projection, r), f"low-rank r = {r}, {projection}") for r in record["ranks"]
                 if r <= max(max_rank, 0) and (r < record["config"]["D"] or projection == "conservative")
                 and lowrank_key(projection, r) in record["models"]]
    return rows


def _range4(values: list[float]) -> str:
    lo, hi = f"{min(values):.4f}", f"{max(values):.4f}"
    return lo if lo == hi else f"{lo}–{hi}"


def lowrank_table(record: dict) -> str:
    """Rank sweep of ``collision_lowrank.json``: state floats, final ``p^AB`` with the paper's keys and over the
    rotated keys, final gain."""
    check_record(record)
    lines = [markdown_row(["model", "state floats", "final p^AB, paper's keys",
                           f"rotated keys ({len(record['seeds'])} seeds)", f"gain t = {record['config']['steps']}"]),
             separator(5)]
    for key, label in _lowrank_rows(record, max_rank=record["config"]["D"]):
        m = record["models"][key]
        lines.append(markdown_row([label, str(m["state_floats"]), _f4(m["final_p_ab"]),
                                   _range4(m["rotated_final_p_ab"]), _f4(m["gain"][-1])]))
    return "\n".join(lines)


def pairs_table(record: dict) -> str:
    """``n`` collisions at once (``multi_pair`` of ``collision_lowrank.json``): mean final ``p^AB`` with the
    paper's keys / the rotated keys, the worst rotated pair in brackets, ranks up to ``D/2``."""
    mp = check_record(record)["multi_pair"]
    lines = [markdown_row(["model", *(f"n = {n}" for n in mp["pairs"])]), separator(len(mp["pairs"]) + 1)]
    for key, label in _lowrank_rows(record, max_rank=record["config"]["D"] // 2):
        m = mp["models"][key]
        lines.append(markdown_row([label, *(f"{m['mean_p_ab'][i]:.3f} / {m['rotated_mean_p_ab'][i]:.3f} "
                                            f"({m['rotated_min_p_ab'][i]:.3f})" for i in range(len(mp["pairs"])))]))
    return "\n".join(lines)


__all__ = ["CLOSED_FORMS", "OVERLAPS_SHOWN", "closed_form_table", "fixed_prior_table", "lowrank_table",
           "overlap_table", "pairs_table", "steps_table"]
