"""``bayeslayer variance``: does the Bayesian Layer's predictive variance flag a wrong answer?

The Bayesian Layer's readout comes with a predictive variance ``1 + q_tᵀ P_t q_t`` (docs/theory.md):
how well the memory knows the queried direction.  This experiment trains the BL models two other
experiments train — learned collision recall (:mod:`bayeslayer.experiments.recall`, the BL core
model) and MQAR Update in Zoology's hybrid layout (:mod:`bayeslayer.experiments.mqar`, the
registry Bayesian Layer after a short-convolution block) — with their own samplers, settings and
learning rates (fewer steps in the CPU preset), then, for every query of fixed test sets spanning
easy to hard, records

* the variance at the query token (:func:`~bayeslayer.evaluation.variance.token_variance`): the last
  Bayesian layer's (mean over heads and groups) and the mean of the Bayesian layers' means;
* the softmax entropy of the model's answer distribution (the baseline: what any model has);
* whether the arg-max answer is right.

Each score's AUROC for a *wrong* answer (0.5: no signal; ties count half) is computed on a held-out
half of the queries; "combined" is a logistic regression on (log variance of the last layer,
entropy) fitted on the other half.  Numbers are per seed, then mean ± std over seeds.  The figure
shows accuracy per decile of the variance (and of the entropy, for comparison), pooled over the
test set.

Test sets: recall at ``n_f ∈ test_n_f`` distractor writes (ρ = 0.80); MQAR Update at length 128 with
16 pairs over the number of updates.  Pooled over these conditions, a score can separate right from
wrong by telling the conditions apart; the per-condition accuracy is in the JSON beside it.

Writes ``<out>/variance.json`` and ``<out>/variance.png`` drawn from it (``--plot-only`` redraws).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ...checks import check_int
from ...data.collision_tasks import collision_recall_batch
from ...data.mqar import IGNORE_INDEX, MQARTask, make_pool
from ...evaluation.variance import QUANTILES, score_queries, token_variance
from ...training.distributed import resolve_device
from ...training.lock import lock_output
from ...training.optim import DECAY_POLICY
from ..common import mqar_setup, recall_task
from ..common.harness import results_record, summarize, train_seeds
from ..common.options import (
    DEVICE_HELP,
    PLOT_ONLY_HELP,
    check_out_dir,
    check_seeds,
    device_arg,
    plot_only_json,
    positive_int_arg,
)
from ..common.provenance import write_record
from ..common.recall_models import CoreMixer
from ..common.recall_sweep import model_on_device, sampler_on_device
from ..common.threads import SMALL, add_threads_option
from .presets import MEASURED as MEASURED  # the presets, their cost and their help: variance/presets.py
from .presets import MEASURED_RECORD as MEASURED_RECORD
from .presets import PRESETS, VariancePreset, preset_help, smoke_note
from .tables import ABSTENTION_COVERAGES as ABSTENTION_COVERAGES  # the record's Markdown tables: variance/tables.py
from .tables import abstention_table as abstention_table
from .tables import presets_table as presets_table
from .tables import table as table

DESCRIPTION = (
    "Trains the Bayesian-Layer models of learned collision recall and of MQAR "
    "Update (hybrid layout), then reports for every test query the AUROC of the "
    "layer's predictive variance for a wrong answer, against the softmax entropy "
    "of the answer and both combined, over seeds; writes variance.json and the "
    "figure drawn from it."
)

NAME = "variance"
TASKS = ("recall", "mqar_update")
TASK_LABELS = {"recall": "recall (BL core)", "mqar_update": "MQAR Update (hybrid, BL)"}


@dataclass(frozen=True)
class VarianceConfig:
    preset: VariancePreset = PRESETS["default"]
    tasks: tuple[str, ...] = TASKS
    out: str | None = "runs/variance"
    progress: bool = False
    device: str = "cpu"  # where models train and are scored

    def __post_init__(self):
        if not isinstance(self.preset, VariancePreset):
            raise TypeError(f"preset must be a VariancePreset, got {type(self.preset).__name__}")
        if isinstance(self.tasks, str) or not self.tasks or any(t not in TASKS for t in self.tasks):
            raise ValueError(f"tasks must be a non-empty subset of {TASKS}, got {self.tasks!r}")
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"tasks has repeated names: {list(self.tasks)}")
        for name in ("seeds", "recall_sequences", "mqar_examples"):
            check_int(f"preset.{name}", getattr(self.preset, name), minimum=1)
        check_seeds(self.preset.seeds)
        for name in ("recall_steps", "mqar_steps"):
            if getattr(self.preset, name) is not None:
                check_int(f"preset.{name}", getattr(self.preset, name), minimum=1)
        object.__setattr__(self, "device", str(resolve_device(self.device, option="device")))


# -- reading the variance out of a model ---------------------------------------------------------------
class VarianceProbe:
    """Records the predictive variance of every Bayesian layer of ``model`` during its forward passes.

    Registry mixers (``output_variance`` on their forward) are asked for it through a pre-hook; the
    recall core mixers (:class:`~bayeslayer.experiments.common.recall_models.CoreMixer`) run their filter again
    through :meth:`~bayeslayer.experiments.common.recall_models.CoreMixer.predictive_variance`.  The model's outputs
    are unchanged.  Use as a context manager; :attr:`variances` holds ``[B, T, H, G]`` per layer of the last
    forward (``G = 1`` for a core mixer, whose variance comes averaged over its groups), the layout
    :func:`~bayeslayer.evaluation.variance.token_variance` reduces.
    """

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules()
                       if (m.kind.startswith("bayesian") if isinstance(m, CoreMixer)
                           else bool(getattr(getattr(m, "design", None), "has_covariance", False)))]
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no Bayesian layer to read a variance from")
        self.variances: list[torch.Tensor | None] = [None] * len(self.layers)
        self.handles = []

    def __enter__(self) -> VarianceProbe:
        for i, layer in enumerate(self.layers):
            if isinstance(layer, CoreMixer):
                self.handles.append(layer.register_forward_hook(
                    lambda mod, args, out, i=i: self._store(i, mod.predictive_variance(*args).unsqueeze(-1))))
            else:
                self.handles.append(layer.register_forward_pre_hook(
                    lambda mod, args, kwargs: (args, {**kwargs, "output_variance": True}), with_kwargs=True))
                self.handles.append(layer.register_forward_hook(
                    lambda mod, args, out, i=i: self._store(i, out.variance)))  # [B, T, H, G]
        return self

    def _store(self, i: int, variance: torch.Tensor) -> None:
        self.variances[i] = variance.detach()

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def collect_queries(model: nn.Module, batches) -> dict[str, np.ndarray]:
    """Per query (label ≠ -100) of ``batches`` (``(inputs, labels, condition)``): ``correct``, ``entropy`` of the
    softmax, ``variance_last`` (last Bayesian layer, mean over heads and groups) and ``variance_mean`` (the mean
    of the Bayesian layers' means), both :func:`~bayeslayer.evaluation.variance.token_variance`, and
    ``condition``."""
    rows: dict[str, list] = {k: [] for k in ("correct", "entropy", "variance_last", "variance_mean", "condition")}
    with VarianceProbe(model) as probe:
        for inputs, labels, condition in batches:
            logits = model(inputs).float().cpu()
            mask = labels != IGNORE_INDEX
            logp = torch.log_softmax(logits[mask], -1)
            var = [v.float().cpu() for v in probe.variances]  # [B, T, H, G] per Bayesian layer
            rows["correct"].append((logits[mask].argmax(-1) == labels[mask]).numpy())
            rows["entropy"].append((-(logp.exp() * logp).sum(-1)).numpy())
            rows["variance_last"].append(token_variance(var, layers="last")[mask].double().numpy())
            rows["variance_mean"].append(token_variance(var, layers="all")[mask].double().numpy())
            rows["condition"].append(np.full(int(mask.sum()), condition))
    return {k: np.concatenate(v) for k, v in rows.items()}


# -- the two tasks -----------------------------------------------------------------------------------
def _recall_setup(preset: VariancePreset, device: str = "cpu"):
    source = recall_task.PRESETS[preset.recall_preset]
    source = replace(source, curve_points=0, seeds=preset.seeds,
                     steps=preset.recall_steps if preset.recall_steps is not None else source.steps)

    def batches():
        g = torch.Generator().manual_seed(preset.eval_seed)
        for n_f in preset.recall_test_n_f:
            left = preset.recall_sequences
            while left > 0:
                b = min(left, source.eval_batch)
                left -= b
                batch = collision_recall_batch(b, n_f=n_f, rho=source.test_rho_for_n_f, generator=g,
                                               n_b=source.n_b, num_pairs=source.num_pairs,
                                               address_dim=source.address_dim)
                yield batch.inputs, batch.labels, n_f

    return (lambda seed: model_on_device(recall_task.build_model("bayesian", source), device)), \
        sampler_on_device(recall_task.sampler(source), device), source.train_config(), \
        batches, {"source_preset": asdict(source), "condition": "n_f (distractor writes, rho = 0.80)"}


def _mqar_setup(preset: VariancePreset, device: str = "cpu"):
    source = replace(mqar_setup.PRESETS[preset.mqar_preset], layout="hybrid", seeds=preset.seeds,
                     max_steps=preset.mqar_steps)
    train_ds, _ = make_pool(mqar_setup.train_tasks("update", source), num_examples=source.pool_size("update"),
                            vocab_size=source.vocab_size, seed=source.data_seed, val_fraction=source.val_fraction,
                            random_non_queries=source.random_non_queries)
    sampler = mqar_setup.epoch_sampler(train_ds, source.batch_size, source.data_seed, device)
    steps = source.epochs * sampler.steps_per_epoch
    if source.max_steps is not None:
        steps = min(steps, source.max_steps)
    tests = []
    for i, u in enumerate(preset.mqar_test_updates):
        task = MQARTask("update", source.update_test_seq_len, source.update_test_pairs, u)
        tests.append((u, task.generate(preset.mqar_examples, vocab_size=source.vocab_size,
                                       seed=preset.eval_seed + i, random_non_queries=source.random_non_queries)))

    def batches():
        for u, data in tests:
            for start in range(0, len(data), source.eval_batch):
                idx = slice(start, start + source.eval_batch)
                yield data.inputs[idx].to(device), data.labels[idx], u

    return (lambda seed: mqar_setup.build_model("bayesian", source, source.width).to(device)), sampler, \
        mqar_setup.train_config(source, steps), batches, \
        {"source_preset": asdict(source),
         "condition": f"updates of the queried key (length {source.update_test_seq_len}, "
                      f"{source.update_test_pairs} pairs)"}


def run(config: VarianceConfig) -> dict:
    """Train and score every task of ``config``; returns (and, with ``config.out``, locked, writes) the record."""
    if not isinstance(config, VarianceConfig):
        raise TypeError(f"config must be a VarianceConfig, got {type(config).__name__}")
    out = check_out_dir(config.out) if config.out is not None else None
    with lock_output(out):  # one writer per output folder
        return _run(config, out)


def _run(config: VarianceConfig, out: Path | None) -> dict:
    t0 = time.perf_counter()
    preset = config.preset
    tasks: dict[str, Any] = {}
    for task in config.tasks:
        t_task = time.perf_counter()
        build, sampler, train_cfg, batches, info = (_recall_setup if task == "recall" else _mqar_setup)(preset,
                                                                                                     config.device)

        def final_eval(model, batches=batches):
            return {"queries_scored": score_queries(collect_queries(model, batches()), seed=preset.eval_seed)}

        seeds = train_seeds(f"{NAME}_{task}", build, sampler, train_cfg, list(range(preset.seeds)), final_eval,
                            progress=config.progress)
        per_seed = [s["queries_scored"] | {"seed": s["seed"], "train_seconds": s["train_seconds"],
                                           "final_train_loss": s["final_train_loss"]} for s in seeds]
        summary = {}
        for key in ("accuracy", "auroc_variance_last", "auroc_variance_mean", "auroc_entropy", "auroc_combined"):
            values = [s[key] for s in per_seed if s[key] is not None]
            summary[key] = summarize(values) if values else None
        for key in ("accuracy_by_variance_last_decile", "accuracy_by_entropy_decile"):
            cols = list(zip(*[s[key] for s in per_seed], strict=True))
            summary[key] = {"mean": [float(np.mean([v for v in c if v is not None])) if any(v is not None for v in c)
                                     else None for c in cols],
                            "std": [float(np.std([v for v in c if v is not None], ddof=1))
                                    if sum(v is not None for v in c) > 1 else 0.0 for c in cols]}
        tasks[task] = {"label": TASK_LABELS[task], "train": asdict(train_cfg), **info, "seeds": per_seed,
                       "summary": summary, "wall_seconds": time.perf_counter() - t_task}
        for score in ("variance_last", "entropy"):
            summary[f"coverage_{score}"] = coverage_curve(tasks[task], score)
    note = {"note": smoke_note(preset)} if preset.smoke_test else {}
    record = results_record(NAME, preset.name, {**asdict(preset), "tasks": list(config.tasks)}, tasks,
                            smoke_test=preset.smoke_test, **note, wall_seconds=time.perf_counter() - t0,
                            finished_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if out is not None:
        write_record(out / f"{NAME}.json", record, device=config.device, seeds=range(preset.seeds),
                     wall_seconds=record["wall_seconds"],
                     optimizer_groups=DECAY_POLICY, allow_nan=False)
        plot(plot_only_json(out, NAME, experiment=NAME), out)  # drawn from the saved JSON, as --plot-only
    return record


def coverage_curve(task: dict, score: str) -> dict[str, list[float]]:
    """Abstention: answer only the ``k/10`` of queries with the lowest ``score`` (``variance_last`` or
    ``entropy``), k = 1..10; the accuracy of the answered ones, mean ± std over seeds.  Read from the per-seed
    decile accuracies (equal-count bins), so it needs nothing but the JSON."""
    curves = []
    for seed in task["seeds"]:
        acc = np.array([np.nan if v is None else v for v in seed[f"accuracy_by_{score}_decile"]])
        curves.append(np.nancumsum(acc) / np.cumsum(~np.isnan(acc)))
    curves = np.array(curves)
    return {"coverage": [(k + 1) / QUANTILES for k in range(QUANTILES)], "mean": curves.mean(0).tolist(),
            "std": (curves.std(0, ddof=1) if len(curves) > 1 else np.zeros(QUANTILES)).tolist()}


def plot(record: dict, out) -> Path:
    """Left: accuracy per decile of the variance (solid) and of the entropy (dashed); right: accuracy against
    coverage when abstaining on the highest scores (:func:`coverage_curve`); mean ± std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..common.plotting import save_figure

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    x = (np.arange(QUANTILES) + 0.5) / QUANTILES
    for task in record["models"].values():
        s = task["summary"]
        color = None
        for score, style, what in (("variance_last", "-o", "variance"), ("entropy", "--s", "entropy")):
            key = f"accuracy_by_{score}_decile"
            mean = np.array([np.nan if v is None else v for v in s[key]["mean"]])
            std = np.array(s[key]["std"])
            auc = s[f"auroc_{score}"]
            auc_text = f"{auc['mean']:.2f}" if auc else "n/a"
            line = ax.plot(x, mean, style, ms=3, color=color, label=f"{task['label']}: by {what} (AUROC {auc_text})")
            color = line[0].get_color()
            ax.fill_between(x, mean - std, mean + std, alpha=0.15, color=color)
            cov = coverage_curve(task, score)
            ax2.errorbar(cov["coverage"], cov["mean"], yerr=cov["std"], fmt=style, ms=3, capsize=2, color=color,
                         label=f"{task['label']}: abstain on high {what}")
    ax.set_xlabel("decile of the score (low → high)")
    ax.set_ylabel("answer accuracy in the decile")
    ax.set_ylim(-0.02, 1.02)
    ax2.set_xlabel("coverage (fraction of queries answered, lowest scores first)")
    ax2.set_ylabel("accuracy of the answered queries")
    ax2.set_ylim(-0.02, 1.02)
    cfg = record["config"]
    smoke = " — SMOKE TEST: these numbers mean nothing" if record.get("smoke_test") else ""
    fig.suptitle(f"Predictive variance vs answer correctness — preset '{record['preset']}', {cfg['seeds']} seeds "
                 f"(mean ± std){smoke}", fontsize=10)
    ax.legend(fontsize=7)
    ax2.legend(fontsize=7)
    path = save_figure(fig, Path(out) / f"{NAME}.png")
    plt.close(fig)
    return path


def print_table(record: dict) -> None:
    print(f"{'task':<28}{'accuracy':>16}{'AUROC var(last)':>18}{'var(mean)':>16}{'entropy':>16}{'combined':>16}")
    def cell(s, key):
        return f"{s[key]['mean']:.3f} ± {s[key]['std']:.3f}" if s[key] else "n/a"

    for task in record["models"].values():
        s = task["summary"]
        print(f"{task['label']:<28}" + "".join(f"{cell(s, key):>{w}}" for key, w in (
            ("accuracy", 16), ("auroc_variance_last", 18), ("auroc_variance_mean", 16), ("auroc_entropy", 16),
            ("auroc_combined", 16))))
    print("\naccuracy when answering only the lowest-scoring fraction (abstention), mean over seeds")
    print(f"{'task / score':<40}" + "".join(f"{c:>7.0%}" for c in np.arange(1, QUANTILES + 1) / QUANTILES))
    for task in record["models"].values():
        for score in ("variance_last", "entropy"):
            cov = coverage_curve(task, score)
            print(f"{task['label'] + ' / ' + score:<40}" + "".join(f"{a:>7.3f}" for a in cov["mean"]))


def _main(args):
    if args.plot_only:
        with lock_output(check_out_dir(args.out)):  # a redraw writes into --out too
            record = plot_only_json(args.out, NAME, experiment=NAME)
            plot(record, args.out)
        return record
    preset = PRESETS[args.preset]
    if args.seeds is not None:
        preset = replace(preset, seeds=args.seeds)
    note = smoke_note(preset)
    if note:
        print(f"note: {note}", flush=True)
    record = run(VarianceConfig(preset=preset, tasks=tuple(args.tasks), out=args.out, progress=args.progress,
                                device=args.device))
    print_table(record)
    if note:
        print(f"\nnote: {note}")
    print(f"wall time {record['wall_seconds']:.0f} s; wrote {Path(args.out) / (NAME + '.json')}")
    return record


def add_parser(sub) -> None:
    p = sub.add_parser("variance", help="does the BL's predictive variance flag wrong answers? (AUROC vs entropy)",
                       description=DESCRIPTION)
    p.add_argument("--preset", choices=sorted(PRESETS), default="default", help=preset_help())
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--seeds", type=positive_int_arg, default=None, help="number of seeds (default: the preset's)")
    p.add_argument("--out", default=VarianceConfig.out, help="where the JSON and figure go")
    p.add_argument("--progress", action="store_true", help="show a progress bar while training")
    p.add_argument("--device", type=device_arg, default="cpu", help=DEVICE_HELP)
    add_threads_option(p, SMALL)
    p.add_argument("--plot-only", action="store_true", help=PLOT_ONLY_HELP)
    p.set_defaults(func=_main)

