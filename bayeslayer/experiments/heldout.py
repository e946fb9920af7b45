"""``bayeslayer heldout``: held-out perplexity per corpus and window length, the paper's Table 7 (docs/theory.md §8.6).

The evaluation (window rules, the cell cache, model folders) is :mod:`bayeslayer.evaluation.heldout`; the run
(its :class:`~bayeslayer.experiments.common.heldout_run.HeldoutConfig`, the record, its table and figure) is the
one ``distill eval`` shares, :mod:`bayeslayer.experiments.common.heldout_run`.  This command maps its options
onto a ``HeldoutConfig`` (:func:`config_from_args`) and runs it::

    bayeslayer heldout --windows non-overlapping --lengths 2048,4096,8192,16384 \\
        --model GDN=ckpt/gdn --model BL=runs/distill/bl/final \\
        --source WikiText-103=hf:Salesforce/wikitext:wikitext-103-raw-v1 --split test \\
        --reference GDN --out runs/heldout

writes ``heldout.json`` (results), ``heldout.md`` (Table 7 layout) and ``heldout.png`` (PPL vs length
per corpus), the last two drawn from the JSON only (``--plot-only`` redraws them).  Before it was its own
command this was ``bayeslayer lm eval --lengths ...``.
"""

from __future__ import annotations

import argparse

from ..errors import UsageError
from ..evaluation.heldout import PAPER_TABLE7
from ..evaluation.lengths import PAPER_LENGTHS
from ..evaluation.perplexity import WINDOW_MODES
from ..training.distributed import PRECISIONS
from .common.heldout_run import HeldoutConfig, plot, redraw, run, table, table7_markdown, write_report
from .common.options import (
    DEVICE_HELP,
    PLOT_ONLY_HELP,
    cache_dir_arg,
    check_file_name,
    check_out_dir,
    device_arg,
    list_arg,
    model_arg,
    positive_int_arg,
)
from .common.threads import TORCH_DEFAULT, add_threads_option

DESCRIPTION = (
    "Held-out perplexity of each model on each corpus at each window length, in "
    "the layout of the paper's Table 7, with each model's relative change against "
    "a reference model. Windows are non-overlapping by default (the paper's "
    "protocol) or sliding. Writes OUT/NAME.json, a markdown table and a plot drawn "
    "from it (--plot-only redraws them). The window rules: python -m pydoc "
    "bayeslayer.evaluation.heldout."
)


def _parse_max_documents(text: str) -> tuple[str | None, int]:
    name, sep, count = text.rpartition("=")
    try:
        value = int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-documents takes N or SOURCE=N, got {text!r}") from None
    return (name if sep else None), value


def _parse_source_split(text: str) -> tuple[str, str]:
    name, sep, split = text.rpartition("=")
    if not sep or not name or not split:
        raise argparse.ArgumentTypeError(f"--source-split takes SOURCE=SPLIT, got {text!r}")
    return name, split


def config_from_args(args: argparse.Namespace) -> HeldoutConfig:
    """The :class:`HeldoutConfig` of ``bayeslayer heldout``'s parsed arguments."""
    caps = args.max_documents or []
    if any(n is None for n, _ in caps) and len(caps) > 1:
        raise UsageError("give --max-documents either once as N or as SOURCE=N per source")
    max_documents: int | dict[str, int] | None
    max_documents = caps[0][1] if caps and caps[0][0] is None else {n: v for n, v in caps} or None
    return HeldoutConfig(
        models=args.model or (), sources=args.source or ("python-docs",), lengths=args.lengths or PAPER_LENGTHS,
        split=args.split, reference=args.reference, tokenizer=args.tokenizer, windows=args.windows,
        stride=args.stride, max_windows=args.max_windows, max_documents=max_documents,
        source_splits=dict(args.source_split) if args.source_split else None, batch_size=args.batch_size,
        device=args.device, precision=args.precision, cache_dir=args.cache_dir, out=args.out, name=args.name)


def _main(args: argparse.Namespace) -> dict:
    check_file_name(args.name)
    check_out_dir(args.out)
    if args.plot_only:  # each locks --out: one writer per output folder
        return redraw(args.out, args.name)
    return run(config_from_args(args))


def add_parser(sub) -> None:
    """``bayeslayer heldout``: each option maps onto the :class:`HeldoutConfig` field of its name."""
    p = sub.add_parser("heldout",
                       help="held-out perplexity per corpus and window length (Table 7, docs/theory.md §8.6)",
                       description=DESCRIPTION)
    p.add_argument("--model", action="append", type=model_arg, default=None, metavar="[LABEL=]DIR",
                   help="a model directory (HF or fla Gated DeltaNet checkpoint) or an lm run directory; repeat")
    p.add_argument("--source", action="append", default=None, metavar="[LABEL=]SOURCE",
                   help="corpus: python-docs, hf:<name>[:<config>] or a local path; repeat (default python-docs)")
    p.add_argument("--lengths", type=list_arg(int, "integers"), default=None,
                   help="window lengths (default 2048,4096,8192,16384)")
    p.add_argument("--windows", choices=WINDOW_MODES, default="non-overlapping",
                   help="non-overlapping: each token scored once, context resets every L tokens (the paper's "
                        "protocol); sliding: windows every --stride tokens, each token scored once with "
                        ">= L - stride tokens of context")
    p.add_argument("--stride", type=positive_int_arg, default=None,
                   help="window step of --windows sliding (1 <= S < L)")
    p.add_argument("--split", choices=("train", "validation", "test"), default="test")
    p.add_argument("--reference", default=None, help="label of the model the change is against (default: first)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json for every model (default: each model's own, see above)")
    p.add_argument("--max-windows", type=positive_int_arg, default=None,
                   help="evaluate only the first N windows per corpus × length (caps the cost)")
    p.add_argument("--max-documents", action="append", type=_parse_max_documents, default=None,
                   metavar="[SOURCE=]N", help="keep the split's first N documents (e.g. PG-19=50); repeat per source")
    p.add_argument("--source-split", action="append", type=_parse_source_split, default=None, metavar="SOURCE=SPLIT",
                   help="this source's split instead of --split (e.g. PG-19=validation); repeat per source")
    p.add_argument("--batch-size", type=positive_int_arg, default=HeldoutConfig.batch_size)
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    p.add_argument("--cache-dir", type=cache_dir_arg, default=None,
                       help="token and cell cache (default $BAYESLAYER_CACHE)")
    p.add_argument("--out", default=HeldoutConfig.out, help="output directory")
    p.add_argument("--name", default=HeldoutConfig.name, help="file name stem of the outputs")
    p.add_argument("--plot-only", action="store_true", help=PLOT_ONLY_HELP + " (<out>/<name>.json)")
    add_threads_option(p, TORCH_DEFAULT)
    p.set_defaults(func=_main)


__all__ = ["PAPER_TABLE7", "HeldoutConfig", "add_parser", "config_from_args", "plot", "redraw", "run", "table",
           "table7_markdown", "write_report"]
