"""Results tables of the docs, generated from the committed records: ``python tools/build_tables.py tables``.

Every table of results in ``README.md`` and ``docs/*.md`` that comes from a record under ``results/``
sits between two markers naming its generator::

    <!-- results-table NAME: python tools/build_tables.py tables -->
    | ... the table ... |
    <!-- /results-table NAME -->

``tables`` rewrites what lies between the markers from the JSON records (:data:`TABLES`); ``tables
--check`` rewrites nothing and exits 1, naming each table, when a document differs from what the
records give (byte for byte) or holds a marker this module does not know.  The test suite runs the
check, so a number edited by hand, or a record changed without regenerating its table, fails.

A number quoted in running text is marked the same way, inline, and generated from its record by
:data:`VALUES` (the same command regenerates and checks it)::

    took <!-- value collision-seconds -->32.8–33.4 s<!-- /value --> on an idle CPU

The records under ``results/`` and the documents are not part of the installed package, so this script
runs from a checkout (``--root``, default the current folder) with ``bayeslayer`` installed.

A table of an experiment's own record is laid out by the experiment, beside its figure: ``recall.table(record,
curve)``, ``mqar.table(records, head, xs, x_labels)``, ``collision.steps_table(record)``, ``lm.table(records)``,
``variance.table(record)`` and the rest (:data:`TABLES` names each); this script only finds the committed records,
calls the experiment's function (:func:`_on`) and splices the Markdown it returns into the documents.  The tables
kept here are those of no one experiment's record: the benchmarks' records and logs (GPU times, SASS census, cost
model, threads, FLOPs, compile times, sharded memory, the test suite's slowest tests, the MQAR diagnostics) and
the equal-compute verdict, which reads the recall, MQAR and LM records side by side and whose choice of records is
the docs' own.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from bayeslayer.experiments import collision, crowding, distill, heldout, lm, mqar, recall, variance
from bayeslayer.experiments.common.tables import markdown_row as _row
from bayeslayer.experiments.common.tables import mean_std as _pm
from bayeslayer.experiments.common.tables import minus as _minus

#: The documents that may hold generated tables, relative to the checkout's root.
DOCUMENTS = ("README.md", "docs/experiments.md", "docs/kernels.md", "docs/data.md", "docs/layers.md",
             "docs/models.md", "docs/reliability.md", "docs/distributed.md")
COMMAND = "python tools/build_tables.py tables"
_BEGIN = re.compile(r"^<!-- results-table (?P<name>[a-z0-9-]+): python tools/build_tables\.py tables -->$")
_END = "<!-- /results-table {name} -->"


def _load(root: Path, rel: str) -> dict:
    path = root / rel
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"the table needs the record {rel}, which is missing under {root}") from None


def _load_text(root: Path, rel: str) -> str:
    """A record that is a text file (a benchmark's log or printed table)."""
    try:
        return (root / rel).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"the table needs the record {rel}, which is missing under {root}") from None


# --------------------------------------------------------------------------- an experiment's own records

def _on(render: Callable[..., str], *sources: str | tuple[str, ...], **options) -> Callable[[Path], str]:
    """The generator of a table an experiment lays out: ``render(*records, **options)``, each source a record's
    path (the record read from its JSON) or a tuple of paths (a list of records, one table of several runs)."""

    def build(root: Path) -> str:
        return render(*(_load(root, s) if isinstance(s, str) else [_load(root, r) for r in s] for s in sources),
                      **options)

    return build


_UPDATES = {"xs": (0, 4, 8, 12, 16), "x_labels": ("u = 0", "4", "8", "12", "16")}
_PAIRS = {"xs": (2, 8, 10, 12, 14, 16), "x_labels": ("2 pairs", "8", "10", "12", "14", "16")}
_WIDTHS = {"xs": (16, 32, 64), "x_labels": ("width 16", "32", "64"), "val_label": "val (64)", "train_seconds": False}
#: the Mamba-2 runs of MQAR Update at other learning rates and budgets, one row each
_MAMBA2_ROWS = ("results/mqar/mamba2_lr/lr1e-3/mqar_update_hybrid.json",
                "results/mqar/mamba2_lr/lr3e-3/mqar_update_hybrid.json", "results/mqar/layouts/mqar_update_hybrid.json",
                "results/mqar/mamba2_lr/lr3e-2/mqar_update_hybrid.json",
                "results/mqar/mamba2_budget/mqar_update_hybrid.json", "results/mqar/layouts/mqar_update.json",
                "results/mqar/mamba2_budget/mqar_update.json")
_MQAR_LAYOUTS = "results/mqar/layouts/mqar_{task}{suffix}.json"
_RECALL, _RECALL_LONG = "results/recall/recall.json", "results/recall/long/recall.json"
_RECALL_PAPER_LONG = "results/recall/paper-core/long/recall.json"
_CROWDING = "results/crowding/crowding.json"
_COLLISION, _COLLISION_LOWRANK = "results/collision/collision.json", "results/collision/collision_lowrank.json"
_MQAR_SUFFIX = {"stacked": "", "hybrid": "_hybrid"}


def mqar_mamba2_table(root: Path) -> str:
    return mqar.mixer_rows_table([(_load(root, rel), "mamba2") for rel in _MAMBA2_ROWS], **_UPDATES)


def mqar_claims_table(root: Path) -> str:
    records = {(task, layout): _load(root, _MQAR_LAYOUTS.format(task=task, suffix=suffix))
               for task in ("update", "block") for layout, suffix in _MQAR_SUFFIX.items()}
    budget = {layout: _load(root, f"results/mqar/mamba2_budget/mqar_update{suffix}.json")
              for layout, suffix in _MQAR_SUFFIX.items()}
    return mqar.claims_table(records, budget)


# --------------------------------------------------------------------------- equal compute: who leads

# Each task of the equal-compute comparison (``--compute-match steps|flops|time``): the score, whether higher is
# better, the models in table order, and per budget the records that hold each model's seeds.  At equal steps
# the preset's own runs are used; the Bayesian Layer's run *is* the reference of the FLOP and time budgets, so its
# row is the same run at every budget where no separate record names it.
_RECALL_STEPS = {"bayesian": "results/recall/recall.json", "delta": "results/recall/recall.json",
                 "gated_deltanet": "results/recall/steps_gdn/recall.json"}
_MQAR_MODELS = ("bayesian", "gated_deltanet", "gated_deltanet_noconv")
_LM_MODELS = ("BL", "GDN (state-matched)")
COMPUTE_VERDICT_TASKS = (
    {"task": "recall, n_f sweep", "score": "accuracy, mean over n_f", "higher": True, "kind": "recall",
     "key": "accuracy_vs_n_f", "models": ("bayesian", "delta", "gated_deltanet"),
     "records": {"steps": _RECALL_STEPS, "flops": "results/recall/flops/recall.json",
                 "time": "results/recall/time/recall.json"}},
    {"task": "recall, ρ sweep", "score": "accuracy, mean over ρ", "higher": True, "kind": "recall",
     "key": "accuracy_vs_rho", "models": ("bayesian", "delta", "gated_deltanet"),
     "records": {"steps": _RECALL_STEPS, "flops": "results/recall/flops/recall.json",
                 "time": "results/recall/time/recall.json"}},
    {"task": "MQAR Update (hybrid)", "score": "accuracy, mean over updates", "higher": True, "kind": "mqar",
     "key": "accuracy", "models": _MQAR_MODELS,
     "records": {"steps": "results/mqar/layouts/mqar_update_hybrid.json",
                 "flops": "results/mqar/flops/mqar_update_hybrid.json",
                 "time": "results/mqar/time/mqar_update_hybrid.json"}},
    {"task": "LM (cpu preset), test", "score": "perplexity, all tokens", "higher": False, "kind": "lm",
     "key": "all", "models": _LM_MODELS,
     "records": {"steps": {"BL": "results/lm/cpu_test.json", "GDN (state-matched)": "results/lm/cpu_state_test.json"},
                 "flops": {"BL": "results/lm/cpu_test.json",
                           "GDN (state-matched)": "results/lm/cpu_state_flops_test.json"}}},
    {"task": "LM (cpu preset), test", "score": "perplexity, AR-hit tokens", "higher": False, "kind": "lm",
     "key": "ar_hit", "models": _LM_MODELS,
     "records": {"steps": {"BL": "results/lm/cpu_test.json", "GDN (state-matched)": "results/lm/cpu_state_test.json"},
                 "flops": {"BL": "results/lm/cpu_test.json",
                           "GDN (state-matched)": "results/lm/cpu_state_flops_test.json"}}},
)


def _verdict_seeds(record: dict, spec: dict, model: str) -> tuple[str, list[float]] | None:
    """A model's label and its per-seed scores in ``record`` (None when the record does not hold the model)."""
    kind, key = spec["kind"], spec["key"]
    if kind == "lm":
        entry = record["models"].get(model)
        return None if entry is None else (model, [s["groups"][key]["ppl"] for s in entry["seeds"]])
    entry = record["models"].get(model)
    if entry is None:
        return None
    if kind == "recall":
        return entry["label"], [sum(s[key]) / len(s[key]) for s in entry["seeds"]]
    (run,) = entry["runs"]  # one learning rate and width per model in these records
    return entry["label"], [sum(t[key] for t in s["test"]) / len(s["test"]) for s in run["seeds"]]


def _verdict_cells(root: Path, spec: dict, budget: str) -> dict[str, tuple[str, list[float]] | None]:
    source = spec["records"].get(budget)
    out = {}
    for model in spec["models"]:
        rel = source if isinstance(source, str) or source is None else source.get(model)
        if rel is None or not (root / rel).exists():
            out[model] = None
            continue
        out[model] = _verdict_seeds(_load(root, rel), spec, model)
    return out


def compute_verdict_table(root: Path) -> str:
    """Per task and budget (equal steps, FLOPs, CPU time): each model's score as mean ± std over its seeds, the
    leader and its lead over the runner-up, and the Bayesian Layer's margin over the best other model (positive:
    BL better), whose sign says whether BL leads at that budget.  A lead smaller than the larger of the two seed
    spreads is called a tie; a budget whose runs are not recorded yet says so instead of a number."""
    lines = [_row(["task", "score", "budget", "models (mean ± std over seeds)", "leader", "lead (spread)",
                   "BL − best other"]), "|---|---|---|---|---|---|---:|"]
    for spec in COMPUTE_VERDICT_TASKS:
        for budget in ("steps", "flops", "time"):
            if budget not in spec["records"]:
                continue
            cells = _verdict_cells(root, spec, budget)
            done = {m: c for m, c in cells.items() if c is not None}
            parts, stats, digits = [], {}, 1 if spec["kind"] == "lm" else 3
            for model in spec["models"]:
                c = cells[model]
                if c is None:
                    parts.append(f"{model}: not run")
                    continue
                label, values = c
                mean = sum(values) / len(values)
                std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
                stats[label] = (mean, std, len(values))
                parts.append(f"{label} {_pm(mean, std, digits)} (n={len(values)})")
            if len(done) < len(spec["models"]):
                leader, lead, margin = "not all run", "", ""
            else:
                order = sorted(stats, key=lambda k: stats[k][0], reverse=spec["higher"])
                (m1, s1, _), (m2, s2, _) = stats[order[0]], stats[order[1]]
                gap = abs(m1 - m2)
                leader = order[0] if gap > max(s1, s2) else f"tie: {order[0]} ≈ {order[1]}"
                lead = f"{gap:.{digits}f} ({max(s1, s2):.{digits}f})"
                bl = done[spec["models"][0]][0]  # the Bayesian Layer is each task's first model
                best_other = max(stats[k][0] * (1 if spec["higher"] else -1) for k in stats if k != bl)
                margin = _minus(f"{stats[bl][0] * (1 if spec['higher'] else -1) - best_other:+.{digits}f}")
            lines.append(_row([spec["task"], spec["score"], budget, "; ".join(parts), leader, lead, margin]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- kernels: precision of the scan, GPU times

def _e1(value: float) -> str:
    """``3.3e-7``: one decimal, the exponent without its leading zero."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


_HANDOFF_ROWS = (("A f64 hand-off, C ieee (before)", "float64, IEEE (before)"),
                 ("A fp32 hand-off, C ieee", "**fp32, IEEE (now)**"),
                 ("A bf16 hand-off, C ieee (control)", "bf16 (control)"),
                 ("A fp32 hand-off, C 3xtf32", "fp32, **3xTF32**"),
                 ("A fp32 hand-off, C bf16x3", "fp32, bf16x3"),
                 ("A fp32 hand-off, C tf32", "fp32, TF32"))


def scan_precision_table(root: Path) -> str:
    """Max relative error of β / of the final P per hand-off precision and regime (``benchmarks/scan_precision.py``)."""
    rec = _load(root, "results/gpu/scan_precision.json")
    regimes = (("typical", "typical"), ("longmem", "long-memory"), ("stress", "stress"))
    cell = {(r["variant"], r["regime"]): f"{_e1(r['beta'])} / {_e1(r['P_T'])}" for r in rec["rows"]}
    lines = [_row(["Phase A hand-off, Phase C products", *(label for _, label in regimes)]), "|---|---|---|---|"]
    lines += [_row([label, *(cell[variant, regime] for regime, _ in regimes)]) for variant, label in _HANDOFF_ROWS]
    return "\n".join(lines)


_H200 = "results/gpu/2026-11-30_h200_{}"


def _h200_log_rows(root: Path) -> dict:
    """The T = 2048 rows of the H200 benchmark's log: BL's measurement (JSON) and GDN's printed row."""
    rows: dict = {}
    for line in _load_text(root, _H200.format("bench_t2048.log")).split("\n"):
        head, _, rest = line.partition("|")
        key = tuple(int(x) for x in head.split()) if head.split() and head.split()[0].isdigit() else None
        if key is None:
            continue
        if rest.strip().startswith("BL measured in"):
            rows.setdefault(key, {})["bl"] = json.loads(rest[rest.index("{"):])
        elif not rest.strip().startswith("GDN measured"):
            cols = [c.split() for c in rest.split("|")]  # fwd | f+b | Mtok/s | GiB, BL then GDN then ratio
            rows.setdefault(key, {})["gdn"] = {"fwd_s": float(cols[0][1]) / 1e3, "fwdbwd_s": float(cols[1][1]) / 1e3,
                                               "fwd_tok_s": float(cols[2][1]) * 1e6,
                                               "fwdbwd_mem": float(cols[3][1]) * 2 ** 30}
    return rows


def h200_table(root: Path) -> str:
    """BL against GDN on one H200: forward and forward+backward times, forward throughput, peak memory."""
    measured = _h200_log_rows(root)
    sources = {64: "bl_vs_gdn_d64.json", 128: "bl_d64_d128.json", 256: "bl_d256.json"}
    for d, name in sources.items():
        for r in _load(root, f"results/gpu/2026-11-30_h200_{name}")["rows"]:
            if r["D"] == d:
                measured[r["T"], d] = {k: r[k] for k in ("bl", "gdn") if k in r}
    lines = [_row(["T", "D", "BL fwd ms", "GDN fwd ms", "ratio", "BL fwd+bwd ms", "GDN fwd+bwd ms", "ratio",
                   "BL fwd Mtok/s", "GDN fwd Mtok/s", "BL GiB", "GDN GiB", "ratio"]), "|" + "---|" * 13]
    for t, d in sorted(measured, key=lambda key: (key[1], key[0])):
        bl, gdn = measured[t, d]["bl"], measured[t, d].get("gdn")
        gib = 2 ** 30
        cells = [str(t), str(d), f"{bl['fwd_s'] * 1e3:.2f}", "—" if gdn is None else f"{gdn['fwd_s'] * 1e3:.2f}",
                 "" if gdn is None else f"{bl['fwd_s'] / gdn['fwd_s']:.1f}", f"{bl['fwdbwd_s'] * 1e3:.1f}",
                 "—" if gdn is None else f"{gdn['fwdbwd_s'] * 1e3:.2f}",
                 "" if gdn is None else f"{bl['fwdbwd_s'] / gdn['fwdbwd_s']:.1f}", f"{bl['fwd_tok_s'] / 1e6:.2f}",
                 "—" if gdn is None else f"{gdn['fwd_tok_s'] / 1e6:.3g}", f"{bl['fwdbwd_mem'] / gib:.2f}",
                 "—" if gdn is None else f"{gdn['fwdbwd_mem'] / gib:.2f}",
                 "" if gdn is None else f"{bl['fwdbwd_mem'] / gdn['fwdbwd_mem']:.1f}"]
        lines.append(_row(cells))
    return "\n".join(lines)


def cost_model_table(root: Path) -> str:
    """The cost model's predicted BL-vs-GDN rows (``benchmarks/cost_model.py --json --out``): ms and ratios."""
    rec = _load(root, "results/cost_model/default_rows_sm90_triton3.6.json")
    lines = [_row(["B·H", "D", "T", "GDN fwd ms", "BL fwd ms", "fwd ratio", "GDN fwd+bwd ms", "BL fwd+bwd ms",
                   "fwd+bwd ratio", "GDN fwd+bwd peak GiB", "BL fwd+bwd peak GiB", "peak memory ratio fwd / fwd+bwd"]),
             "|" + "---|" * 12]
    for r in rec["rows"]:
        lines.append(_row([str(r["BH"]), str(r["D"]), str(r["T"]), f"{r['gdn_fwd_ms']:.2f}", f"{r['bl_fwd_ms']:.2f}",
                           f"{r['fwd_ratio']:.1f}", f"{r['gdn_fwdbwd_ms']:.2f}", f"{r['bl_fwdbwd_ms']:.1f}",
                           f"{r['fwd_bwd_ratio']:.1f}", f"{r['gdn_fwdbwd_peak_gib']:.2f}",
                           f"{r['bl_fwdbwd_peak_gib']:.2f}",
                           f"{r['fwd_memory_ratio']:.2f} / {r['fwd_bwd_memory_ratio']:.2f}"]))
    return "\n".join(lines)


def crossover_table(root: Path) -> str:
    """The chain-or-scan figures (``benchmarks/cost_model.py --crossover --out``): per head dim, each covariance
    kernel's predicted step (µs at the model's clock; tokens per step), the reverse chain's and fla's ``fwd_h``
    step beside them, and the largest chain counts at which the scan is predicted faster."""
    rec = _load(root, "results/cost_model/crossover_sm90_triton3.6.json")
    clock = _load(root, "results/cost_model/default_rows_sm90_triton3.6.json")["clock_hz"]  # the model's SM clock
    Ts = sorted({int(T) for by_T in rec["crossover_chains"].values() for T in by_T})
    lines = [_row(["D", "chain step µs (C = {})".format(rec["chunks"]["chain"]), "reverse chain step µs",
                   "fla fwd_h step µs (C = 64)",
                   "scan steps µs (C = {}): Phase A, tracking, Phase B, Phase C".format(rec["chunks"]["scan"]),
                   "chain registers / spill B / tensor-core ops",
                   *[f"scan faster up to (chains), T = {T}" for T in Ts]]),
             "|" + "---|" * (6 + len(Ts))]
    for D, f in sorted(rec["figures"].items(), key=lambda kv: int(kv[0])):
        k = rec["chain_kernel"][D]
        us = {r: f"{c / clock * 1e6:.1f}" for r, (c, _) in f.items()}
        lines.append(_row([D, us["chain"], f"{k['backward_step_us']:.1f}", f"{k['gdn_fwd_h_step_us']:.1f}",
                           ", ".join(us[r] for r in ("a", "track", "b", "c")),
                           f"{k['registers']} / {k['spill_bytes']} / {k['sass_tensor_core']}",
                           *[str(rec["crossover_chains"][D][str(T)]) for T in Ts]]))
    return "\n".join(lines)


def default_path_census_table(root: Path) -> str:
    """Every kernel the default path launches, compiled for sm_90 on Triton 3.6 and the newest Triton
    (``benchmarks/gpu.py --compile-only --default-path``); identical rows once."""
    lines = [_row(["Triton", "D", "kernel", "role", "phase", "warps", "registers", "spill B", "shared KiB",
                   "tensor core", "FFMA"]), "|" + "---|" * 11]
    seen = set()
    for name in ("default_path_sm90_triton3.6.json", "default_path_sm90_triton3.9.json"):
        for r in _load(root, f"results/sass/{name}")["rows"]:
            cells = [r["triton"], str(r["D"]), f"`{r['kernel']}`", r["role"], "+".join(r["phases"]),
                     str(r["num_warps"]), str(r.get("registers", "—")), str(r.get("spill_bytes", "—")),
                     "—" if r.get("shared_bytes") is None else f"{r['shared_bytes'] / 1024:.0f}",
                     str(r.get("sass_tensor_core", r.get("error", "—"))), str(r.get("sass_FFMA", "—"))]
            if tuple(cells) not in seen:
                seen.add(tuple(cells))
                lines.append(_row(cells))
    return "\n".join(lines)


_SASS_LABELS = (("mean", "`bl_chunk_mean_kernel` fp32"), ("track64", "`scan_track_kernel` fp64 (Phase A)"),
                ("prep", "`bl_chunk_prep_kernel` fp32"), ("prep64", "`bl_chunk_prep_kernel` fp64"),
                ("covp", "`bl_chunk_cov_kernel` fp32 + prep (Phase C)"),
                ("covp64", "`bl_chunk_cov_kernel` fp64 + prep (Phase A)"),
                ("phaseb64", "`scan_phase_b_kernel` fp64 (Phase B)"),
                ("segadj", "`scan_segment_adjoint_kernel` fp32 (B2)"),
                ("segadj4", "`scan_segment_adjoint_kernel` fp32 (B4)"), ("rev64", "`scan_reverse_kernel` fp64 (B3)"))


def sass_census_table(root: Path) -> str:
    """Registers, spills and static SASS instruction counts per kernel (``benchmarks/gpu.py --compile-only``)."""
    rec = _load(root, "results/sass/sm90_c64_d64_census.json")
    lines = [_row(["kernel", "decay", "warps", "registers", "spill B", "tensor core", "FFMA", "DFMA", "FMUL+FADD",
                   "DMUL+DADD", "all"]), "|" + "---|" * 11]
    for kernel, label in _SASS_LABELS:
        for r in rec["rows"]:
            if r["kernel"] != kernel or r["checkpoints"]:
                continue
            ops = ", ".join(f"{k} {v}" for k, v in r["sass_tensor_core_ops"].items())
            tensor = f"{r['sass_tensor_core']}" + (f" ({ops})" if ops else "")
            lines.append(_row([label, "diagonal" if r["diagonal"] else "scalar", str(r["num_warps"]),
                               str(r["registers"]), str(r["spill_bytes"]), tensor,
                               *(str(r[f"sass_{k}"]) for k in ("FFMA", "DFMA", "FMUL_FADD", "DMUL_DADD", "total"))]))
    return "\n".join(lines)


def chain_precision_table(root: Path) -> str:
    """Error against float64 of the segment scan and of the covariance chain per arithmetic
    (``benchmarks/chain_precision.py``): max over o, variance, M, P / max over every input's gradient, the worst of
    the record's seeds; and in how many (quantity, seed) pairs the chain's default is at or below the scan."""
    rec = _load(root, "results/gpu/chain_precision.json")
    outs, grads = ("o", "variance", "M", "P"), ("dq", "dk", "dv", "dr2", "dell2", "dalpha", "dM0", "dP0")
    names = {"float64": "float64", "tf32x3": "tf32x3", "bf16x3": "bf16x3", "ieee": "IEEE"}
    precs = [p for p in names if any(r["path"] == "chain" and r["prec"] == p for r in rec["rows"])]
    lines = [_row(["regime", "decay", "inputs", "scan (IEEE)", *(f"chain {names[p]}" for p in precs),
                   "default ≤ scan"]), "|" + "---|" * (5 + len(precs))]
    worst: dict = {}
    by_seed: dict = {}
    defaults: dict = {}
    for r in rec["rows"]:
        key = (r["regime"], r["decay"], r["dtype"])
        col = "scan" if r["path"] == "scan" else r["prec"]
        w = worst.setdefault(key, {}).setdefault(col, [0.0, 0.0])
        w[0] = max(w[0], max(r[n] for n in outs))
        w[1] = max(w[1], max(r[n] for n in grads if n in r))
        by_seed.setdefault(key, {}).setdefault(r.get("seed"), {})[col] = r
        if r.get("default"):
            defaults[key] = col
    regimes = {"longmem": "long-memory", "stress": "stress"}
    for key, c in worst.items():
        regime, decay, dtype = key
        cells = []
        for p in ("scan", *precs):
            cell = f"{_e1(c[p][0])} / {_e1(c[p][1])}" if p in c else "—"
            cells.append(f"**{cell}**" if p == defaults.get(key) else cell)
        pairs = [(s[defaults[key]][n], s["scan"][n]) for s in by_seed[key].values() if "scan" in s
                 for n in (*outs, *grads) if n in s["scan"]] if key in defaults else []
        held = f"{sum(a <= b for a, b in pairs)}/{len(pairs)}" if pairs else "—"
        lines.append(_row([regimes.get(regime, regime), decay, dtype, *cells, held]))
    return "\n".join(lines)


def chain_compile_table(root: Path) -> str:
    """Registers, spills, shared memory and tensor-core instructions of the chain kernels compiled for sm_90 by
    two Triton versions as bf16 inputs launch them (``benchmarks/gpu.py --compile-only --kernels chain chainb``),
    and by the newest as fp32 inputs launch them (``--kernels chain64 chainb64``: float64 arithmetic)."""
    lines = [_row(["Triton", "kernel", "D", "decay", "registers", "spill B", "shared KiB", "tensor core"]),
             "|---|---|---|---|---|---|---|---|"]
    names = {"chain": "forward", "chainb": "backward", "chain64": "forward, float64", "chainb64": "backward, float64"}
    for version, rel in (("3.9", "chain_compile_sm90_triton3.9"), ("3.6", "chain_compile_sm90_triton3.6"),
                         ("3.9", "chain64_compile_sm90_triton3.9")):
        rec = _load(root, f"results/sass/{rel}.json")
        for r in rec["rows"]:
            if "error" in r:
                lines.append(_row([version, names[r["kernel"]], str(r["D"]), "diagonal" if r["diagonal"] else
                                   "scalar", "failed", "", "", r["error"][:60]]))
                continue
            ops = ", ".join(f"{k} {v}" for k, v in r["sass_tensor_core_ops"].items())
            lines.append(_row([version, names[r["kernel"]], str(r["D"]), "diagonal" if r["diagonal"] else "scalar",
                               str(r["registers"]), str(r["spill_bytes"]), f"{r['shared_bytes'] / 1024:.0f}",
                               f"{r['sass_tensor_core']} ({ops})"]))
    return "\n".join(lines)


def _scan_compile_label(row: dict) -> str:
    decay = "diagonal" if row["diagonal"] else "scalar"
    if row["variant"].startswith("phase_a"):
        return f"Phase A, {decay}" + ("" if row["diagonal"] else " (float64 state, fp32 hand-off and prep)")
    precision = "IEEE (default)" if row["precision"] == "ieee" else row["precision"]
    return f"Phase C, {decay}, {precision}"


def scan_compile_table(root: Path) -> str:
    """Registers / stack / shared and SASS census of the scan's covariance kernel (``benchmarks/scan_compile.py``)."""
    rec = _load(root, "results/gpu/scan_compile_sm90.json")
    lines = [_row(["variant", "registers / stack / shared", "HMMA", "HGMMA", "DMMA", "FFMA", "DFMA"]),
             "|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        lines.append(_row([_scan_compile_label(r), f"{r['registers']} / {r['stack_bytes']} / {r['shared_bytes']}",
                           *(str(r[f"sass_{k}"]) for k in ("HMMA", "HGMMA", "DMMA", "FFMA", "DFMA"))]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- MQAR stacked-Update diagnostics

#: the diagnostic runs of ``benchmarks/mqar_diagnostics.py`` shown in the docs, in table order
MQAR_DIAGNOSTICS = ("bl_default_400", "gdn_default_400", "gdn_blheads_400", "gdn_blheads_full", "gdn_h2d32m64_400",
                    "gdn_h2d32m64_full", "bl_gdnheads_400", "bl_ell2-1_400", "bl_ell2-1_full", "bl_alpha0.99_400",
                    "bl_lr3e-2_400", "bl_lr3e-3_400")


def mqar_diagnostics_table(root: Path) -> str:
    """Per diagnostic run: head shape, changed settings, final loss, probe accuracy, test accuracy at 16 updates
    (runs evaluated on the test set only) and the second layer's decay and gain at the end (median over the
    probe's tokens)."""
    lines = [_row(["mixer", "heads H × (D, m)", "state / layer", "changed", "lr", "steps", "loss (last 50)",
                   "probe acc.", "test u = 16", "layer 2 α", "layer 2 gain", "train s"]), "|---" * 12 + "|"]
    for name in MQAR_DIAGNOSTICS:
        rel = f"results/mqar/stacked_bl/diag_{name}.json"
        if not (root / rel).exists():
            continue
        r = _load(root, rel)
        kw = r["mixer_kwargs"]
        H, D = kw["num_heads"], kw["head_dim"]
        m = round(D * kw["expand_v"])
        state = H * (D * m + D * D) if r["mixer"] == "bayesian" else H * D * m
        changed = ", ".join(f"{k} = {v}" for k, v in r["overrides"].items()
                            if k not in ("num_heads", "head_dim", "expand_v")) or "—"
        loss = r["log"]["loss"][-50:]
        end = r["probes"][-1]
        last = end["layers"][-1]
        test = next((f"{t['accuracy']:.3f}" for t in r.get("test") or () if t["x"] == 16), "—")
        lines.append(_row([{"bayesian": "BL", "gated_deltanet": "GDN"}.get(r["mixer"], r["mixer"]),
                           f"{H} × ({D}, {m})", f"{state:,}", changed, f"{r['lr']:g}", str(r["steps"]),
                           f"{sum(loss) / len(loss):.3f}", f"{end['probe_accuracy']:.3f}", test,
                           f"{last['alpha']['p50']:.3f}", f"{last['gain']['p50']:.3f}",
                           f"{r['train_seconds']:.0f}"]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- CPU threads

def flops_mixers_table(root: Path) -> str:
    """FLOPs per token of a training step per mixer (``benchmarks/flops.py``): counted, the filter's share, the
    ratio to GDN, and the measurement (``FlopCounterMode``) and the uncounted elementwise work against the count."""
    rec = _load(root, "results/flops/mixers.json")
    gdn = next(r for r in rec["rows"] if r["mixer"] == "gated_deltanet" and not r["kwargs"])
    gdn_per_token = gdn["count"]["total"] / gdn["seq_len"]
    lines = [f"hidden {rec['hidden']}, {rec['heads']} heads, head dim {rec['head_dim']}, batch 1, T = "
             f"{gdn['seq_len']:,} (chunks of {gdn['chunk_size']}); MFLOP per token of one training step",
             "",
             _row(["mixer", "forward", "backward", "total", "of it the filter", "× GDN", "measured / counted",
                   "elementwise, % of counted"]),
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rec["rows"]:
        T, c = r["seq_len"], r["count"]
        label = r["label"] + (f" (T = {T})" if T != gdn["seq_len"] else "")
        core = "—" if r["filter"] is None else f"{r['filter']['total'] / T / 1e6:.2f}"
        lines.append(_row([label, f"{c['forward'] / T / 1e6:.2f}", f"{c['backward'] / T / 1e6:.2f}",
                           f"{c['total'] / T / 1e6:.2f}", core, f"{c['total'] / T / gdn_per_token:.2f}",
                           f"{r['measured']['total'] / c['total']:.3f}",
                           f"{100 * r['elementwise']['total'] / c['total']:.1f}"]))
    return "\n".join(lines)


def threads_table(root: Path) -> str:
    """``benchmarks/threads.py --out``: each workload's median wall time at its default (one thread) and at
    PyTorch's default, idle and beside a CPU-bound process, with the 1-minute load average at each run's start."""
    rec = _load(root, "results/threads/threads.json")
    lines = [_row(["workload", "condition", "default, 1 thread (s)",
                   f"PyTorch default, {rec['pytorch_default_threads']} threads (s)", "ratio",
                   "runs (default / PyTorch default, s)", "load at start"]), "|---|---|---:|---:|---:|---|---|"]
    for r in rec["rows"]:
        runs = " / ".join(", ".join(f"{t:.1f}" for t in r["runs_s"][k]) for k in ("default", "PyTorch default"))
        lines.append(_row([r["workload"], r["condition"], f"{r['default_s']:.2f}", f"{r['pytorch_default_s']:.2f}",
                           f"{r['ratio']:.2f}", runs, f"{r['load_min']:.1f}–{r['load_max']:.1f}"]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- distributed training's memory

_SHARDING_RECORD = "results/distributed/sharding_memory.json"


def sharding_measured_table(root: Path) -> str:
    """``benchmarks/sharding_memory.py``: bytes per rank (the largest rank) of parameters, gradients and AdamW
    state after one step, DDP and FSDP2 at each number of ranks, and the total as a share of DDP's."""
    rec = _load(root, _SHARDING_RECORD)
    lines = [_row(["ranks", "engine", "parameters (MB)", "gradients (MB)", "AdamW state (MB)", "total (MB)",
                   "of DDP's"]), "|---:|---|---:|---:|---:|---:|---:|"]
    ddp = {r["ranks"]: sum(r["max"].values()) for r in rec["measured"] if r["shard"] == "none"}
    for r in rec["measured"]:
        m, total = r["max"], sum(r["max"].values())
        lines.append(_row([str(r["ranks"]), "DDP" if r["shard"] == "none" else "FSDP2",
                           *(f"{m[k] / 1e6:.2f}" for k in ("parameters", "gradients", "optimizer")),
                           f"{total / 1e6:.2f}", f"{total / ddp[r['ranks']]:.3f}"]))
    return "\n".join(lines)


def sharding_formula_table(root: Path) -> str:
    """The formula (16 bytes per fp32 parameter with AdamW, over N ranks for FSDP2) for the record's large models,
    GB per rank, with the largest block FSDP gathers at a time."""
    rec = _load(root, _SHARDING_RECORD)
    ranks = rec["config"]["ranks"]
    lines = [_row(["model", "width × layers", "parameters", "DDP (GB)", *(f"FSDP2 × {n} (GB)" for n in ranks),
                   "largest gathered unit, fp32 (GB)"]), "|---|---|---:|---:|" + "---:|" * len(ranks) + "---:|"]
    for f in rec["formula"]:
        lines.append(_row([f["model"], f"{f['hidden_size']} × {f['layers']}", f"{f['parameters'] / 1e9:.2f} B",
                           f"{f['ddp'] / 1e9:.2f}", *(f"{f['fsdp'][str(n)] / 1e9:.2f}" for n in ranks),
                           f"{f['gathered_unit_fp32'] / 1e9:.2f}"]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- torch.compile on the CPU

def compile_table(root: Path) -> str:
    """``benchmarks/compile.py --out``: per workload, CPU milliseconds of eager mode (value checks on, then off) and
    of the compiled function, the speed-up, and the CPU (and wall) seconds of the first compiled call from a cold
    cache, with the sizes and the 1-minute load average while it ran."""
    rec = _load(root, "results/compile/cpu.json")
    z = rec["sizes"]
    size = f"hidden {z['hidden']}, {z['num_heads']} heads of {z['head_dim']}, B = {z['batch']}, T = {z['length']}"
    lines = [_row(["workload", "eager (ms)", "eager, checks off (ms)", "compiled (ms)", "speed-up",
                   "first compiled call: CPU s (wall s)", "load at start, end"]), "|---|---:|---:|---:|---:|---:|---|"]
    for r in rec["rows"]:
        lines.append(_row([f"{r['workload']} ({size})", f"{r['eager_cpu_s'] * 1e3:.1f}",
                           f"{r['eager_checks_off_cpu_s'] * 1e3:.1f}", f"{r['compiled_cpu_s'] * 1e3:.1f}",
                           f"{r['speedup_cpu']:.2f}×",
                           f"{r['first_compiled_call_cpu_s']:.0f} ({r['first_compiled_call_s']:.0f})",
                           f"{r['load_start']:.1f}, {r['load_end']:.1f}"]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the test suite's cost

def slowest_tests_table(root: Path) -> str:
    """The slowest tests of the default suite before its split into default and ``slow``, and where each went."""
    rec = _load(root, "results/tests/slowest_before_split.json")
    lines = [_row(["test", "time (s)", "load", "where it went"]), "|---|---:|---:|---|"]
    for r in rec["rows"]:
        lines.append(_row([f"`{r['test']}`", f"{r['seconds']:.1f}", f"{r['load']:.1f}", r["where"]]))
    return "\n".join(lines)


def slowest_now_table(root: Path) -> str:
    """The slowest tests of a later run (``benchmarks/slowest_tests.py``), and whether each is in the default run."""
    rec = _load(root, "results/tests/slowest_second_split.json")
    lines = [_row(["test", "time (s)", "now", "why"]), "|---|---:|---|---|"]
    for r in rec["rows"]:
        lines.append(_row([f"`{r['test']}`", f"{r['seconds']:.1f}", r["where"], r["note"]]))
    return "\n".join(lines)


def slowest_default_table(root: Path) -> str:
    """The slowest tests of the default suite as it is now (a fresh clone's run), and why each stays."""
    rec = _load(root, "results/tests/slowest_default_now.json")
    lines = [_row(["test", "time (s)", "why it stays"]), "|---|---:|---|"]
    for r in rec["rows"]:
        if r["where"] != "default":
            raise ValueError(f"results/tests/slowest_default_now.json: {r['test']} is not in the default suite")
        lines.append(_row([f"`{r['test']}`", f"{r['seconds']:.1f}", r["note"].removeprefix("stays: ")]))
    return "\n".join(lines)


#: name -> (document, generator).  A generator reads records under the root and returns the table's lines; an
#: experiment's own record is laid out by the experiment (:func:`_on`).
TABLES: dict[str, tuple[str, Callable[[Path], str]]] = {
    "sharding-memory": ("docs/distributed.md", sharding_measured_table),
    "sharding-memory-formula": ("docs/distributed.md", sharding_formula_table),
    "tests-slowest": ("docs/reliability.md", slowest_tests_table),
    "tests-slowest-now": ("docs/reliability.md", slowest_now_table),
    "tests-slowest-default": ("docs/reliability.md", slowest_default_table),
    "cpu-threads": ("docs/reliability.md", threads_table),
    "flops-mixers": ("docs/layers.md", flops_mixers_table),
    "compile-cpu": ("README.md", compile_table),
    "collision-steps": ("docs/experiments.md", _on(collision.steps_table, _COLLISION)),
    "collision-fixed-prior": ("docs/experiments.md", _on(collision.fixed_prior_table, _COLLISION)),
    "collision-overlap": ("docs/experiments.md", _on(collision.overlap_table, _COLLISION)),
    "lm-cpu": ("docs/experiments.md", _on(lm.table, "results/lm/cpu_test.json", ours="ours, `cpu`, ",
                                          paper=("BL", "GDN"))),
    "lm-cpu-state": ("docs/experiments.md", _on(
        lm.table, ("results/lm/cpu_test.json", "results/lm/cpu_state_test.json"), ours="ours, `cpu`, ",
        paper=("BL", "GDN"))),
    "lm-cpu60": ("docs/experiments.md", _on(lm.table, "results/lm/cpu60_test.json", ours="ours, ",
                                            paper=("BL", "GDN", "Mamba-2"))),
    "mqar-update-stacked": ("docs/experiments.md", _on(
        mqar.table, "results/mqar/layouts/mqar_update.json", head="stacked", **_UPDATES)),
    "mqar-update-hybrid": ("docs/experiments.md", _on(
        mqar.table, "results/mqar/layouts/mqar_update_hybrid.json", head="hybrid", **_UPDATES)),
    "mqar-update-hybrid4": ("docs/experiments.md", _on(
        mqar.table, ("results/mqar/hybrid4/mqar_update_hybrid.json",
                     "results/mqar/hybrid4_bl_noconv/mqar_update_hybrid.json"), head="hybrid, 4 layers", **_UPDATES)),
    "mqar-block-hybrid4": ("docs/experiments.md", _on(
        mqar.table, ("results/mqar/hybrid4/mqar_block_hybrid.json",
                     "results/mqar/hybrid4_bl_noconv/mqar_block_hybrid.json"), head="hybrid, 4 layers", **_PAIRS)),
    "mqar-block-stacked": ("docs/experiments.md", _on(
        mqar.table, "results/mqar/layouts/mqar_block.json", head="stacked", **_PAIRS)),
    "mqar-block-hybrid": ("docs/experiments.md", _on(
        mqar.table, "results/mqar/layouts/mqar_block_hybrid.json", head="hybrid", **_PAIRS)),
    "mqar-base-stacked": ("docs/experiments.md", _on(
        mqar.table, "results/mqar/layouts/mqar_base.json", head="stacked", **_WIDTHS)),
    "mqar-base-hybrid": ("docs/experiments.md", _on(
        mqar.table, "results/mqar/layouts/mqar_base_hybrid.json", head="hybrid", **_WIDTHS)),
    "mqar-update-gate-off": ("docs/experiments.md", _on(
        mqar.table, "results/mqar/layouts/mqar_update_gate-off.json", head="stacked, gate off", train_seconds=False,
        gate=False, **_UPDATES)),
    "mqar-mamba2-update": ("docs/experiments.md", mqar_mamba2_table),
    "mqar-stacked-diagnostics": ("docs/experiments.md", mqar_diagnostics_table),
    "recall-accuracy-nf": ("docs/experiments.md", _on(recall.table, _RECALL, curve="accuracy_vs_n_f")),
    "recall-margin-rho": ("docs/experiments.md", _on(recall.table, _RECALL, curve="margin_vs_rho")),
    "recall-paper-core": ("docs/experiments.md", _on(
        recall.core_comparison_table, _RECALL, "results/recall/paper-core/recall.json")),
    "recall-paper-core-long": ("docs/experiments.md", _on(
        recall.core_comparison_table, _RECALL_LONG, _RECALL_PAPER_LONG)),
    "crowding-ce": ("docs/experiments.md", _on(crowding.table, _CROWDING, curve="cross_entropy_vs_load")),
    "crowding-accuracy": ("docs/experiments.md", _on(crowding.table, _CROWDING, curve="accuracy_vs_load")),
    "distill-stages": ("docs/experiments.md", _on(distill.table, "results/distill/cpu/distill.json")),
    "distill-heldout": ("docs/experiments.md", _on(heldout.table, "results/distill/cpu/eval/heldout/heldout.json")),
    "variance-auroc": ("docs/experiments.md", _on(variance.table, "results/variance/variance.json")),
    "variance-abstention": ("docs/experiments.md", _on(variance.abstention_table, "results/variance/variance.json")),
    "variance-presets": ("docs/experiments.md", _on(variance.presets_table, "results/variance/presets.json")),
    "compute-verdict": ("docs/experiments.md", compute_verdict_table),
    "collision-closed-form": ("docs/experiments.md", _on(collision.closed_form_table, _COLLISION)),
    "collision-lowrank": ("docs/experiments.md", _on(collision.lowrank_table, _COLLISION_LOWRANK)),
    "collision-pairs": ("docs/experiments.md", _on(collision.pairs_table, _COLLISION_LOWRANK)),
    "recall-lowrank": ("docs/experiments.md", _on(recall.lowrank_table, _RECALL,
                                                  "results/recall/lowrank4/recall.json")),
    "crowding-lowrank": ("docs/experiments.md", _on(crowding.lowrank_table, _CROWDING)),
    "mqar-lowrank": ("docs/experiments.md", _on(mqar.lowrank_table, "results/mqar/layouts/mqar_update_hybrid.json",
                                                "results/mqar/lowrank/mqar_update_hybrid.json")),
    "recall-claims": ("docs/experiments.md", _on(recall.claims_table, _RECALL, _RECALL_LONG)),
    "recall-long": ("docs/experiments.md", _on(recall.long_table, _RECALL, _RECALL_LONG)),
    "recall-long-curves": ("docs/experiments.md", _on(recall.long_curves_table, _RECALL_LONG)),
    "mqar-claims": ("docs/experiments.md", mqar_claims_table),
    "scan-precision": ("docs/kernels.md", scan_precision_table),
    "h200-bl-gdn": ("docs/kernels.md", h200_table),
    "cost-model-rows": ("docs/kernels.md", cost_model_table),
    "sass-census": ("docs/kernels.md", sass_census_table),
    "default-path-census": ("docs/kernels.md", default_path_census_table),
    "cost-model-crossover": ("docs/kernels.md", crossover_table),
    "scan-compile": ("docs/kernels.md", scan_compile_table),
    "chain-precision": ("docs/kernels.md", chain_precision_table),
    "chain-compile": ("docs/kernels.md", chain_compile_table),
}


# --------------------------------------------------------------------------- numbers in running text

_VALUE = re.compile(r"<!-- value (?P<name>[a-z0-9-]+) -->(?P<text>.*?)<!-- /value -->")


def _seconds(value: float) -> str:
    return f"{value:,.0f} s"


def _span(values, fmt: Callable[[float], str]) -> str:
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo.removesuffix(' s')}–{hi}"


def _collision_seconds(root: Path) -> str:
    """The collision command's wall time on an idle CPU, one thread: its runs in ``benchmarks/threads.py``'s record."""
    row = next(r for r in _load(root, "results/threads/threads.json")["rows"]
               if r["workload"] == "collision" and r["condition"] == "idle")
    return _span(row["runs_s"]["default"], lambda x: f"{x:.1f} s")


def _p_ab(model: str) -> Callable[[Path], str]:
    def value(root: Path) -> str:
        return f"{_load(root, 'results/collision/collision.json')['models'][model]['p_ab'][111]:.2g}"
    return value


def _wall_seconds(*rels: str) -> Callable[[Path], str]:
    """The wall time (``provenance.wall_seconds``) of the records ``rels``: one, or the span of several."""
    def value(root: Path) -> str:
        return _span([_load(root, rel)["provenance"]["wall_seconds"] for rel in rels], _seconds)
    return value


def _train_seconds(rel: str, model: str) -> Callable[[Path], str]:
    """Each seed's ``train_seconds`` in a harness record, ``a / b s``."""
    def value(root: Path) -> str:
        seeds = _load(root, rel)["models"][model]["seeds"]
        return " / ".join(f"{s['train_seconds']:,.0f}" for s in seeds) + " s"
    return value


def _curve(rel: str, model: str, key: str) -> Callable[[Path], str]:
    """A learning curve of a harness record (mean over seeds, two decimals), comma-separated."""
    def value(root: Path) -> str:
        curve = _load(root, rel)["models"][model]["summary"]["learning_curve"][key]["mean"]
        return ", ".join(f"{x:.2f}" for x in curve)
    return value


_MAMBA2_LR = tuple(f"results/mqar/mamba2_lr/{lr}/mqar_update_hybrid.json" for lr in ("lr1e-3", "lr3e-3", "lr3e-2"))


def _simulated_phases(root: Path) -> str:
    """Each phase's seconds in the bare-machine simulation's ``line.json``: ``check 167 s, fwd 275 s, ...``."""
    phases = _load(root, "results/simulate_bare_machine/line.json")["phases"]
    return ", ".join(f"{p['phase']} {p['seconds']:,.0f} s" for p in phases)

def _cost_model_ranges(which: str) -> Callable[[Path], str]:
    """The predicted BL/GDN ratios' range over the cost model's rows at B·H = 32 (``which="latency"``) or
    B·H ≥ 128 (``"occupancy"``): ``a–b× GDN's forward and c–d× its forward+backward``."""
    def gen(root: Path) -> str:
        rows = [r for r in _load(root, "results/cost_model/default_rows_sm90_triton3.6.json")["rows"]
                if (r["BH"] == 32) == (which == "latency")]
        f = [r["fwd_ratio"] for r in rows]
        b = [r["fwd_bwd_ratio"] for r in rows]
        return (f"{min(f):.1f}–{max(f):.1f}× GDN's forward and {min(b):.1f}–{max(b):.1f}× its "
                "forward+backward")
    return gen


def _suite_wall(root: Path) -> str:
    """The default suite's wall seconds at the head commit of ``benchmarks/suite_time.py``'s record: ``114 s``."""
    rows = _load(root, "results/tests/suite_time.json")["rows"]
    return f"{next(r for r in rows if r['label'] == 'head')['wall_seconds']:.0f} s"


def _cost_model_memory(root: Path) -> str:
    """The predicted peak-memory ratios' range over the cost model's rows: ``a–b× GDN's in the forward and c–d× in
    the forward+backward``."""
    rows = _load(root, "results/cost_model/default_rows_sm90_triton3.6.json")["rows"]
    f = [r["fwd_memory_ratio"] for r in rows]
    b = [r["fwd_bwd_memory_ratio"] for r in rows]
    return f"{min(f):.2f}–{max(f):.2f}× GDN's in the forward and {min(b):.2f}–{max(b):.2f}× in the forward+backward"


def _cost_model_check(key: str) -> Callable[[Path], str]:
    """The cost model's largest relative error against measured H200 rows (``v1`` or ``gdn``), as its check prints
    it."""
    def gen(root: Path) -> str:
        rec = _load(root, "results/cost_model/default_rows_sm90_triton3.6.json")
        return f"{key} max relative error {rec[f'{key}_max_relative_error']:.3f}"
    return gen


#: Every number of running text generated from a record: name -> (the document that quotes it, its generator).
VALUES: dict[str, tuple[str, Callable[[Path], str]]] = {
    "simulated-phases": ("docs/kernels.md", _simulated_phases),
    "cost-model-latency": ("docs/kernels.md", _cost_model_ranges("latency")),
    "cost-model-v1-error": ("docs/kernels.md", _cost_model_check("v1")),
    "cost-model-gdn-error": ("docs/kernels.md", _cost_model_check("gdn")),
    "cost-model-occupancy": ("docs/kernels.md", _cost_model_ranges("occupancy")),
    "cost-model-memory": ("docs/kernels.md", _cost_model_memory),
    "suite-wall": ("README.md", _suite_wall),
    "collision-seconds": ("docs/experiments.md", _collision_seconds),
    "collision-bl-p-ab": ("README.md", _p_ab("bayesian")),
    "collision-delta-p-ab": ("README.md", _p_ab("reset")),
    "collision-la-p-ab": ("README.md", _p_ab("linear_attention")),
    "mamba2-lr-seconds": ("docs/experiments.md", _wall_seconds(*_MAMBA2_LR)),
    "mamba2-hybrid-2997-seconds": ("docs/experiments.md",
                                   _wall_seconds("results/mqar/mamba2_budget/mqar_update_hybrid.json")),
    "mamba2-stacked-2997-seconds": ("docs/experiments.md",
                                    _wall_seconds("results/mqar/mamba2_budget/mqar_update.json")),
    "recall-paper-long-delta-train": ("docs/experiments.md", _train_seconds(_RECALL_PAPER_LONG, "delta_paper")),
    "recall-paper-long-seconds": ("docs/experiments.md", _wall_seconds(_RECALL_PAPER_LONG)),
    "recall-paper-long-delta-curve": ("docs/experiments.md", _curve(_RECALL_PAPER_LONG, "delta_paper",
                                                                    "accuracy_n_f_256")),
    "recall-paper-long-bl-curve": ("docs/experiments.md", _curve(_RECALL_PAPER_LONG, "bayesian_paper",
                                                                 "accuracy_n_f_256")),
}


def render_values(text: str, root: Path, *, document: str = "") -> tuple[str, list[str]]:
    """``text`` with every marked number of running text regenerated from :data:`VALUES`, and the problems
    found (an unknown name, or one that belongs to another document)."""
    problems: list[str] = []

    def one(match: re.Match) -> str:
        name = match["name"]
        if name not in VALUES:
            problems.append(f"{document}: value {name!r} has no generator in tools/build_tables.py's VALUES")
            return match[0]
        if VALUES[name][0] != document:
            problems.append(f"{document}: value {name!r} belongs to {VALUES[name][0]}")
            return match[0]
        return f"<!-- value {name} -->{VALUES[name][1](root)}<!-- /value -->"

    return _VALUE.sub(one, text), problems


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
            problems.append(f"{document}: table {name!r} has no generator in tools/build_tables.py's TABLES")
            out.extend(lines[i:j])
        elif TABLES[name][0] != document:
            problems.append(f"{document}: table {name!r} belongs to {TABLES[name][0]}")
            out.extend(lines[i:j])
        else:
            out.extend(TABLES[name][1](root).split("\n"))
        i = j
    return "\n".join(out), problems


def regenerate(root: str | Path = ".", *, check: bool = False) -> list[str]:
    """Regenerate (or, with ``check``, compare) every marked table and number under ``root``; returns the
    problems.

    A problem is a document whose tables or marked numbers differ from the records (``check``), an unknown
    or unclosed marker, or a table of :data:`TABLES` or a number of :data:`VALUES` that no document marks.
    """
    root = Path(root)
    if not (root / "results").is_dir():
        raise FileNotFoundError(f"root: {root} has no results/ folder; run from the checkout's root or pass --root")
    problems: list[str] = []
    seen: set[str] = set()
    seen_values: set[str] = set()
    for document in DOCUMENTS:
        path = root / document
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        seen.update(m["name"] for m in map(_BEGIN.match, text.split("\n")) if m)
        seen_values.update(m["name"] for m in _VALUE.finditer(text))
        new, found = render(text, root, document=document)
        problems += found
        with_values, found = render_values(new, root, document=document)
        problems += found
        if with_values != text:
            if check:
                old_tables = _tables_of(text)
                new_tables = _tables_of(new)
                changed = sorted(n for n in new_tables if old_tables.get(n) != new_tables[n])
                if changed:
                    problems.append(f"{document}: tables differ from their records: {', '.join(changed)} "
                                    f"(run `{COMMAND}`)")
                old_values = {m["name"]: m["text"] for m in _VALUE.finditer(text)}
                moved = sorted({m["name"] for m in _VALUE.finditer(with_values)
                                if old_values.get(m["name"]) != m["text"]})
                if moved:
                    problems.append(f"{document}: numbers in the text differ from their records: {', '.join(moved)} "
                                    f"(run `{COMMAND}`)")
            else:
                path.write_text(with_values, encoding="utf-8")
    problems += [f"table {name!r} of {doc} is marked in no document" for name, (doc, _) in TABLES.items()
                 if name not in seen]
    problems += [f"value {name!r} of {doc} is marked in no document" for name, (doc, _) in VALUES.items()
                 if name not in seen_values]
    return problems


def _tables_of(text: str) -> dict[str, str]:
    found, lines = {}, text.split("\n")
    for i, line in enumerate(lines):
        m = _BEGIN.match(line)
        if m and _END.format(name=m["name"]) in lines[i:]:
            found[m["name"]] = "\n".join(lines[i + 1:lines.index(_END.format(name=m["name"]), i)])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/build_tables.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tables", help="regenerate the marked results tables of README.md and docs/ from results/")
    t.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table differs from its records")
    t.add_argument("--root", default=".", help="the checkout's root (default: the current folder)")
    args = parser.parse_args(argv)
    try:
        problems = regenerate(args.root, check=args.check)
    except (OSError, ValueError, KeyError) as err:
        print(f"python tools/build_tables.py: {err}", file=sys.stderr)
        return 2
    for p in problems:
        print(p, file=sys.stderr)
    if not problems and not args.check:
        print(f"regenerated {len(TABLES)} tables and {len(VALUES)} numbers in the text")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
