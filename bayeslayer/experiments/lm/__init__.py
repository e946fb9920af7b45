"""``bayeslayer lm``: from-scratch language modelling with AR-hit evaluation (docs/theory.md §8.5).

``bayeslayer lm train`` trains a :class:`~bayeslayer.models.BayesLayerForCausalLM` (any mixer of
:data:`bayeslayer.layers.MIXERS`) on packed windows of a text corpus (:mod:`bayeslayer.data.text`);
``bayeslayer lm eval`` measures perplexity over all tokens, AR-hit tokens, the other tokens and
AR-hit tokens per distance bucket (:mod:`bayeslayer.data.arhit`), mean ± std over seeds, and
writes a Table-2-layout markdown table and a bar plot, both drawn from the saved JSON.

What one optimiser step does and how the data position follows the step: :mod:`bayeslayer.training.lm`;
the run directory (``--out``), its crash-safe checkpoints and the distributed launch (``torchrun``):
:mod:`bayeslayer.experiments.common.lm_run`, which ``distill train`` trains with too.  The run's
configuration: :class:`~bayeslayer.training.lm_config.LMConfig`; ``lm eval``'s evaluation of one run (kept
under its ``--out``): :mod:`bayeslayer.experiments.lm.evaluation`; its record, table and figure:
:mod:`bayeslayer.experiments.lm.report`.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ...checks import check_int
from ...data.text.sources import SOURCE_HELP, WIKITEXT_103
from ...errors import UsageError
from ...files import atomic_write_text
from ...training import lock_output
from ...training.compute_match import COMPUTE_MATCH_HELP, MODES
from ...training.distributed import PRECISIONS, resolve_device
from ...training.lm import build_model, load_corpus
from ...training.lm_config import LM_TRAIN, MATCHES, LMConfig, LMDataConfig, LMModelConfig
from ..common.cli_help import override_help, preset_values
from ..common.lm_compute import calibration, plan_run, read_reference_seconds
from ..common.lm_run import train_lm
from ..common.options import (
    DEVICE_HELP,
    PLOT_ONLY_HELP,
    add_sharding_options,
    add_train_eval,
    cache_dir_arg,
    check_file_name,
    check_in_dir,
    check_memory,
    check_out_dir,
    check_source,
    check_tokenizer,
    device_arg,
    int_arg,
    parse_json_object,
    plot_only_json,
    positive_int_arg,
    redrawing,
)
from ..common.threads import SMALL, TORCH_DEFAULT, add_threads_option
from .evaluation import evaluate_run, trained_with
from .report import GROUP_LABELS, GROUPS, bar_plot, markdown_table, summarize_runs, table, write_report

DESCRIPTION = (
    "Train language models from scratch (lm train) and compare finished runs by "
    "perplexity over all tokens, over AR-hit tokens (a bigram seen earlier in the "
    "window) and over the rest (lm eval). Held-out perplexity per window length is "
    "bayeslayer heldout. The training loop, run folder and resume rules: python -m "
    "pydoc bayeslayer.experiments.lm."
)
TRAIN_DESCRIPTION = (
    "Train a BayesLayerForCausalLM; rerun the same command to resume. "
    "Distributed: torchrun --nproc_per_node N -m bayeslayer.cli lm train ..."
)
EVAL_DESCRIPTION = (
    "Table 2: evaluate finished runs; runs sharing a label (default: the mixer) "
    "are seeds of one model. Writes <out>/<name>.json, .md, .png and keeps each "
    "run's evaluation in <out>/<run folder name>/ (the runs are only read). Held-out PPL "
    "per length (Table 7, formerly `lm eval --lengths ...`) is `bayeslayer heldout`."
)

# --------------------------------------------------------------------------- configuration


PRESETS: dict[str, LMConfig] = {
    # docs/theory.md §8.5: width 512, 4 layers, 4 heads × 128, 7,935 steps × 65,536 tokens (520M), length
    # 2,048, lr 6e-4, MLP dropout 0.4, WikiText-103 with a 32k BPE.  Betas, weight decay, warmup
    # and the final lr ratio are not in the paper: flash-linear-attention's usual values (LM_TRAIN).
    "paper": LMConfig(preset="paper", micro_batch_size=8, eval_windows=64,
                      model=LMModelConfig(hidden_size=512, num_layers=4, num_heads=4, head_dim=128, mlp_dropout=0.4),
                      data=LMDataConfig(source=WIKITEXT_103, vocab_size=32000, seq_len=2048),
                      train=replace(LM_TRAIN, steps=7935, batch_size=32, lr=6e-4, warmup_steps=400, eval_every=500,
                                    checkpoint_every=250)),
    # Sized from tokens/s measured on the 2-core CPU (docs/experiments.md, lm section): about
    # 30 minutes each for BL and GDN on an idle machine, ~1 epoch of the python3-doc corpus
    # (1.79M train tokens with the 8k BPE).  Length 1,024 covers every AR-hit distance bucket.
    "cpu": LMConfig(preset="cpu", micro_batch_size=4, eval_windows=16,
                    model=LMModelConfig(hidden_size=256, num_layers=4, num_heads=4, head_dim=64, mlp_dropout=0.1),
                    data=LMDataConfig(source="python-docs", vocab_size=8192, seq_len=1024),
                    train=replace(LM_TRAIN, steps=200, batch_size=8, lr=1e-3, warmup_steps=20, eval_every=50,
                                  checkpoint_every=25)),
    # A smoke test: seconds on any machine, on the corpus every Python installation has.
    "tiny": LMConfig(preset="tiny", micro_batch_size=2, eval_windows=4, log_every=5,
                     model=LMModelConfig(hidden_size=64, num_layers=2, num_heads=2, head_dim=16, mlp_dropout=0.0),
                     data=LMDataConfig(source="python-docstrings", vocab_size=8192, seq_len=128),
                     train=replace(LM_TRAIN, steps=20, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=10,
                                   checkpoint_every=10)),
}

PRESET_HELP = (  # bayeslayer lm train --preset
    "'paper' = the paper's settings (docs/theory.md §8.5; WikiText-103, 520M tokens); "
    "'cpu' ≈ 30 min per model on an idle "
    "2-core CPU on the python-docs corpus; 'tiny' = a smoke test of seconds on the "
    "python-docstrings corpus, which every Python installation has"
)


# --------------------------------------------------------------------------- command line


def config_from_args(args: argparse.Namespace) -> LMConfig:
    """The preset named by ``--preset`` with the command line's overrides applied."""
    config = PRESETS[args.preset]
    overrides = {name: getattr(args, name) for name in (
        "mixer", "label", "seed", "steps", "batch_size", "micro_batch_size", "seq_len", "lr", "warmup_steps",
        "mlp_dropout", "hidden_size", "num_layers", "num_heads", "head_dim", "source", "tokenizer",
        "vocab_size", "precision", "eval_every", "eval_windows", "checkpoint_every", "log_every", "match",
        "compute_match") if getattr(args, name, None) is not None}
    if args.mixer_kwargs is not None:
        overrides["mixer_kwargs"] = parse_json_object("--mixer-kwargs", args.mixer_kwargs)
    return replace(config, **overrides)


def match_arg(text: str) -> str:
    """``--match``: one of :data:`~bayeslayer.training.lm_config.MATCHES` (argparse reports the
    error as a one-line usage error)."""
    if text not in MATCHES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(MATCHES)}, got {text!r}")
    return text


def check_mixer_kwargs(mixer: str, kwargs: dict, *, hidden_size: int, num_heads: int, head_dim: int,
                       option: str = "--mixer-kwargs") -> None:
    """Build one ``mixer`` layer with ``kwargs`` so a misspelt or out-of-range argument fails now, not
    after the corpus is tokenized (on the ``meta`` device: no memory is allocated, whatever the sizes)."""
    from ...layers import build_mixer

    try:
        with torch.device("meta"):
            build_mixer(mixer, hidden_size, num_heads=num_heads, head_dim=head_dim, layer_idx=0, **kwargs)
    except (TypeError, ValueError) as err:  # an unknown keyword is a TypeError of the constructor
        raise UsageError(f"{option} {json.dumps(kwargs)}: {' '.join(str(err).split())}") from None


def training_memory(config: LMConfig, shards: int = 1) -> int:
    """A lower bound of the bytes one rank needs to train ``config``: weights, gradients and AdamW's two
    moments (16 bytes per fp32 parameter, counted on the ``meta`` device, which allocates nothing; ``/ shards``
    when FSDP shards them over that many ranks) and the logits of one micro-batch."""
    shards = check_int("shards", shards, minimum=1)
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(config, config.vocab_size).parameters())
    return 16 * params // shards + 4 * config.micro_batch_size * config.seq_len * config.vocab_size


def check_train_args(config: LMConfig, args: argparse.Namespace, out: str) -> None:
    """What ``lm train`` can check before it tokenizes a corpus or writes a file."""
    check_out_dir(out)
    check_source(config.source)
    if config.tokenizer is not None:
        check_tokenizer(config.tokenizer)
    check_mixer_kwargs(config.mixer, config.mixer_kwargs, hidden_size=config.hidden_size,
                       num_heads=config.num_heads, head_dim=config.head_dim)
    sizes = (f"hidden-size {config.hidden_size}, {config.num_layers} layers, {config.num_heads} heads of "
             f"head-dim {config.head_dim}, vocab-size {config.vocab_size}")
    shards = int(os.environ.get("WORLD_SIZE", "1")) if getattr(args, "shard", "none") == "fsdp" else 1
    check_memory(training_memory(config, max(1, shards)), what=f"training a model of {sizes}",
                 device=resolve_device(args.device))


def match_compute(config: LMConfig, args: argparse.Namespace, out: str) -> tuple[LMConfig, dict | None]:
    """``--compute-match flops|time``: the run's steps from the reference BL run's FLOPs or CPU time
    (:mod:`~bayeslayer.experiments.common.lm_compute`); ``(config, None)`` for ``steps``."""
    if config.compute_match == "steps":
        if args.reference_run is not None:
            raise UsageError("--reference-run gives the budget of --compute-match time; this run matches steps")
        return config, None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--compute-match flops|time plans the run in one process; run it without torchrun")
    seconds = None
    if config.compute_match == "time":
        if args.reference_run is None:
            raise UsageError("--compute-match time needs --reference-run DIR: the finished BL run whose CPU time is "
                             "the budget")
        seconds = read_reference_seconds(check_in_dir(args.reference_run, option="--reference-run",
                                                      what="run directory"), config)
    elif args.reference_run is not None:
        raise UsageError("--reference-run gives the budget of --compute-match time; flops counts the reference")
    device = resolve_device(args.device)
    corpus = load_corpus(config, cache_dir=args.cache_dir, splits=("train",))
    Path(out).mkdir(parents=True, exist_ok=True)
    return plan_run(config, out, vocab_size=corpus.vocab_size, reference_seconds=seconds,
                    calibrate=lambda: calibration(config, corpus, device))


def _train_main(args) -> int:
    config = config_from_args(args)
    stem = f"{config.preset}-state" if config.model.match == "state" else config.preset
    if config.compute_match != "steps":
        stem += f"-{config.compute_match}"
    out = args.out or os.path.join("runs", "lm", f"{stem}-{config.mixer}-seed{config.seed}")
    check_train_args(config, args, out)
    config, compute = match_compute(config, args, out)
    result = train_lm(config, out, device=args.device, cache_dir=args.cache_dir, stop_after=args.stop_after,
                      progress=not args.no_progress, keep_checkpoints=args.keep_checkpoints,
                      context_parallel=args.context_parallel, compute=compute, shard=args.shard,
                      activation_checkpointing=args.activation_checkpointing)
    if int(os.environ.get("RANK", "0")) == 0:
        state = "finished" if result.finished else f"stopped at step {result.step}/{config.steps}"
        print(f"lm train {config.model_label} seed {config.seed}: {state}; {result.tokens:,} tokens, "
              f"{result.tokens_per_second:,.0f} tokens/s this session; run dir {out}")
        if result.summary.get("validation"):
            v = result.summary["validation"]
            print("validation PPL: " + ", ".join(f"{GROUP_LABELS[g]} {v[g]['ppl']:.2f}" for g in GROUPS
                                                 if v.get(g, {}).get("ppl") is not None))
    if dist.is_initialized():
        dist.barrier()  # every rank is done (rank 0 wrote and printed) before any tears the group down
        dist.destroy_process_group()
    return 0


def _eval_main(args) -> int:
    out_dir = check_out_dir(args.out)
    check_file_name(args.name)
    # two evaluations into one folder would overwrite each other's files: one writer (rank 0) per folder;
    # a refused command leaves no folder behind
    with lock_output(out_dir):
        return _eval_locked(args, out_dir)


def _eval_locked(args, out_dir: Path) -> int:
    if args.plot_only:
        if args.runs:
            raise UsageError(f"--plot-only redraws from {out_dir / (args.name + '.json')}; it takes no run "
                             f"directories (got {args.runs})")
        record = plot_only_json(out_dir, args.name, experiment="lm")
        with redrawing(out_dir / f"{args.name}.json"):
            atomic_write_text(out_dir / f"{args.name}.md", markdown_table(record))
            bar_plot(record, out_dir / f"{args.name}.png")
            print(markdown_table(record))
        print(f"redrew {out_dir / (args.name + '.md')} and {args.name}.png")
        return 0
    if not args.runs:
        raise UsageError("give at least one run directory (or --plot-only to redraw from --out)")
    from ...models.loading import refuse_pickle_weights

    names: dict[str, tuple[str, str]] = {}
    for run in args.runs:  # every run must be finished before the first is evaluated
        path = os.path.abspath(run)
        first, seen = names.setdefault(Path(path).name, (run, path))  # its evaluation is kept in <out>/<name>/
        if seen != path:
            raise UsageError(f"runs {first} and {run} have the same folder name {Path(path).name!r}, under "
                             f"which {out_dir} keeps each run's evaluation; rename one of them")
        final = check_in_dir(run, option="run", what="run directory") / "final"
        refuse_pickle_weights(final)
        if not (final / "model.safetensors").is_file() or not (final / "lm_config.json").is_file():
            raise UsageError(f"run {run} has no finished model (final/model.safetensors and "
                             "final/lm_config.json); train it to the end first")
    records = []
    for run in args.runs:
        rec = evaluate_run(run, split=args.split, seq_len=args.seq_len, batch_size=args.batch_size,
                           device=args.device, precision=args.precision, cache_dir=args.cache_dir, out=out_dir)
        if args.label:
            rec = {**rec, "label": args.label}
        records.append(rec)
    record = summarize_runs(records)
    paths = write_report(record, args.out, args.name)
    print(markdown_table(record))
    print(f"wrote {paths['json']}, {paths['table']}, {paths['plot']}")
    return 0


def _train_threads(args: argparse.Namespace) -> int:
    """``lm train``'s thread default: one thread for the tiny preset's small matrices, else PyTorch's."""
    return SMALL if args.preset == "tiny" else TORCH_DEFAULT


def add_parser(sub) -> None:
    t, e = add_train_eval(sub, "lm", help="language modelling with AR-hit evaluation (docs/theory.md §8.5)",
                          description=DESCRIPTION,
                          train=("train (or resume) one language model run", TRAIN_DESCRIPTION),
                          evaluate=("grouped PPL of finished runs (Table 2)", EVAL_DESCRIPTION),
                          presets=PRESETS, preset_help=PRESET_HELP)
    t.add_argument("--mixer", help="token mixer of every layer (bayesian, gated_deltanet, mamba2, ...) "
                                   f"(default: {PRESETS['cpu'].mixer})")
    t.add_argument("--mixer-kwargs", help='JSON object of extra mixer arguments, e.g. \'{"p0": 1.0}\'')
    t.add_argument("--match", type=match_arg, default=None,
                   help="'params' (default): every mixer gets the preset's head shape, so BL (mean plus covariance) "
                        "carries more recurrent state than the others (1.5× Gated DeltaNet's); 'state': the "
                        "state-budget solver widens the mixer's value dim so its state equals the default BL's")
    t.add_argument("--compute-match", choices=MODES, default=None,
                   help=COMPUTE_MATCH_HELP.format(reference="BL run (the same preset with mixer bayesian)")
                   + "; time needs --reference-run. Not --match, which says what the mixers' shapes share")
    t.add_argument("--reference-run", default=None, metavar="DIR",
                   help="--compute-match time: the finished BL run whose CPU time of its steps is the budget")
    t.add_argument("--label", help="the model's name in tables (default: from the mixer)")
    t.add_argument("--seed", type=int_arg, help=f"random seed (default: {PRESETS['cpu'].seed})")
    for name, kind, what in (
            ("steps", int_arg, "optimiser steps"), ("batch-size", int_arg, "windows per optimiser step"),
            ("micro-batch-size", int_arg, "windows per forward pass"), ("seq-len", int_arg, "window length in tokens"),
            ("lr", float, "peak learning rate"), ("warmup-steps", int_arg, "learning-rate warmup steps"),
            ("mlp-dropout", float, "dropout in the MLPs"), ("hidden-size", int_arg, "model width"),
            ("num-layers", int_arg, "blocks"), ("num-heads", int_arg, "heads per mixer"),
            ("head-dim", int_arg, "head dimension"),
            ("vocab-size", int_arg, "size of the BPE trained when no --tokenizer is given"),
            ("eval-every", int_arg, "steps between validation evaluations"),
            ("eval-windows", int_arg, "validation windows per periodic evaluation (0: all)"),
            ("checkpoint-every", int_arg, "steps between checkpoints"),
            ("log-every", int_arg, "steps between log lines")):
        t.add_argument(f"--{name}", type=kind, help=override_help(PRESETS, name.replace("-", "_"), what))
    t.add_argument("--source", help=f"corpus: {SOURCE_HELP} (default: the preset's: "
                                    f"{preset_values(PRESETS, 'source')})")
    t.add_argument("--tokenizer", help="tokenizer.json (or a directory holding one); default: train a BPE")
    t.add_argument("--precision", choices=PRECISIONS, help="autocast: auto = bf16 on a capable GPU, else fp32")
    t.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    t.add_argument("--context-parallel", type=positive_int_arg, default=1, metavar="C",
                   help="split every window along T over C consecutive ranks of the torchrun job (default 1: "
                        "none); the groups are data-parallel replicas. Only Bayesian Layers with a dense "
                        "covariance have a context-parallel path (docs/context_parallel.md)")
    add_sharding_options(t)
    t.add_argument("--cache-dir", type=cache_dir_arg, default=None,
                       help="token cache directory (default $BAYESLAYER_CACHE)")
    t.add_argument("--out", default=None, help="run directory (default runs/lm/<preset>-<mixer>-seed<seed>)")
    t.add_argument("--stop-after", type=positive_int_arg, default=None,
                   help="stop (checkpointed) after this many total steps")
    t.add_argument("--keep-checkpoints", type=positive_int_arg, default=1, help="newest step checkpoints to keep")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_threads_option(t, _train_threads, default_text="1 with --preset tiny (small matrices), else PyTorch's")
    t.set_defaults(func=_train_main)

    e.add_argument("runs", nargs="*", help="run directories (each with final/)")
    e.add_argument("--split", choices=("validation", "test"), default="test")
    e.add_argument("--seq-len", type=positive_int_arg, default=None,
                   help="window length (default: each run's training length)")
    e.add_argument("--batch-size", type=positive_int_arg, default=4)
    e.add_argument("--precision", choices=PRECISIONS, default="fp32")
    e.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    e.add_argument("--cache-dir", type=cache_dir_arg, default=None)
    e.add_argument("--label", default=None, help="override the model label of every run given")
    e.add_argument("--out", default=os.path.join("runs", "lm-eval"),
                   help="output directory: <name>.json, .md, .png and each run's evaluation in <run folder name>/")
    e.add_argument("--name", default="lm", help="file name stem of the outputs")
    e.add_argument("--plot-only", action="store_true", help=PLOT_ONLY_HELP + " (<out>/<name>.json)")
    add_threads_option(e, TORCH_DEFAULT)
    e.set_defaults(func=_eval_main)


__all__ = ["GROUPS", "GROUP_LABELS", "PRESETS", "add_parser", "bar_plot", "config_from_args", "evaluate_run",
           "markdown_table", "summarize_runs", "table", "trained_with", "write_report"]
