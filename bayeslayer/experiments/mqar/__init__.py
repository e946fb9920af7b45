"""``bayeslayer mqar {base,update,block}``: Zoology's multi-query associative recall (docs/theory.md §8.4).

Keys and values share one vocabulary (:mod:`bayeslayer.data.mqar`).  Three tasks:

* **base** — ``k_1 v_1 … k_n v_n`` then every key queried; one model per *width*, the sweep
  variable; tested at one length and number of pairs, trained on it (paper) or on a Zoology-style
  mixture that includes it (CPU preset).
* **update** — later writes of a key overwrite it (``A→4, B→5, A→4*`` answers ``A→4*, B→5``);
  train on lengths 64/128 with 4/16 pairs and mixed update counts, test at length 128 with
  16 pairs over the number of updates (to 16).
* **block** — ``A B 4 5`` binds ``A→4, B→5`` (block size 2); train at length 128 with 2/4/6/8
  pairs, test at length 128 over the number of pairs (to 16).

Model: :class:`~bayeslayer.models.mqar_model.MQARModel`, in one of two layouts (``--layout``):
``stacked`` (today's default: ``num_layers`` blocks of the same mixer) or ``hybrid`` (Zoology's
standard MQAR model: blocks alternate, a short-convolution block first); its module docstring has the
equations and what of Zoology's model is and is not reproduced.  Zoology runs its GDN and DeltaNet
without an output gate; the ``--gate`` setting follows it in the hybrid layout
(:mod:`bayeslayer.experiments.common.mqar_setup`).

Mixers are the registry's mixers with a state-budget rule, their conv-free variants among them
(``bayesian_noconv``, ``gated_deltanet_noconv``, ``deltanet_noconv``: :mod:`bayeslayer.layers.registry`).

Each mixer comes from the registry (:func:`bayeslayer.layers.build_mixer`) with its head
configuration from the state-budget solver (:func:`~bayeslayer.models.state_budget.solve_state_budget`):
every mixer carries the same recurrent-state floats per layer — the Bayesian Layer counts
``H·(D·m + D²)`` (mean and covariance), Gated DeltaNet widens its value dim to ``H·D·m``,
Mamba-2 fills ``d_state``.  Mixers keep their layer defaults otherwise (BL: short convolution
on, scalar decay; labels: :func:`mixer_label`).

Training (the shared :func:`~bayeslayer.experiments.common.harness.train_lr_grid`): a fixed pool of
sequences (:func:`~bayeslayer.data.mqar.make_pool`) split 90/10 into train and validation,
``epochs`` passes over the training split in batches of one length, AdamW β = (0.9, 0.95),
weight decay 0.1 on weights only (not on ``A_log``, ``dt_bias``, noise biases, norms or biases:
:func:`bayeslayer.training.optim.param_groups`), linear warmup then cosine; the learning rate is
chosen from the preset's grid by **validation** query accuracy.  Metrics: query accuracy on fresh
test sets (own seeds) at every sweep point, per training slice on validation, and per number of writes the queried key
received (Update).  Checkpoints and finished runs are cached under ``<out>/runs`` so an
interrupted sweep resumes; ``<out>/mqar_<task>.json`` (``mqar_<task>_hybrid.json`` in the hybrid
layout, ``…_gate-on|off`` with a forced gate: :func:`results_stem`) is rewritten after each mixer
(keeping the mixers of an earlier run with the same settings, so mixers can be run one at a time) and
the PNG of the same stem (accuracy vs the swept variable, one line per mixer) is drawn from it
(``--plot-only`` redraws it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from typing import Any

import torch

from ...data.mqar import MQARTask, make_pool
from ...evaluation.mqar import final_evaluation
from ...models.mqar_model import LAYOUTS, BaseConv, MQARModel, MQARModelConfig
from ...training.compute_match import COMPUTE_MATCH_HELP, MODES, Matching, shape_flops
from ...training.lock import lock_output
from ...training.optim import DECAY_POLICY
from ..common.harness import compute_summary, results_record, train_lr_grid
from ..common.mqar_setup import (
    GATES,
    LOWRANK_MIXERS,
    LOWRANK_PREFIX,
    PRESETS,
    TASK_NAMES,
    MQARPreset,
    build_model,
    epoch_sampler,
    gate_kwargs,
    known_mixers,
    mixer_kwargs,
    mixer_label,
    model_config,
    resolve_mixer,
    train_config,
    train_tasks,
)
from ..common.options import (
    DEVICE_HELP,
    PLOT_ONLY_HELP,
    check_out_dir,
    device_arg,
    positive_float_arg,
    positive_int_arg,
)
from ..common.plotting import load_json
from ..common.provenance import write_record
from ..common.threads import TORCH_DEFAULT, add_threads_option
from .options import DEFAULT_MIXERS, REFERENCE, MQARConfig, config_from_args
from .options import preset_from_args as preset_from_args
from .report import format_table, plot_mqar, redraw, results_stem, summarize_mixer
from .tables import claims_table, lowrank_table, mixer_rows_table, table

DESCRIPTION = (
    "Zoology's multi-query associative recall in three tasks: base (key-value pairs, "
    "then every key queried; one model per width), update (later writes of a key "
    "overwrite it) and block (keys and values written in blocks). Trains each mixer "
    "over a learning-rate grid and seeds, and writes OUT/mqar_<task>*.json and a "
    "figure drawn from it (--plot-only redraws it). Results: docs/experiments.md; the "
    "model and its two layouts: python -m pydoc bayeslayer.models.mqar_model."
)

SWEEP_AXES = {"base": "model width", "update": "number of updates", "block": "number of pairs"}

# The paper's reported accuracies (docs/theory.md §8.4, one run per curve), printed beside ours.
PAPER_POINTS = {
    "update": {"x": 16, "values": {"bayesian": 0.88, "gated_deltanet": 0.60, "mamba2": 0.60,
                                   "gated_deltanet_noconv": 0.98}},
    "block": {"x": 16, "values": {"gated_deltanet_noconv": 1.00, "bayesian": 0.75}},
}


# -- data --------------------------------------------------------------------------------------------
def sweep_points(task: str, preset: MQARPreset) -> list[tuple[int, MQARTask]]:
    """``(x, test task)`` per sweep point (Base: one test task, x = each width)."""
    if task == "base":
        return [(w, MQARTask("base", preset.base_seq_len, preset.base_num_pairs)) for w in preset.base_widths]
    if task == "update":
        return [(u, MQARTask("update", preset.update_test_seq_len, preset.update_test_pairs, u))
                for u in preset.update_test_updates]
    if task == "block":
        return [(n, MQARTask("block", preset.block_seq_len, n, block_size=preset.block_size))
                for n in preset.block_test_pairs]
    raise ValueError(f"task must be one of {TASK_NAMES}, got {task!r}")


def run(config: MQARConfig, *, log=print) -> dict:
    """Train and test every mixer of ``config`` on its task; returns (and, with ``config.out``, writes) the
    record of ``<stem>.json`` (:func:`results_stem`); ``log`` prints the progress lines.

    The device is recorded in the JSON.  The JSON and plot are rewritten after every finished mixer, so a
    sweep stopped part-way leaves the mixers that finished; rerunning resumes from ``<out>/runs``; ``out`` is locked.
    """
    if not isinstance(config, MQARConfig):
        raise TypeError(f"config must be an MQARConfig, got {type(config).__name__}")
    with lock_output(config.out):  # one writer per output folder
        return _run(config, log)


def _run(config: MQARConfig, log) -> dict:
    task, preset, mixers, out_dir, progress = config.task, config.preset, config.mixers, config.out, config.progress
    device = config.device
    t0 = time.perf_counter()
    train_ds, val_ds = make_pool(train_tasks(task, preset), num_examples=preset.pool_size(task),
                                 vocab_size=preset.vocab_size, seed=preset.data_seed,
                                 val_fraction=preset.val_fraction, random_non_queries=preset.random_non_queries)
    points = sweep_points(task, preset)
    if task == "base":  # one test set, shared by every width
        data = points[0][1].generate(preset.test_examples, vocab_size=preset.vocab_size, seed=preset.test_seed,
                                     random_non_queries=preset.random_non_queries)
        tests = [(x, data) for x, _ in points]
    else:
        tests = [(x, t.generate(preset.test_examples, vocab_size=preset.vocab_size, seed=preset.test_seed + i,
                                random_non_queries=preset.random_non_queries))
                 for i, (x, t) in enumerate(points)]
    device = torch.device(device)
    sampler = epoch_sampler(train_ds, preset.batch_size, preset.data_seed, device)
    steps = preset.epochs * sampler.steps_per_epoch
    if preset.max_steps is not None:
        steps = min(steps, preset.max_steps)
    cfg = train_config(preset, steps)
    log(f"mqar {task}: preset '{preset.name}', {len(train_ds)} train / {len(val_ds)} validation sequences, "
        f"{steps} steps ({preset.epochs} epochs × {sampler.steps_per_epoch}"
        f"{f', capped at {preset.max_steps}' if preset.max_steps else ''}), lr grid {list(preset.lrs)} on {device}"
        + (f"; --compute-match {config.compute_match}: the other mixers train on {REFERENCE}'s budget"
           if config.compute_match != "steps" else ""))
    widths = config.widths()
    run_dir = os.path.join(out_dir, "runs") if out_dir else None
    mode = config.compute_match
    if mode == "time":  # the reference's runs set the budgets: it trains first
        mixers = (REFERENCE,) + tuple(m for m in mixers if m != REFERENCE)
    matched = Matching(mode, REFERENCE) if mode != "steps" else None
    config = {**asdict(preset), "task": task, "train": asdict(cfg), "optimizer_groups": DECAY_POLICY,
              "train_tasks": [asdict(t) for t in train_tasks(task, preset)],
              "test_tasks": [{"x": x, **asdict(t)} for x, t in sweep_points(task, preset)],
              "sweep_axis": SWEEP_AXES[task], **({"compute_match": mode} if matched else {})}
    results: dict[str, Any] = {}
    stem = results_stem(task, preset)
    path = os.path.join(out_dir, f"{stem}.json") if out_dir else None
    if path and os.path.exists(path):
        # keep the mixers of an earlier run of the same settings, so mixers can be run one at a time
        previous = load_json(path)
        # config holds plain Python values only (a JSON round trip raises on anything else)
        if previous.get("config") == json.loads(json.dumps(config)):
            results.update({m: res for m, res in previous.get("models", {}).items() if m not in mixers})
    record = results_record("mqar", preset.name, config, results, paper_reported=PAPER_POINTS.get(task))
    for mixer in mixers:
        per_width = []
        for width in widths:
            mcfg, head = model_config(mixer, preset, width)
            log("  " + head.summary())
            # Base: each width is its own model and its own sweep point
            evaluate = final_evaluation(task, val_ds, [tests[widths.index(width)]] if task == "base" else tests,
                                        preset.eval_batch)
            try:
                grid = train_lr_grid(
                    f"mqar_{task}_{preset.name}_{preset.layout}_gate-{preset.gate}_{mixer}_w{width}",
                    lambda seed, mixer=mixer, width=width: build_model(mixer, preset, width).to(device),
                    sampler, cfg, preset.lrs, list(range(preset.seeds)), evaluate, select_key="val_accuracy",
                    run_dir=run_dir, progress=progress,
                    fingerprint={"preset": asdict(preset), "task": task, "model": asdict(mcfg),
                                 "optimizer_groups": DECAY_POLICY},
                    budget=_budgets(matched, mixer, preset, width) if matched else None)
            except FloatingPointError as err:  # every lr diverged: record it, go on with the other mixers
                log(f"  {mixer} at width {width}: {err}")
                record.setdefault("failed", {})[f"{mixer}_w{width}"] = str(err)
                per_width = []
                break
            built = build_model(mixer, preset, width)
            n_params = sum(p.numel() for p in built.parameters())
            layer = built.recurrent_mixers()[0]
            per_width.append({"width": width, "head_config": head.to_dict(), "model_config": asdict(mcfg),
                              "parameters": n_params, "use_gate": getattr(layer, "use_gate", None),
                              "use_short_conv": getattr(layer, "use_short_conv", None),
                              "best_lr": grid["best_lr"], "lr_grid": grid["grid"],
                              "seeds": grid["records"]})
            if matched:
                for lr, records in grid["all_records"].items():
                    matched.add(mixer, records, point=_point(width, lr))
                per_width[-1]["compute"] = compute_summary(grid["records"])
        if not per_width:
            continue
        results[mixer] = {"label": mixer_label(mixer), "runs": per_width,
                          "summary": summarize_mixer(task, per_width)}
        s = results[mixer]["summary"]
        log(f"  {mixer_label(mixer)}: test accuracy "
            + ", ".join(f"{x}: {a:.3f}" for x, a in zip(s["x"], s["accuracy"]["mean"], strict=True))
            + f"  (val {s['val_accuracy']['mean'][-1]:.3f}, {s['train_seconds']['mean']:.0f} s train)")
        if matched:
            record["compute_match"] = matched.describe()
        record["wall_seconds"] = time.perf_counter() - t0
        record["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        record["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if path:
            write_record(path, record, device=device, seeds=range(preset.seeds), wall_seconds=record["wall_seconds"],
                         optimizer_groups=DECAY_POLICY)
            plot_mqar(record, os.path.join(out_dir, f"{stem}.png"))
    return record


def _point(width: int, lr: float) -> str:
    """The name of a compute-matched comparison point: a width and a learning rate."""
    return f"w{width}_lr{lr:g}"


def _budgets(matched: Matching, mixer: str, preset: MQARPreset, width: int):
    """``budget(lr)`` for :func:`train_lr_grid`: ``mixer``'s budget at ``width`` and ``lr`` (``FloatingPointError``,
    which the grid records as a lost learning rate, where the reference diverged and set none)."""
    model_flops = shape_flops(build_model(mixer, preset, width))
    reference_flops = shape_flops(build_model(REFERENCE, preset, width)) if mixer != REFERENCE else model_flops

    def budget(lr: float):
        point = _point(width, lr)
        if matched.mode == "time" and mixer != REFERENCE and point not in matched.seconds:
            raise FloatingPointError(f"no time budget at lr {lr:g}: the reference {REFERENCE!r} diverged there")
        return matched.budget(mixer, model_flops, reference_flops, point=point)

    return budget


def _main(args: argparse.Namespace) -> int:
    out_dir = check_out_dir(args.out)
    if args.plot_only:  # the named task, or every task whose JSON is in --out
        with lock_output(out_dir):  # a redraw writes into --out too: one writer per output folder
            return redraw(out_dir, args.task)
    config = config_from_args(args)
    if config.preset.name != "paper":
        print(f"mqar: preset '{config.preset.name}' is a CPU-sized run of the same task, NOT the paper's budget "
              f"(use --preset paper for the paper's settings, docs/theory.md §8.4)")
    record = run(config)
    print(format_table(record))
    stem = results_stem(config.task, config.preset)
    print(f"\nwrote {os.path.join(out_dir, stem + '.json')} and {stem}.png")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("mqar", help="Zoology MQAR: base / update / block recall (docs/theory.md §8.4)",
                       description=DESCRIPTION)
    p.add_argument("task", nargs="?", choices=TASK_NAMES, default=None, help="which MQAR task")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default",
                   help="'paper' = the paper's settings (docs/theory.md §8.4); "
                        "'default' ≈ 20 min per task on an idle 2-core CPU; "
                        "'cpu-paper-data' = default with vocabulary 8,192 and random fillers; 'tiny' = smoke")
    p.add_argument("--mixers", nargs="+", default=list(DEFAULT_MIXERS), choices=known_mixers() + list(LOWRANK_MIXERS),
                   metavar="MIXER",
                   help=f"registry mixers with a state-budget rule ({' '.join(known_mixers())}) "
                        f"(default: {' '.join(DEFAULT_MIXERS)}); {LOWRANK_PREFIX}<r> is the "
                        "low-rank-plus-diagonal BL of rank r at the same state budget")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="'stacked' (default): num_layers blocks of the mixer; 'hybrid': Zoology's model, a "
                        "short-conv (BaseConv, kernel 3) block before each mixer block")
    p.add_argument("--gate", choices=GATES, default=None,
                   help="output gate of BL/GDN/DeltaNet/linear attention: 'default' = each layer's own in the "
                        "stacked layout, off in the hybrid layout (Zoology's use_gate=False); 'on'/'off' force it")
    p.add_argument("--num-layers", type=positive_int_arg, default=None,
                   help="override the preset's number of blocks (hybrid: conv and mixer blocks alternate, so "
                        "4 = two mixers)")
    p.add_argument("--epochs", type=positive_int_arg, default=None, help="override the preset's epochs")
    p.add_argument("--max-steps", type=positive_int_arg, default=None,
                   help="stop training after this many steps (a budget cap; the schedule is sized to it)")
    p.add_argument("--device", type=device_arg, default="cpu", help=DEVICE_HELP)
    add_threads_option(p, TORCH_DEFAULT)
    p.add_argument("--batch-size", type=positive_int_arg, default=None, help="override the preset's batch size")
    p.add_argument("--seeds", type=positive_int_arg, default=None, help="override the preset's number of seeds")
    p.add_argument("--lr", type=positive_float_arg, nargs="+", default=None, help="override the preset's lr grid")
    p.add_argument("--compute-match", choices=MODES, default="steps",
                   help=COMPUTE_MATCH_HELP.format(reference=f"mixer {REFERENCE} (at the same width and lr)"))
    p.add_argument("--out", default="runs/mqar", help="output directory (JSON, PNG, runs/ cache)")
    p.add_argument("--plot-only", action="store_true",
                   help=PLOT_ONLY_HELP + " (the task named, or every task found)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_main)


__all__ = [
    "DEFAULT_MIXERS", "GATES", "LAYOUTS", "PRESETS", "TASK_NAMES", "BaseConv", "MQARConfig",
    "MQARModel", "MQARModelConfig", "MQARPreset", "build_model", "epoch_sampler", "format_table", "gate_kwargs",
    "known_mixers", "mixer_kwargs", "model_config", "plot_mqar", "resolve_mixer", "results_stem",
    "config_from_args", "run", "sweep_points", "train_tasks", "table", "mixer_rows_table", "lowrank_table",
    "claims_table",
]


def __getattr__(name: str):
    if name in ("MIXER_VARIANTS", "VARIANT_LABELS"):  # the old variant tables: the mixer registry now
        from ..common import mqar_setup

        return getattr(mqar_setup, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
