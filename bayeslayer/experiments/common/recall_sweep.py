"""What the learned core-model experiments (``recall``, ``crowding``) share: presets, configs, the CLI.

Both experiments have the same shape: a preset (``paper`` / ``default`` / ``tiny``, a subclass of
:class:`CorePreset`) with optional ``--steps/--batch-size/--seeds`` overrides, a run
``run(config) -> record`` over a :class:`CoreRunConfig` (the preset, the models, the output folder)
that writes ``<name>.json`` and draws ``<name>.png`` from it, ``--plot-only`` to redraw them from the
JSON in ``--out``, and a printed table of ``mean ± std`` rows per model.  The argparse side
(:func:`add_command`, :func:`config_from_args`) only maps arguments onto the config.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from ...training.compute_match import COMPUTE_MATCH_HELP, MODES, Matching, check_mode, shape_flops
from ...training.distributed import resolve_device
from ...training.lock import lock_output
from ...training.optim import DECAY_POLICY
from .cli_help import override_help
from .harness import TrainConfig, compute_summary, results_record, summarize, summarize_curves, train_seeds
from .options import (
    DEVICE_HELP,
    PLOT_ONLY_HELP,
    check_int,
    check_memory,
    check_out_dir,
    check_seeds,
    device_arg,
    nonnegative_int_arg,
    plot_only_json,
    positive_int_arg,
    redrawing,
)
from .provenance import write_record
from .recall_models import ALL_KINDS, CORE_KINDS, CORE_LABELS, PAPER_CORE_KINDS, paper_core_kind
from .threads import SMALL, add_threads_option

# Steps between the periodic checkpoints of a seed's training (``--checkpoint-every``).  Measured with the
# default preset on a busy 2-core CPU: a save (0.7 MB with the optimiser state, fsync-ed) took 0.06-0.18 s
# where a training step of BL or Delta took 0.6-1.1 s, so about 0.2% of the training time; a kill loses at
# most 100 steps.
CHECKPOINT_EVERY = 100
# ``--core``: ``ours`` learns BL's noise and Delta's gain per token from the residual stream; ``paper`` gives
# BL and the reset (Delta) core per-head learnable scalar noise levels (recall_models.PAPER_CORE_KINDS).
CORES = ("ours", "paper")


@dataclass(frozen=True)
class CorePreset:
    """The fields every core-model preset starts with, and the one training config they give.

    Subclasses (:class:`~bayeslayer.experiments.recall.RecallPreset`,
    :class:`~bayeslayer.experiments.crowding.CrowdingPreset`) add their task's fields after these, so a
    preset's ``asdict`` (the JSON ``config`` and the run-cache fingerprint) keeps its field order.
    """

    name: str
    steps: int
    batch_size: int
    seeds: int
    eval_sequences: int  # sequences per evaluation point
    lr: float = 3e-4
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    warmup_fraction: float = 0.05

    def eval_every(self) -> int:
        """Steps between periodic evaluations (0: only at the end); a preset with learning curves overrides it."""
        return 0

    def train_config(self) -> TrainConfig:
        return TrainConfig(steps=self.steps, batch_size=self.batch_size, lr=self.lr,
                           weight_decay=self.weight_decay, grad_clip=self.grad_clip,
                           warmup_steps=int(self.warmup_fraction * self.steps), eval_every=self.eval_every())


@dataclass(frozen=True)
class CoreRunConfig:
    """One run of a core-model experiment: ``preset`` (of the experiment's :meth:`preset_type`), the
    ``models`` to train (names from :data:`~bayeslayer.experiments.common.recall_models.ALL_KINDS`), ``out`` (a
    folder for ``<name>.json``, ``<name>.png`` and the per-seed cache ``runs/``; ``None``: write nothing),
    ``progress`` (a progress bar), ``checkpoint_every`` (with ``out``: a training checkpoint of the
    seed in training every that many steps, under ``runs/``, so a killed run resumes from the last one
    bit-identical; 0: only when stopped by Ctrl-C; it never changes the results, and a run resumes a
    checkpoint written at another interval), ``device`` (where models train and are evaluated: ``cpu``,
    ``cuda``, ``cuda:N`` or ``auto``) and ``compute_match`` (``steps``, ``flops`` or ``time``: what every model
    gets of the reference's compute, :mod:`~bayeslayer.training.compute_match`; the reference is
    :meth:`reference`).  Every field is checked here, with its name in the error."""

    preset: CorePreset
    models: tuple[str, ...] = CORE_KINDS
    out: str | None = None
    progress: bool = True
    checkpoint_every: int = CHECKPOINT_EVERY
    device: str = "cpu"
    compute_match: str = "steps"

    @classmethod
    def preset_type(cls) -> type:
        """The presets the experiment takes: the type of its default ``preset`` (without one, :class:`CorePreset`)."""
        default = cls.__dataclass_fields__["preset"].default
        return type(default) if isinstance(default, CorePreset) else CorePreset

    @classmethod
    def checked(cls, config: CoreRunConfig) -> CoreRunConfig:
        """``config``, which must be a ``cls`` (a :class:`TypeError` naming the argument otherwise)."""
        if not isinstance(config, cls):
            raise TypeError(f"config must be a {cls.__name__}, got {type(config).__name__}")
        return config

    def __post_init__(self):
        if not isinstance(self.preset, self.preset_type()):
            raise TypeError(f"preset must be a {self.preset_type().__name__}, got {type(self.preset).__name__}")
        for name in ("steps", "batch_size", "seeds", "eval_sequences"):
            check_int(f"preset.{name}", getattr(self.preset, name), minimum=1)
        check_seeds(self.preset.seeds)
        if isinstance(self.models, str):
            raise TypeError(f"models must be a sequence of model names, not the string {self.models!r}")
        models = tuple(self.models)
        unknown = [m for m in models if m not in ALL_KINDS]
        if unknown or not models:
            raise ValueError(f"models must be a non-empty subset of {ALL_KINDS}, got {list(models)}")
        object.__setattr__(self, "models", models)
        if self.out is not None and not isinstance(self.out, (str, os.PathLike)):
            raise TypeError(f"out must be a folder path or None, got {type(self.out).__name__}")
        if self.out is not None:
            object.__setattr__(self, "out", os.fspath(self.out))
        if not isinstance(self.progress, bool):
            raise TypeError(f"progress must be a bool, got {type(self.progress).__name__}")
        object.__setattr__(self, "checkpoint_every", check_int("checkpoint_every", self.checkpoint_every, minimum=0))
        object.__setattr__(self, "device", str(resolve_device(self.device, option="device")))
        check_mode(self.compute_match)
        if self.compute_match == "time" and self.reference() not in self.models:
            raise ValueError(f"compute_match='time' measures the budget on the reference {self.reference()!r}: "
                             f"include it in models (got {list(self.models)})")

    def reference(self) -> str:
        """The model whose run sets the compute budget: the Bayesian Layer core (``bayesian_paper`` when the
        models are the paper's cores)."""
        return "bayesian_paper" if any(m in PAPER_CORE_KINDS.values() for m in self.models) else "bayesian"


def model_on_device(model, device: str):
    """``model`` moved to ``device``.  The evaluation functions build their batches on the CPU and score
    the logits there, so in eval mode a model on a GPU takes CPU inputs and returns CPU logits (two hooks)."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return model

    def inputs_to_device(module, args):
        return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)

    def logits_to_cpu(module, args, output):
        return output if module.training else output.cpu()

    model = model.to(device)
    model.register_forward_pre_hook(inputs_to_device)
    model.register_forward_hook(logits_to_cpu)
    return model


def sampler_on_device(sampler, device: str):
    """A sampler whose batches (tuples of tensors) are moved to ``device``."""
    import torch

    if torch.device(device).type == "cpu":
        return sampler

    def sample_on_device(step, batch_size, generator):
        batch = sampler(step, batch_size, generator)
        return type(batch)(*(t.to(device) for t in batch))

    return sample_on_device


def run_sweep(name: str, config: CoreRunConfig, *, build_model: Callable, sampler, evaluation,
              curves: Sequence[str], plot: Callable, paper_budget: str, evaluate: Callable | None = None) -> dict:
    """Train every model of ``config`` over ``config.preset.seeds`` seeds with the shared harness and summarise.

    ``build_model(kind)`` makes a fresh model; ``curves`` name the per-seed evaluation curves
    summarised as mean ± std.  ``evaluate(model) -> {name: float}``, when given, runs every
    ``eval_every`` steps of the preset's training config and at the end; its numbers become
    ``summary["learning_curve"]`` (``{"step": [...], name: {"mean", "std"}}``, from each seed's ``evals``).
    With ``config.out`` (locked for the call: :func:`~bayeslayer.training.lock.lock_output`), ``<name>.json``
    and ``<name>.png`` are rewritten after every model (a long sweep shows its progress) and per-seed runs
    are cached under ``out/runs`` so an interrupted sweep resumes; the seed in training is checkpointed there
    every ``config.checkpoint_every`` steps.
    """
    if not isinstance(config, CoreRunConfig):
        raise TypeError(f"config must be a CoreRunConfig, got {type(config).__name__}")
    with lock_output(config.out):  # one writer per output folder
        return _run_sweep(name, config, build_model=build_model, sampler=sampler, evaluation=evaluation,
                          curves=curves, plot=plot, paper_budget=paper_budget, evaluate=evaluate)


def _run_sweep(name: str, config: CoreRunConfig, *, build_model: Callable, sampler, evaluation,
               curves: Sequence[str], plot: Callable, paper_budget: str, evaluate: Callable | None) -> dict:
    preset, models, out_dir, progress = config.preset, list(config.models), config.out, config.progress
    cfg = replace(preset.train_config(), checkpoint_every=config.checkpoint_every)
    # one sequence's bytes times the batch: a batch that cannot fit fails now, not in the allocator
    one = _tensor_bytes(sampler(0, 1, torch.Generator().manual_seed(0)))
    check_memory(one * max(preset.batch_size, preset.eval_sequences),
                 what=f"a batch of {max(preset.batch_size, preset.eval_sequences):,} sequences (batch_size)")
    run_dir = os.path.join(out_dir, "runs") if out_dir else None
    settings = {**asdict(preset), "train": asdict(cfg), "optimizer_groups": DECAY_POLICY}
    started = time.perf_counter()
    results = {}
    record = None
    mode, reference = config.compute_match, config.reference()
    if mode == "time":  # the reference's run sets the budget: it trains first
        models = [reference] + [m for m in models if m != reference]
    matched = Matching(mode, reference) if mode != "steps" else None
    reference_flops = shape_flops(build_model(reference)) if matched else None
    for kind in models:
        model_cfg = asdict(build_model(kind).cfg)
        records = train_seeds(
            f"{name}_{preset.name}_{kind}", lambda seed, kind=kind: model_on_device(build_model(kind), config.device),
            sampler_on_device(sampler, config.device), cfg,
            list(range(preset.seeds)), evaluation, run_dir=run_dir, progress=progress, evaluate=evaluate,
            fingerprint={"preset": asdict(preset), "model": model_cfg, "optimizer_groups": DECAY_POLICY},
            budget=matched.budget(kind, shape_flops(build_model(kind)), reference_flops) if matched else None,
        )
        summary = {c: summarize_curves([r[c] for r in records]) for c in curves}
        summary["final_train_loss"] = summarize([r["final_train_loss"] for r in records])
        summary["train_seconds"] = summarize([r["train_seconds"] for r in records])
        if evaluate is not None:
            summary["learning_curve"] = learning_curve([r["evals"] for r in records], same_steps=matched is None)
        if matched:
            matched.add(kind, records)
            summary["compute"] = compute_summary(records)
        results[kind] = {"label": CORE_LABELS[kind], "model_config": model_cfg, "seeds": records,
                         "summary": summary}
        extra = {"compute_match": matched.describe()} if matched else {}
        record = results_record(name, preset.name, settings, results, paper_budget=paper_budget,
                                complete=kind == models[-1], **extra)
        if out_dir:
            write_record(os.path.join(out_dir, f"{name}.json"), record, seeds=range(preset.seeds),
                         wall_seconds=time.perf_counter() - started, optimizer_groups=DECAY_POLICY)
            plot(record, os.path.join(out_dir, f"{name}.png"))
    return record


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (a tensor, or tuples, lists, dicts and dataclasses of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(v) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_tensor_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


def learning_curve(evals_per_seed: Sequence[Sequence[dict]], *, same_steps: bool = True) -> dict:
    """Mean ± std over seeds of every periodic-evaluation number: ``{"step": [...], name: {"mean", "std"}}``.

    ``same_steps=False`` (compute-matched seeds, which train for different numbers of steps and are evaluated at
    the same fractions of their runs): the seeds need only be evaluated as often; ``"step"`` is then the mean
    over seeds (rounded) and ``"steps_by_seed"`` each seed's steps."""
    steps = [[e["step"] for e in evals] for evals in evals_per_seed]
    if not steps or not steps[0] or any((s != steps[0]) if same_steps else (len(s) != len(steps[0])) for s in steps):
        raise ValueError(f"every seed must be evaluated at the same (non-empty) steps"
                         f"{'' if same_steps else ' count'}, got {steps}")
    names = [k for k in evals_per_seed[0][0] if k != "step"]
    curve = {"step": steps[0]}
    if any(s != steps[0] for s in steps):
        curve = {"step": [round(sum(col) / len(col)) for col in zip(*steps, strict=True)], "steps_by_seed": steps}
    return {**curve, **{k: summarize_curves([[e[k] for e in evals] for evals in evals_per_seed]) for k in names}}


def preset_from_args(presets: dict, args):
    """The chosen preset with any positive ``--steps/--batch-size/--seeds`` override applied."""
    preset = presets[args.preset]
    over = {k: v for k, v in (("steps", args.steps), ("batch_size", args.batch_size), ("seeds", args.seeds))
            if v is not None}
    for k, v in over.items():
        if v <= 0:
            raise ValueError(f"--{k.replace('_', '-')} must be positive, got {v}")
    return replace(preset, **over, name=preset.name if not over else f"{preset.name}-custom")


def print_summary_table(record: dict, key: str, xs: Sequence, x_label: str, x_fmt: str, title: str) -> None:
    """One ``mean ± std`` row per swept value, one column per model, from ``record['models']``."""
    names = list(record["models"])
    print(f"\n{title}")
    print(f"{x_label:<7}" + "".join(f"{record['models'][k]['label']:>16}" for k in names))
    for i, x in enumerate(xs):
        row = "".join(f"{s['mean'][i]:>9.3f} ± {s['std'][i]:.3f}"
                      for s in (record["models"][k]["summary"][key] for k in names))
        print(f"{x:<7{x_fmt}}{row}")


def models_for_core(models: Sequence[str], core: str) -> tuple[str, ...]:
    """The model kinds ``--models`` names under ``--core``: ``ours`` keeps them, ``paper`` maps each to its
    paper core (``bayesian`` → ``bayesian_paper``, ``delta`` → ``delta_paper``; other models have none)."""
    if core not in CORES:
        raise ValueError(f"--core must be one of {CORES}, got {core!r}")
    if core == "ours":
        return tuple(models)
    try:
        return tuple(paper_core_kind(m) for m in models)
    except ValueError as err:
        raise ValueError(f"{err}; pass --models bayesian delta (or one of them) with --core paper") from None


def config_from_args(args, *, presets: dict, config_type: type[CoreRunConfig]) -> CoreRunConfig:
    """The run config that ``bayeslayer recall|crowding`` arguments name (``--out`` checked first)."""
    check_out_dir(args.out)
    return config_type(preset=preset_from_args(presets, args), models=models_for_core(args.models, args.core),
                       out=args.out,
                       progress=not args.no_progress, checkpoint_every=args.checkpoint_every,
                       device=args.device, compute_match=args.compute_match)


def run_command(args, *, name: str, presets: dict, paper_budget: str, config_type: type[CoreRunConfig],
                run: Callable, plot: Callable, print_table: Callable) -> int:
    """``--plot-only`` redraws from ``<out>/<name>.json``; otherwise run the config the arguments name
    (``run(config) -> record``), print the table, say where files went.  ``--out`` and the overrides are
    checked before any training."""
    out_dir = check_out_dir(args.out)
    if args.plot_only:
        with lock_output(out_dir):  # a redraw writes into --out too: one writer per output folder
            record = plot_only_json(out_dir, name, experiment=name)
            out = os.path.join(out_dir, f"{name}.png")
            with redrawing(os.path.join(out_dir, f"{name}.json")):
                plot(record, out)
                print_table(record)
        print(f"\nredrew {out}")
        return 0
    config = config_from_args(args, presets=presets, config_type=config_type)
    preset = config.preset
    budget = f"{preset.steps} steps, batch {preset.batch_size}, {preset.seeds} seed(s)"
    if preset.name == "paper":
        print(f"{name}: paper budget ({paper_budget})")
    else:
        print(f"{name}: preset '{preset.name}' = {budget}; a CPU-sized run of the same task, NOT the "
              f"paper's budget ({paper_budget}); use --preset paper for that")
    if config.compute_match != "steps":
        print(f"{name}: --compute-match {config.compute_match}: every model trains on the {config.compute_match} "
              f"budget of {config.reference()}'s {preset.steps}-step run (its steps and schedule stretched to it)")
    runs = os.path.join(args.out, "runs")
    every = f"every {config.checkpoint_every} steps and " if config.checkpoint_every else ""
    print(f"{name}: finished seeds and checkpoints ({every}on Ctrl-C) go to {runs}; if the run stops, "
          "rerun the same command to resume from there", flush=True)
    record = run(config)
    print_table(record)
    print(f"\nwrote {os.path.join(args.out, name + '.json')} and {name}.png")
    return 0


def add_command(sub, *, name: str, help: str, doc: str, presets: dict, paper_budget: str,
                config_type: type[CoreRunConfig], run: Callable, plot: Callable, print_table: Callable) -> None:
    """Register ``bayeslayer <name>``, run by :func:`run_command` with these arguments: ``doc`` is its one-paragraph
    ``--help`` description."""
    p = sub.add_parser(name, help=help, description=doc)
    p.add_argument("--preset", choices=sorted(presets), default="default",
                   help=f"'paper' = {paper_budget}; 'default' ≈ 15 min on a 2-core CPU; 'tiny' = smoke test")
    p.add_argument("--models", nargs="+", choices=ALL_KINDS, default=list(CORE_KINDS), metavar="MODEL",
                   help=f"models to train, of {', '.join(ALL_KINDS)} (default: the four of the paper, "
                        f"{' '.join(CORE_KINDS)}; gated_deltanet is the Delta core with GDN's learned scalar decay; "
                        "bayesian_lowrank<r> is the low-rank-plus-diagonal BL of rank r)")
    for option, field, what in (("--steps", "steps", "training steps"), ("--batch-size", "batch_size", "batch size"),
                                ("--seeds", "seeds", "number of seeds")):
        p.add_argument(option, type=positive_int_arg, default=None, help=override_help(presets, field, what))
    p.add_argument("--device", type=device_arg, default="cpu", help=DEVICE_HELP)
    add_threads_option(p, SMALL)
    p.add_argument("--out", default=f"runs/{name}", help="output directory (JSON, PNG, per-seed cache)")
    p.add_argument("--checkpoint-every", type=nonnegative_int_arg, default=CHECKPOINT_EVERY, metavar="N",
                   help=f"checkpoint the seed in training every N steps under OUT/runs, so a killed run resumes "
                        f"where it stopped (default {CHECKPOINT_EVERY}; 0: only on Ctrl-C); the results do not "
                        "depend on it")
    p.add_argument("--core", choices=CORES, default="ours",
                   help="'ours' (default): BL's noise and Delta's gain learned per token from the residual stream; "
                        "'paper': the paper's cores, one learnable scalar per head for BL's r² and ℓ² and for the "
                        "reset (Delta) core's r² with its ℓ² fixed at 0.05 (models bayesian and delta only; "
                        f"trained as {' and '.join(PAPER_CORE_KINDS.values())})")
    p.add_argument("--compute-match", choices=MODES, default="steps",
                   help=COMPUTE_MATCH_HELP.format(reference="the BL core (bayesian, or bayesian_paper with --core "
                                                            "paper)"))
    p.add_argument("--plot-only", action="store_true", help=PLOT_ONLY_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=functools.partial(run_command, name=name, presets=presets, paper_budget=paper_budget,
                                          config_type=config_type, run=run, plot=plot, print_table=print_table))
