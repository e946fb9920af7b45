"""``bayeslayer distill``: retrofit a pretrained Gated DeltaNet with Bayesian Layers (docs/theory.md §8.6).

The teacher is a Gated DeltaNet language model (a flash-linear-attention checkpoint such as
``linear-moe-hub/Gated-Deltanet-340M``, or one of our own ``BayesLayerForCausalLM`` directories
with ``gated_deltanet`` mixers, e.g. the ``final/`` of ``bayeslayer lm train --mixer
gated_deltanet``).  The student is the teacher with layers ``L`` (default {5, 11, 17, 23})
swapped for Bayesian Layers by :func:`bayeslayer.models.replace_layers`, which copies every
projection the two layers share.  Three runs, each an ordinary :func:`~bayeslayer.experiments.common.lm_run.train_lm`
run (same loop, checkpoints, exact resume, JSON log, ``torchrun``) with its own
:class:`~bayeslayer.training.lm.Objective`:

``phase_a``  layer matching, all replaced layers at once.  The teacher runs on the batch; each
             student mixer gets the teacher's input to that layer and must reproduce the teacher
             mixer's output: ``loss = mean_l [NMSE_l + 0.05 (1 − cos_l)]``
             (:func:`~bayeslayer.training.distillation.layer_matching_loss`).  Trainable:
             the replaced mixers (BL recurrence, old and new projections, output gate).
``phase_b``  joint training from ``phase_a/final``: ``w_kl · KL(p_teacher ‖ p_student) + w_mse ·
             mean_l NMSE_l`` on full forward passes, ``(w_kl, w_mse) = (0.8, 0.2)`` for the first
             ``switch_fraction`` of the steps, then ``(0.9, 0.1)``.  Trainable: the replaced
             mixers, plus ``mlp_parts`` of the same layers' MLPs at ``mlp_lr_scale × lr``.
``gdn_ft``   the control: the unmodified teacher with the same trainable set (its GDN mixers at
             the same layers, the same MLP parts), the same number of tokens as Phase A + Phase B,
             plain next-token cross-entropy.

Everything outside the trainable set is frozen (``requires_grad=False``), fingerprinted before
training and checked bit for bit afterwards; ``train_summary.json`` of each run records the
counts (``frozen_unchanged``, ``trainable_changed``).  Dropout is switched off in student and
control (the teacher is a fixed target; the paper states no dropout for the retrofit).

Layout of ``--out``::

    phase_a/  phase_b/  gdn_ft/         lm run directories (config.json, objective.json, log.jsonl,
                                        checkpoints/, final/ with tokenizer.json, train_summary.json)
    distill.json                        the DistillConfig and each stage's summary
    eval/niah/  eval/heldout/           ``bayeslayer distill eval`` (NIAH and held-out PPL)

Rerunning the same command resumes: finished stages are skipped, an interrupted one continues
from its last checkpoint.  Multi-GPU: ``torchrun --nproc_per_node 8 -m bayeslayer.cli distill
train --preset paper``.

The paper gives token budgets (≈100M / ≈300M), length 2,048 and the loss weights; it does not
give learning rates, warm-up, batch size or which MLP parts train.  The ``paper`` preset fills
them with our choices (marked in :mod:`bayeslayer.experiments.distill.config`); the ``cpu`` preset is a
pipeline check, not a result.
"""

from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import replace
from pathlib import Path

from ...errors import UsageError
from ...files import read_json
from ...models.fla_import import hub_id
from ...training import lock_output
from ...training.distillation import (
    STAGES,
    load_teacher,
    resolve_teacher,
    teacher_config,
    teacher_tokenizer,
)
from ...training.distributed import PRECISIONS
from ...training.parallel import check_shard
from ..common.heldout_run import HeldoutConfig
from ..common.heldout_run import run as run_heldout
from ..common.lm_run import train_lm
from ..common.niah_run import NiahConfig
from ..common.niah_run import run as run_niah
from ..common.options import (
    DEVICE_HELP,
    add_sharding_options,
    add_train_eval,
    cache_dir_arg,
    check_in_dir,
    check_out_dir,
    check_source,
    check_tokenizer,
    device_arg,
    list_arg,
    parse_json_object,
    positive_int_arg,
)
from ..common.threads import TORCH_DEFAULT, add_threads_option
from .config import PRESET_HELP, PRESETS, DistillConfig, stage_config, stage_objective
from .tables import table

DESCRIPTION = (
    "Retrofit a pretrained Gated DeltaNet language model: swap some of its layers "
    "for Bayesian Layers, train them to match the teacher's layers (Phase A), then "
    "the whole model against the teacher's outputs (Phase B), beside a control that "
    "fine-tunes the unmodified teacher on the same tokens (distill train); then "
    "compare the three by needle-in-a-haystack recall and held-out perplexity "
    "(distill eval). The phases and their losses: python -m pydoc "
    "bayeslayer.experiments.distill."
)
TRAIN_DESCRIPTION = (
    "Run Phase A, Phase B and the GDN-FT control (or the --stages named) into "
    "--out; rerun the same command to resume where it stopped."
)
EVAL_DESCRIPTION = (
    "Evaluate the teacher (GDN-zero), the GDN-FT control and the retrofitted "
    "model of a finished distill train folder by needle-in-a-haystack recall and "
    "held-out perplexity; writes the results into that folder."
)

# --------------------------------------------------------------------------- running the stages


def run_distill(
    config: DistillConfig,
    out: str | os.PathLike,
    *,
    stages: tuple[str, ...] = STAGES,
    device: str = "auto",
    cache_dir: str | None = None,
    progress: bool = True,
    stop_after: int | None = None,
    shard: str = "none",
    activation_checkpointing: bool = False,
) -> dict:
    """Train the chosen stages in order (resuming each); write ``<out>/distill.json``.

    ``shard="fsdp"`` shards the student and the teacher with FSDP2 in Phase B and the GDN-FT control
    (:func:`~bayeslayer.experiments.common.lm_run.train_lm`); Phase A, which runs the student's replaced mixers
    outside the model's forward pass, runs with DDP.  ``activation_checkpointing``: every stage recomputes the
    student's blocks in the backward pass.

    ``stop_after`` interrupts the first unfinished stage after that many of its steps (a
    checkpointed stop, as ``lm train --stop-after``).  Returns ``{"config", "stages": {stage:
    train_summary or {"stopped_at": step}}}``.
    """
    if not isinstance(config, DistillConfig):
        raise TypeError(f"config must be a DistillConfig, got {type(config).__name__}")
    if not config.teacher:
        raise ValueError("no teacher: pass --teacher (a Gated DeltaNet checkpoint directory or hub id)")
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        raise ValueError(f"stages must be a non-empty subset of {STAGES}, got {list(stages)}")
    out = Path(out)
    teacher_dir = resolve_teacher(config.teacher)
    teacher = teacher_config(teacher_dir)  # a damaged teacher folder the package wrote is named before any work
    tokenizer = teacher_tokenizer(teacher_dir, config.tokenizer)
    # loaded once on the CPU and dropped: a teacher with a missing tensor, NaN weights or a config that disagrees
    # with its weights is named before the output folder is made or any corpus is prepared
    load_teacher(teacher_dir)
    report: dict = {"config": config.to_json(), "teacher_dir": str(teacher_dir), "tokenizer": tokenizer,
                    "tokens": config.tokens, "stages": {}}
    # one writer per folder (each stage's folder is locked by train_lm as well)
    with lock_output(out, remove_if_unused=False):
        return _run_stages(config, out, report, stages=stages, teacher_dir=teacher_dir, teacher=teacher,
                           tokenizer=tokenizer, device=device, cache_dir=cache_dir, progress=progress,
                           stop_after=stop_after, shard=check_shard(shard),
                           activation_checkpointing=activation_checkpointing)


def _run_stages(config: DistillConfig, out: Path, report: dict, *, stages, teacher_dir: Path, teacher,
                tokenizer: str, device: str, cache_dir, progress: bool, stop_after, shard: str = "none",
                activation_checkpointing: bool = False) -> dict:
    summary_path = out / "distill.json"
    if summary_path.is_file():
        report["stages"] = read_json(summary_path, what="the distillation report").get("stages", {})
    for stage in [s for s in STAGES if s in stages]:
        init_dir = None
        if stage == "phase_b":
            init_dir = out / "phase_a" / "final"
            if not (init_dir / "model.safetensors").is_file():
                raise FileNotFoundError(f"phase_b starts from {init_dir}, which does not exist: run phase_a first")
        objective = stage_objective(config, stage, teacher_dir, init_dir)
        lm_config = stage_config(config, stage, teacher, tokenizer)
        run_dir = out / stage
        if (run_dir / "train_summary.json").is_file() and _final_intact(run_dir / "final"):
            report["stages"][stage] = read_json(run_dir / "train_summary.json", what="stage summary")
            continue
        result = train_lm(lm_config, run_dir, device=device, cache_dir=cache_dir, progress=progress,
                          objective=objective, stop_after=None if stop_after is None else min(stop_after,
                                                                                                lm_config.steps),
                          shard=shard if objective.shard_unsupported() is None else "none",
                          activation_checkpointing=activation_checkpointing)
        if not result.finished:
            report["stages"][stage] = {"stopped_at": result.step, "steps": lm_config.steps}
            _write_report(summary_path, report)
            return report
        report["stages"][stage] = result.summary
        _write_report(summary_path, report)
    return report


def _final_intact(final: Path) -> bool:
    """Whether a stage's ``final/`` is complete and verifies (else the stage is run again: its last
    checkpoint rewrites ``final/``)."""
    from ...models.loading import verify_model_dir

    if not (final / "model.safetensors").is_file():
        return False
    try:
        verify_model_dir(final)
    except ValueError as exc:
        warnings.warn(f"{exc}; rewriting {final} from the stage's last checkpoint", RuntimeWarning, stacklevel=2)
        return False
    return True


def _write_report(path: Path, report: dict) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        from ...training.optim import DECAY_POLICY
        from ..common.provenance import write_record

        stages = [s for s in report["stages"].values() if "train_seconds" in s]
        devices = {str(s.get("device", "cpu")) for s in stages} or {"cpu"}
        write_record(path, report, device=",".join(sorted(devices)), seeds=[report["config"]["seed"]],
                     wall_seconds=sum(s["train_seconds"] for s in stages), optimizer_groups=DECAY_POLICY)


# --------------------------------------------------------------------------- evaluation


def eval_models(out: str | os.PathLike) -> list[tuple[str, str]]:
    """``[(label, model dir)]`` of a distillation: the teacher (GDN-zero), GDN-FT and BL (Phase B),
    each only where it exists."""
    out = Path(out)
    report_path = out / "distill.json"
    if not report_path.is_file():
        raise FileNotFoundError(f"{report_path} does not exist: run `bayeslayer distill train --out {out}` first")
    report = read_json(report_path, what="the distillation report")
    models = [("GDN-zero", report["teacher_dir"])]
    for stage, label in (("gdn_ft", "GDN-FT"), ("phase_b", "BL")):
        final = out / stage / "final"
        if (final / "model.safetensors").is_file():
            models.append((label, str(final)))
    if len(models) == 1:
        raise FileNotFoundError(f"{out} has no finished student or control model (phase_b/final, gdn_ft/final)")
    return models


def eval_plan(args: argparse.Namespace) -> dict[str, dict]:
    """What ``bayeslayer distill eval`` runs: ``{"niah": fields of a NiahConfig, "heldout": fields of a
    HeldoutConfig}`` (each present unless skipped) for the models of the distillation in ``--out``: the NIAH and
    held-out runs that ``bayeslayer niah`` and ``bayeslayer heldout`` make (:mod:`~bayeslayer.experiments.common`'s
    ``niah_run`` and ``heldout_run``)."""
    out = check_in_dir(args.out, option="--out", what="distillation folder")
    check_out_dir(out / "eval")
    report = read_json(out / "distill.json", what="the distillation report") if (out / "distill.json").is_file() else {}
    models = eval_models(out)
    labels = [label for label, _ in models]
    tokenizer = args.tokenizer or report.get("tokenizer")
    plan: dict[str, dict] = {}
    if not args.skip_niah:
        optional = {"tasks": args.niah_tasks, "max_new_tokens": args.max_new_tokens}
        plan["niah"] = dict(
            models=models, out=str(out / "eval" / "niah"), tokenizer=tokenizer, lengths=args.niah_lengths,
            depths=args.niah_depths, samples_per_cell=args.samples_per_cell, seed=args.seed, haystack=args.haystack,
            device=args.device, quiet=args.quiet,
            diff=[("BL", other) for other in ("GDN-zero", "GDN-FT") if "BL" in labels and other in labels] or None,
            **{k: v for k, v in optional.items() if v})
    if not args.skip_ppl:
        plan["heldout"] = dict(
            models=models, sources=args.source or [report.get("config", {}).get("source", "python-docs")],
            lengths=args.ppl_lengths, split=args.split, reference="GDN-zero", tokenizer=tokenizer,
            windows="non-overlapping", max_windows=args.max_windows, device=args.device, cache_dir=args.cache_dir,
            out=str(out / "eval" / "heldout"))
    return plan


def _eval_main(args: argparse.Namespace) -> dict:
    """``bayeslayer distill eval``: the NIAH and held-out runs of :func:`eval_plan`;
    ``{"niah": ..., "heldout": ...}``."""
    plan = eval_plan(args)
    results: dict = {}
    with lock_output(args.out):  # it writes into the distillation folder: not while `distill train` does
        if "niah" in plan:
            results["niah"] = run_niah(NiahConfig(**plan["niah"]))
        if "heldout" in plan:
            results["heldout"] = run_heldout(HeldoutConfig(**plan["heldout"]))
    return results


# --------------------------------------------------------------------------- command line


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    """The preset named by ``--preset`` with the command line's overrides applied."""
    overrides = {name: getattr(args, name) for name in (
        "teacher", "layers", "source", "tokenizer", "seq_len", "batch_size", "micro_batch_size", "phase_a_steps",
        "phase_b_steps", "lr_a", "lr_b", "warmup_steps", "weight_decay", "mlp_parts", "mlp_lr_scale",
        "switch_fraction", "temperature", "precision", "eval_every", "eval_windows", "checkpoint_every",
        "log_every", "seed") if getattr(args, name, None) is not None}
    if args.mixer_kwargs is not None:
        overrides["mixer_kwargs"] = parse_json_object("--mixer-kwargs", args.mixer_kwargs)
    return replace(PRESETS[args.preset], **overrides)


def check_train_args(config: DistillConfig, out: str) -> None:
    """What ``distill train`` can check before it loads the teacher or writes a file."""
    if not config.teacher:
        raise UsageError("no teacher: pass --teacher (a Gated DeltaNet checkpoint directory or hub id)")
    check_out_dir(out)
    check_source(config.source)
    if config.tokenizer is not None:
        check_tokenizer(config.tokenizer)
    if hub_id(config.teacher) is None:
        resolve_teacher(config.teacher)  # a missing local folder fails here, at once (a hub id is fetched later)


def _train_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    config = config_from_args(args)
    out = args.out or os.path.join("runs", "distill", config.preset)
    check_train_args(config, out)
    report = run_distill(config, out, stages=args.stages, device=args.device, cache_dir=args.cache_dir,
                         progress=not args.no_progress, stop_after=args.stop_after, shard=args.shard,
                         activation_checkpointing=args.activation_checkpointing)
    if int(os.environ.get("RANK", "0")) == 0:
        for stage, summary in report["stages"].items():
            if "stopped_at" in summary:
                print(f"{stage}: stopped at step {summary['stopped_at']}/{summary['steps']} (rerun to resume)")
                continue
            v = summary.get("validation", {}).get("all", {})
            print(f"{stage}: {summary['steps']} steps, {summary['tokens']:,} tokens, validation PPL "
                  f"{v.get('ppl', float('nan')):.2f}; {summary['trainable_changed']}/"
                  f"{summary['trainable_parameters']} trainable tensors moved, "
                  f"{summary['frozen_parameters']} frozen ones unchanged")
        print(f"wrote {Path(out) / 'distill.json'}; evaluate with `bayeslayer distill eval --out {out}`")
    if dist.is_initialized():
        dist.barrier()  # every rank is done before any tears the group down
        dist.destroy_process_group()
    return 0


def add_parser(sub) -> None:
    t, e = add_train_eval(
        sub, "distill", help="retrofit a pretrained Gated DeltaNet with Bayesian Layers (docs/theory.md §8.6)",
        description=DESCRIPTION,
        train=("Phase A, Phase B and the GDN-FT control (rerun to resume)", TRAIN_DESCRIPTION),
        evaluate=("NIAH and held-out PPL of GDN-zero, GDN-FT and BL", EVAL_DESCRIPTION),
        presets=PRESETS, preset_help=PRESET_HELP)
    t.add_argument("--teacher", help="teacher: a Gated DeltaNet checkpoint directory, one of our model "
                                     "directories, or a hub id owner/name")
    t.add_argument("--layers", type=list_arg(int, "integers", allow_empty=True),
                   help="layers to swap, e.g. 5,11,17,23")
    t.add_argument("--stages", type=list_arg(str, "stages", choices=STAGES), default=STAGES,
                   help="subset of phase_a,phase_b,gdn_ft")
    t.add_argument("--mlp-parts", type=list_arg(str, "MLP parts", allow_empty=True),
                   help="MLP parts of the swapped layers to train in Phase B and GDN-FT "
                        "(gate_proj,up_proj,down_proj; '' for none)")
    t.add_argument("--mixer-kwargs", help="JSON object of Bayesian Layer arguments, e.g. '{\"p0\": 1.0}'")
    for name, kind in (("seq-len", int), ("batch-size", int), ("micro-batch-size", int), ("phase-a-steps", int),
                       ("phase-b-steps", int), ("lr-a", float), ("lr-b", float), ("warmup-steps", int),
                       ("weight-decay", float), ("mlp-lr-scale", float), ("switch-fraction", float),
                       ("temperature", float), ("eval-every", int), ("eval-windows", int),
                       ("checkpoint-every", int), ("log-every", int), ("seed", int)):
        t.add_argument(f"--{name}", type=kind, help="override the preset")
    t.add_argument("--source", help="corpus: python-docs, hf:<name>[:<config>] or a local path")
    t.add_argument("--tokenizer", help="tokenizer.json (default: the teacher's)")
    t.add_argument("--precision", choices=PRECISIONS)
    t.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    t.add_argument("--cache-dir", type=cache_dir_arg, default=None)
    t.add_argument("--out", default=None, help="output directory (default runs/distill/<preset>)")
    t.add_argument("--stop-after", type=positive_int_arg, default=None,
                   help="stop the current stage after this many steps")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_sharding_options(t, applies=" in Phase B and the GDN-FT control (Phase A runs with DDP)")
    add_threads_option(t, TORCH_DEFAULT)
    t.set_defaults(func=_train_main)

    e.add_argument("--out", required=True, help="the directory `distill train` wrote")
    e.add_argument("--niah-lengths", type=list_arg(int, "integers"), default="2048,4096,8192,16384")
    e.add_argument("--niah-depths", type=list_arg(float, "numbers"), default="0,10,20,30,40,50,60,70,80,90,100",
                   help="needle depths in percent")
    e.add_argument("--max-new-tokens", type=positive_int_arg, default=None,
                   help="NIAH answer budget (default: niah's)")
    e.add_argument("--niah-tasks", type=list_arg(str, "task names", allow_empty=True), default=None,
                   help="comma-separated NIAH tasks (default: all eight)")
    e.add_argument("--samples-per-cell", type=positive_int_arg, default=30)
    e.add_argument("--haystack", default="python-docs", help="corpus the essay haystacks come from")
    e.add_argument("--ppl-lengths", type=list_arg(int, "integers"), default="2048,4096,8192,16384")
    e.add_argument("--source", action="append", default=None, help="held-out corpus (repeatable; default: the "
                                                                     "distillation corpus)")
    e.add_argument("--split", default="test")
    e.add_argument("--max-windows", type=positive_int_arg, default=None, help="cap windows per corpus × length")
    e.add_argument("--tokenizer", default=None, help="default: the one the distillation used")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--cache-dir", type=cache_dir_arg, default=None,
                       help="token and held-out PPL cache (default $BAYESLAYER_CACHE)")
    e.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    e.add_argument("--skip-niah", action="store_true")
    e.add_argument("--skip-ppl", action="store_true")
    e.add_argument("--quiet", action="store_true", help="no per-cell progress lines")
    add_threads_option(e, TORCH_DEFAULT)
    e.set_defaults(func=_eval_main)


__all__ = ["PRESETS", "DistillConfig", "add_parser", "check_train_args", "config_from_args", "eval_models",
           "eval_plan", "run_distill", "stage_config", "stage_objective", "table"]
