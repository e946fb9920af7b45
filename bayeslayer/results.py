"""Results tables of the docs, generated from the committed records: ``python -m bayeslayer.results tables``.

Every table of results in ``README.md`` and ``docs/*.md`` that comes from a record under ``results/``
sits between two markers naming its generator::

    <!-- results-table NAME: python -m bayeslayer.results tables -->
    | ... the table ... |
    <!-- /results-table NAME -->

``tables`` rewrites what lies between the markers from the JSON records (:data:`TABLES`); ``tables
--check`` rewrites nothing and exits 1, naming each table, when a document differs from what the
records give (byte for byte) or holds a marker this module does not know.  The test suite runs the
check, so a number edited by hand, or a record changed without regenerating its table, fails.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

#: The documents that may hold generated tables, relative to the checkout's root.
DOCUMENTS = ("README.md", "docs/experiments.md", "docs/kernels.md", "docs/data.md", "docs/layers.md",
             "docs/models.md", "docs/reliability.md")
COMMAND = "python -m bayeslayer.results tables"
_BEGIN = re.compile(r"^<!-- results-table (?P<name>[a-z0-9-]+): python -m bayeslayer\.results tables -->$")
_END = "<!-- /results-table {name} -->"


def _load(root: Path, rel: str) -> dict:
    path = root / rel
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"the table needs the record {rel}, which is missing under {root}") from None


def _pm(mean: float, std: float, digits: int) -> str:
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _row(cells) -> str:
    return " ".join(("| " + " | ".join(cells) + " |").split(" ")).replace("|  |", "| |").replace("|  |", "| |")


# --------------------------------------------------------------------------- language modelling (Table 2 layout)

_LM_GROUPS = ("all", "ar_hit", "other", "ar_hit_1_64", "ar_hit_65_256", "ar_hit_257_1024")


def lm_table(record_path: str, ours: str, paper: tuple[str, ...]) -> Callable[[Path], str]:
    """Our models' grouped PPL (mean ± std over seeds) with the paper's Table 2 rows below them."""

    def build(root: Path) -> str:
        rec = _load(root, record_path)
        lines = [_row(["model", "all", "AR-hit", "other", "AR-hit 1–64", "AR-hit 65–256", "AR-hit 257–1,024"]),
                 "|---|---|---|---|---|---|---|"]
        for label, m in rec["models"].items():
            n = len(m["seeds"])
            cells = [_pm(m["summary"][g]["mean"], m["summary"][g]["std"], 2) for g in _LM_GROUPS]
            lines.append(_row([f"{label} ({ours}{n} seeds)", *cells]))
        for label in paper:
            p = rec["paper_table2"][label]
            cells = [f"{p[g][0]} ± {p[g][1]}" for g in ("all", "ar_hit", "other")] + ["", "", ""]
            lines.append(_row([f"{label} (paper, 3 seeds)", *cells]))
        return "\n".join(lines)

    return build


# --------------------------------------------------------------------------- MQAR layouts

def _on_off(value, on: str, off: str) -> str:
    return "—" if value is None else (on if value else off)


def mqar_table(record_path: str, head: str, xs: tuple, x_labels: tuple[str, ...], *, val_label: str = "val",
               train_seconds: bool = True, gate: bool = True) -> Callable[[Path], str]:
    """Query accuracy (mean ± std over seeds) at the points ``xs`` of the sweep, per mixer of the record."""

    def build(root: Path) -> str:
        rec = _load(root, record_path)
        header = [head] + (["gate"] if gate else []) + ["conv", *x_labels, val_label] + (["train s"] if train_seconds
                                                                                         else [])
        lines = [_row(header), "|" + "---|" * len(header)]
        for m in rec["models"].values():
            s, run = m["summary"], m["runs"][-1]
            idx = [s["x"].index(x) for x in xs]
            cells = [m["label"]]
            if gate:
                cells.append(_on_off(run["use_gate"], "on", "off"))
            cells.append(_on_off(run["use_short_conv"], "yes", "no"))
            cells += [_pm(s["accuracy"]["mean"][i], s["accuracy"]["std"][i], 3) for i in idx]
            cells.append(f"{s['val_accuracy']['mean'][-1]:.3f}")
            if train_seconds:
                cells.append(f"{s['train_seconds']['mean']:.0f}")
            lines.append(_row(cells))
        return "\n".join(lines)

    return build


# --------------------------------------------------------------------------- recall and crowding sweeps

_CORE_COLUMNS = (("bayesian", "BL"), ("delta", "Delta-style"), ("linear_attention", "LA-style"), ("gla", "GLA-style"))


def sweep_table(record_path: str, head: str, axis: str, curve: str, x_format: Callable[[dict, float], str]
                ) -> Callable[[Path], str]:
    """One row per point of ``config[axis]``, one column per core model: ``summary[curve]`` mean ± std."""

    def build(root: Path) -> str:
        rec = _load(root, record_path)
        lines = [_row([head, *(label for _, label in _CORE_COLUMNS)]), "|" + "---|" * (len(_CORE_COLUMNS) + 1)]
        for i, x in enumerate(rec["config"][axis]):
            cells = [_pm(rec["models"][k]["summary"][curve]["mean"][i], rec["models"][k]["summary"][curve]["std"][i],
                         3) for k, _ in _CORE_COLUMNS]
            lines.append(_row([x_format(rec["config"], x), *cells]))
        return "\n".join(lines)

    return build


def core_comparison_table(ours_path: str, paper_path: str) -> Callable[[Path], str]:
    """Our cores (per-token noise maps, ``ours_path``) against the paper's (per-head scalars, ``paper_path``,
    ``--core paper``) for BL and Delta: accuracy at ``n_f ∈ {64, 128, 256}`` (ρ = 0.80) and margin at
    ρ ∈ {0.80, 0.90, 0.95} (``n_f = 64``), mean ± std over seeds; a model a record lacks is "not run"."""
    rows = (("accuracy at n_f = 64", "test_n_f", 64, "accuracy_vs_n_f"),
            ("accuracy at n_f = 128", "test_n_f", 128, "accuracy_vs_n_f"),
            ("accuracy at n_f = 256", "test_n_f", 256, "accuracy_vs_n_f"),
            ("margin at ρ = 0.80", "test_rho", 0.80, "margin_vs_rho"),
            ("margin at ρ = 0.90", "test_rho", 0.90, "margin_vs_rho"),
            ("margin at ρ = 0.95", "test_rho", 0.95, "margin_vs_rho"))
    columns = (("BL, ours", "ours", "bayesian"), ("BL, paper core", "paper", "bayesian_paper"),
               ("Delta, ours", "ours", "delta"), ("Delta, paper core", "paper", "delta_paper"))

    def build(root: Path) -> str:
        recs = {"ours": _load(root, ours_path), "paper": _load(root, paper_path)}
        lines = [_row(["", *(label for label, _, _ in columns)]), "|" + "---|" * (len(columns) + 1)]
        for label, axis, x, curve in rows:
            cells = []
            for _, which, kind in columns:
                rec = recs[which]
                model = rec["models"].get(kind)
                if model is None:
                    cells.append("not run")
                    continue
                i = [round(v, 6) for v in rec["config"][axis]].index(round(x, 6))
                stats = model["summary"][curve]
                cells.append(_pm(stats["mean"][i], stats["std"][i], 3))
            lines.append(_row([label, *cells]))
        return "\n".join(lines)

    return build


def _load_label(config: dict, load: float) -> str:
    return f"{load:g} ({int(load * config['address_dim'])})"


# --------------------------------------------------------------------------- deterministic collision

_COLLISION_ROWS = (("bayesian", "Bayesian (BL)"), ("reset", "reset / Delta (λ = 0.05)"),
                   ("linear_attention", "linear attention (ω = 0.5)"), ("diagonal", "diagonal covariance"))


def _f4(value: float) -> str:
    return f"{value:.4f}".replace("-", "−")


def collision_steps_table(root: Path) -> str:
    """``p^AB`` after steps 12, 52 and 112, the final margin and gain, per model."""
    rec = _load(root, "results/collision/collision.json")
    lines = [_row(["model", "t = 12", "t = 52", "t = 112", "margin t = 112", "gain t = 112"]),
             "|---|---|---|---|---|---|"]
    for key, label in _COLLISION_ROWS:
        m = rec["models"][key]
        lines.append(_row([label, *(_f4(m["p_ab"][t - 1]) for t in (12, 52, 112)), _f4(m["margin"][-1]),
                           _f4(m["gain"][-1])]))
    return "\n".join(lines)


def collision_fixed_prior_table(root: Path) -> str:
    """Gain and final ``p^AB`` of the fixed isotropic prior ``c``."""
    rec = _load(root, "results/collision/collision.json")
    cs = list(rec["fixed_prior"])
    lines = [_row(["fixed prior c", *(f"{float(c):g}" if float(c) >= 1 else c for c in cs)]),
             "|" + "---|" * (len(cs) + 1),
             _row(["gain c/(r² + c)", *(_f4(rec["fixed_prior"][c]["gain"]) for c in cs)]),
             _row(["final p^AB", *(_f4(rec["fixed_prior"][c]["final_p_ab"]) for c in cs)])]
    return "\n".join(lines)


def collision_overlap_table(root: Path) -> str:
    """Final ``p^AB`` at a few key overlaps ρ, and the first ρ of the sweep where it drops below 0.5."""
    rec = _load(root, "results/collision/collision.json")
    rhos = rec["overlap"]["rho"]
    shown = (0.0, 0.5, 0.8, 0.9, 0.92, 0.99)
    idx = [min(range(len(rhos)), key=lambda i, r=r: abs(rhos[i] - r)) for r in shown]
    lines = [_row(["final p^AB at ρ =", *(f"{r:.2f}" for r in shown), "first ρ with p^AB < 0.5"]),
             "|" + "---|" * (len(shown) + 2)]
    for key, label in _COLLISION_ROWS:
        values = rec["overlap"][key]
        first = next((rhos[i] for i, v in enumerate(values) if v < 0.5), None)
        label = label.split(" (")[0] if key != "bayesian" else label
        lines.append(_row([label, *(_f4(values[i]) for i in idx),
                           f"none (≤ {rhos[-1]:.2f})" if first is None else f"{first:.2f}"]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- retrofit by distillation

_STAGES = (("phase_a", "Phase A"), ("phase_b", "Phase B"), ("gdn_ft", "GDN-FT"))


def distill_stages_table(root: Path) -> str:
    """Per stage: steps × tokens per step, trainable tensors / elements (MLP share), time, loss, validation PPL."""
    rec = _load(root, "results/distill/cpu/distill.json")
    lines = [_row(["stage", "steps × tokens", "trainable (tensors / elements; MLP)", "time",
                   "final train loss (last 10% of steps)", "validation PPL (L = 512)"]), "|---|---|---|---|---|---|"]
    for key, label in _STAGES:
        st = rec["stages"][key]
        elements = st["trainable_elements"]
        lines.append(_row([
            label, f"{st['steps']} × {st['tokens'] // st['steps']:,} = {st['tokens']:,}",
            f"{st['trainable_parameters']} / {sum(elements.values()):,}; {elements.get('mlp', 0):,}",
            f"{st['train_seconds']:.0f} s", f"{st['final_train_loss']:.4f}", f"{st['validation']['all']['ppl']:.2f}"]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- held-out PPL (Table 7 layout)

def heldout_table(record_path: str) -> Callable[[Path], str]:
    """Held-out PPL per model and window length, with the change against the reference model."""

    def build(root: Path) -> str:
        from .experiments.lengths import length_label

        rec = _load(root, record_path)
        source = rec["config"]["sources"][0]["label"]
        lengths = [str(L) for L in rec["config"]["lengths"]]
        lines = [_row(["model", *(length_label(int(L)) for L in lengths)]), "|" + "---|" * (len(lengths) + 1)]
        for label, m in rec["models"].items():
            cells = []
            for L in lengths:
                cell = m["cells"][source][L]
                rel = cell.get("rel_change_pct")
                cells.append(f"{cell['ppl']:.2f}" + ("" if rel is None else f" ({rel:+.1f}%)".replace("-", "−")))
            lines.append(_row([label, *cells]))
        return "\n".join(lines)

    return build


#: name -> (document, generator).  A generator reads records under the root and returns the table's lines.
_VARIANCE_RECORD = "results/variance/variance.json"


def variance_auroc_table(root: Path) -> str:
    """Per task: accuracy and the AUROC for a wrong answer of the variance, the entropy and both (mean ± std)."""
    rec = _load(root, _VARIANCE_RECORD)
    keys = ("accuracy", "auroc_variance_last", "auroc_variance_mean", "auroc_entropy", "auroc_combined")
    lines = [_row(["task", "accuracy", "AUROC variance (last layer)", "variance (mean over layers)", "entropy",
                   "combined"]), "|---|---|---|---|---|---|"]
    for task in rec["models"].values():
        s = task["summary"]
        lines.append(_row([task["label"]] + [_pm(s[k]["mean"], s[k]["std"], 3) if s[k] else "n/a" for k in keys]))
    return "\n".join(lines)


def variance_abstention_table(root: Path) -> str:
    """MQAR Update: accuracy of the answered queries at a few coverages, abstaining on high variance or entropy."""
    rec = _load(root, _VARIANCE_RECORD)
    s = rec["models"]["mqar_update"]["summary"]
    at = (0, 2, 4, 6, 9)  # coverage 10%, 30%, 50%, 70%, 100%
    cov = s["coverage_variance_last"]["coverage"]
    lines = [_row(["MQAR Update, coverage"] + [f"{cov[i]:.0%}" for i in at]), "|---" * (len(at) + 1) + "|"]
    for score, label in (("variance_last", "abstain on high variance"), ("entropy", "abstain on high entropy")):
        lines.append(_row([label] + [f"{s[f'coverage_{score}']['mean'][i]:.3f}" for i in at]))
    return "\n".join(lines)


TABLES: dict[str, tuple[str, Callable[[Path], str]]] = {
    "collision-steps": ("docs/experiments.md", collision_steps_table),
    "collision-fixed-prior": ("docs/experiments.md", collision_fixed_prior_table),
    "collision-overlap": ("docs/experiments.md", collision_overlap_table),
    "lm-cpu": ("docs/experiments.md", lm_table("results/lm/cpu_test.json", "ours, `cpu`, ", ("BL", "GDN"))),
    "lm-cpu60": ("docs/experiments.md", lm_table("results/lm/cpu60_test.json", "ours, ", ("BL", "GDN", "Mamba-2"))),
    "mqar-update-stacked": ("docs/experiments.md", mqar_table(
        "results/mqar/layouts/mqar_update.json", "stacked", (0, 4, 8, 12, 16), ("u = 0", "4", "8", "12", "16"))),
    "mqar-update-hybrid": ("docs/experiments.md", mqar_table(
        "results/mqar/layouts/mqar_update_hybrid.json", "hybrid", (0, 4, 8, 12, 16), ("u = 0", "4", "8", "12", "16"))),
    "mqar-block-stacked": ("docs/experiments.md", mqar_table(
        "results/mqar/layouts/mqar_block.json", "stacked", (2, 8, 10, 12, 14, 16),
        ("2 pairs", "8", "10", "12", "14", "16"))),
    "mqar-block-hybrid": ("docs/experiments.md", mqar_table(
        "results/mqar/layouts/mqar_block_hybrid.json", "hybrid", (2, 8, 10, 12, 14, 16),
        ("2 pairs", "8", "10", "12", "14", "16"))),
    "mqar-base-stacked": ("docs/experiments.md", mqar_table(
        "results/mqar/layouts/mqar_base.json", "stacked", (16, 32, 64), ("width 16", "32", "64"),
        val_label="val (64)", train_seconds=False)),
    "mqar-base-hybrid": ("docs/experiments.md", mqar_table(
        "results/mqar/layouts/mqar_base_hybrid.json", "hybrid", (16, 32, 64), ("width 16", "32", "64"),
        val_label="val (64)", train_seconds=False)),
    "mqar-update-gate-off": ("docs/experiments.md", mqar_table(
        "results/mqar/layouts/mqar_update_gate-off.json", "stacked, gate off", (0, 4, 8, 12, 16),
        ("u = 0", "4", "8", "12", "16"), train_seconds=False, gate=False)),
    "recall-accuracy-nf": ("docs/experiments.md", sweep_table(
        "results/recall/recall.json", "n_f", "test_n_f", "accuracy_vs_n_f", lambda c, x: f"{x:g}")),
    "recall-margin-rho": ("docs/experiments.md", sweep_table(
        "results/recall/recall.json", "ρ", "test_rho", "margin_vs_rho", lambda c, x: f"{x:.2f}")),
    "recall-paper-core": ("docs/experiments.md", core_comparison_table(
        "results/recall/recall.json", "results/recall/paper-core/recall.json")),
    "recall-paper-core-long": ("docs/experiments.md", core_comparison_table(
        "results/recall/long/recall.json", "results/recall/paper-core/long/recall.json")),
    "crowding-ce": ("docs/experiments.md", sweep_table(
        "results/crowding/crowding.json", "n/D (n)", "test_load", "cross_entropy_vs_load", _load_label)),
    "crowding-accuracy": ("docs/experiments.md", sweep_table(
        "results/crowding/crowding.json", "n/D (n)", "test_load", "accuracy_vs_load", _load_label)),
    "distill-stages": ("docs/experiments.md", distill_stages_table),
    "distill-heldout": ("docs/experiments.md", heldout_table("results/distill/cpu/eval/heldout/heldout.json")),
    "variance-auroc": ("docs/experiments.md", variance_auroc_table),
    "variance-abstention": ("docs/experiments.md", variance_abstention_table),
}


def render(text: str, root: Path, *, document: str = "") -> tuple[str, list[str]]:
    """``text`` with every marked table regenerated, and the problems found (unknown or unclosed markers)."""
    lines = text.split("\n")
    out: list[str] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        match = _BEGIN.match(lines[i])
        i += 1
        if not match:
            continue
        name = match["name"]
        end = _END.format(name=name)
        try:
            j = lines.index(end, i)
        except ValueError:
            problems.append(f"{document}: table {name!r} has no closing marker {end!r}")
            continue
        if name not in TABLES:
            problems.append(f"{document}: table {name!r} has no generator in bayeslayer.results.TABLES")
            out.extend(lines[i:j])
        elif TABLES[name][0] != document:
            problems.append(f"{document}: table {name!r} belongs to {TABLES[name][0]}")
            out.extend(lines[i:j])
        else:
            out.extend(TABLES[name][1](root).split("\n"))
        i = j
    return "\n".join(out), problems


def regenerate(root: str | Path = ".", *, check: bool = False) -> list[str]:
    """Regenerate (or, with ``check``, compare) every marked table under ``root``; returns the problems.

    A problem is a document whose tables differ from the records (``check``), an unknown or unclosed
    marker, or a table of :data:`TABLES` that no document marks.
    """
    root = Path(root)
    if not (root / "results").is_dir():
        raise FileNotFoundError(f"root: {root} has no results/ folder; run from the checkout's root or pass --root")
    problems: list[str] = []
    seen: set[str] = set()
    for document in DOCUMENTS:
        path = root / document
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        seen.update(m["name"] for m in map(_BEGIN.match, text.split("\n")) if m)
        new, found = render(text, root, document=document)
        problems += found
        if new != text:
            if check:
                old_tables = _tables_of(text)
                new_tables = _tables_of(new)
                changed = sorted(n for n in new_tables if old_tables.get(n) != new_tables[n])
                problems.append(f"{document}: tables differ from their records: {', '.join(changed)} "
                                f"(run `{COMMAND}`)")
            else:
                path.write_text(new, encoding="utf-8")
    problems += [f"table {name!r} of {doc} is marked in no document" for name, (doc, _) in TABLES.items()
                 if name not in seen]
    return problems


def _tables_of(text: str) -> dict[str, str]:
    found, lines = {}, text.split("\n")
    for i, line in enumerate(lines):
        m = _BEGIN.match(line)
        if m and _END.format(name=m["name"]) in lines[i:]:
            found[m["name"]] = "\n".join(lines[i + 1:lines.index(_END.format(name=m["name"]), i)])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bayeslayer.results", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tables", help="regenerate the marked results tables of README.md and docs/ from results/")
    t.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table differs from its records")
    t.add_argument("--root", default=".", help="the checkout's root (default: the current folder)")
    args = parser.parse_args(argv)
    try:
        problems = regenerate(args.root, check=args.check)
    except (OSError, ValueError, KeyError) as err:
        print(f"python -m bayeslayer.results: {err}", file=sys.stderr)
        return 2
    for p in problems:
        print(p, file=sys.stderr)
    if not problems and not args.check:
        print(f"regenerated {len(TABLES)} tables")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
