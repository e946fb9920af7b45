"""``bayeslayer niah``: RULER needle-in-a-haystack evaluation (docs/theory.md §8.6).

The prompts come from :mod:`bayeslayer.data.niah`, the decoding and RULER's scoring from
:mod:`bayeslayer.evaluation.niah`; the run (its :class:`~bayeslayer.experiments.common.niah_run.NiahConfig`,
``niah.json``, the predictions, tables and figures) is the one ``distill eval`` shares,
:mod:`bayeslayer.experiments.common.niah_run`.  ``bayeslayer niah`` maps its options onto a ``NiahConfig``
(:func:`config_from_args`) and runs it; ``--plot-only`` redraws the tables and figures from ``niah.json``.
"""

from __future__ import annotations

import argparse

from ..data.niah import DEFAULT_MAX_NEW_TOKENS, TASKS
from ..evaluation.lengths import PAPER_LENGTHS
from ..evaluation.niah import DEFAULT_DEPTHS, SUMMARY_TASKS
from .common.niah_run import DTYPES, NiahConfig, redraw, run
from .common.options import (
    DEVICE_HELP,
    PLOT_ONLY_HELP,
    check_out_dir,
    device_arg,
    list_arg,
    model_arg,
    positive_int_arg,
)
from .common.threads import TORCH_DEFAULT, add_threads_option

DESCRIPTION = (
    "RULER's needle-in-a-haystack tasks: hide key-value needles at each depth of "
    "prompts of each length, decode greedily and score the fraction of needles "
    "recalled, per model, task, length and depth. Writes OUT/niah.json with every "
    "sample's score, markdown tables, a length plot and depth-by-length difference "
    "heatmaps drawn from it (--plot-only redraws them). Prompts and scoring: "
    "python -m pydoc bayeslayer.evaluation.niah."
)


def _parse_pair(text: str) -> tuple[str, str]:
    a, sep, b = text.partition(",")
    if not sep or not a or not b:
        raise argparse.ArgumentTypeError(f"--diff takes A,B (two model labels), got {text!r}")
    return a, b


def add_parser(sub) -> None:
    p = sub.add_parser("niah", help="RULER needle-in-a-haystack evaluation (docs/theory.md §8.6)",
                       description=DESCRIPTION)
    p.add_argument("--model", action="append", type=model_arg, default=[], metavar="[LABEL=]DIR",
                   help="a model directory (HF format or an fla Gated DeltaNet checkpoint); repeat for several")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or a directory holding one (default: each model's directory)")
    p.add_argument("--lengths", type=list_arg(int, "integers", allow_empty=True), default=list(PAPER_LENGTHS),
                   help="context lengths in tokens, prompt + answer budget (default 2048,4096,8192,16384)")
    p.add_argument("--depths", type=list_arg(float, "numbers", allow_empty=True), default=list(DEFAULT_DEPTHS),
                   help="needle depths in percent (default 0,10,...,100)")
    p.add_argument("--tasks", type=list_arg(str, "names", allow_empty=True), default=list(TASKS),
                   help="comma-separated tasks (default: all eight)")
    p.add_argument("--summary-tasks", type=list_arg(str, "names", allow_empty=True), default=list(SUMMARY_TASKS),
                   help="the tasks averaged in the summary (default: " + ",".join(SUMMARY_TASKS) + ")")
    p.add_argument("--samples-per-cell", type=positive_int_arg, default=30, help="samples per task × length × depth")
    p.add_argument("--max-new-tokens", type=positive_int_arg, default=DEFAULT_MAX_NEW_TOKENS,
                   help="greedy tokens generated per sample (RULER: 128)")
    p.add_argument("--haystack", default="python-docs",
                   help="essay source: 'python-docs', 'hf:<name>[:<config>]' or a text/HTML path")
    p.add_argument("--haystack-split", default="test", help="split of the haystack source to draw essays from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=positive_int_arg, default=1,
                   help="samples decoded together (one cell at a time)")
    p.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--diff", action="append", type=_parse_pair, default=None, metavar="A,B",
                   help="draw the heatmap of A − B (default: the first model minus each other)")
    p.add_argument("--out", default=NiahConfig.out, help="output directory")
    p.add_argument("--plot-only", action="store_true", help=PLOT_ONLY_HELP)
    p.add_argument("--quiet", action="store_true", help="no per-cell progress lines")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let a model folder whose config.json has auto_map run its own Python code (only for "
                        "folders you checked; off by default, such a folder is refused)")
    add_threads_option(p, TORCH_DEFAULT)
    p.set_defaults(func=_main)


def config_from_args(args: argparse.Namespace) -> NiahConfig:
    """The :class:`NiahConfig` of ``bayeslayer niah``'s parsed arguments (each option is the field of its name)."""
    return NiahConfig(
        models=args.model, out=args.out, tokenizer=args.tokenizer, lengths=args.lengths, depths=args.depths,
        tasks=args.tasks, summary_tasks=args.summary_tasks, samples_per_cell=args.samples_per_cell,
        max_new_tokens=args.max_new_tokens, haystack=args.haystack, haystack_split=args.haystack_split,
        seed=args.seed, batch_size=args.batch_size, device=args.device, dtype=args.dtype, diff=args.diff,
        quiet=args.quiet, trust_remote_code=args.trust_remote_code)


def _main(args: argparse.Namespace) -> dict:
    """``bayeslayer niah``: :func:`run` on the arguments' config, or :func:`redraw` with ``--plot-only`` (each
    locks ``--out``: one writer per output folder)."""
    check_out_dir(args.out)
    if args.plot_only:
        return redraw(args.out, args.diff)
    return run(config_from_args(args))


__all__ = ["NiahConfig", "add_parser", "config_from_args", "redraw", "run"]
