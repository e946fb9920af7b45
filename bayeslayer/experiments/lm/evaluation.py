"""``bayeslayer lm eval``'s evaluation of one finished run: grouped perplexity over packed windows
(:func:`bayeslayer.evaluation.perplexity.grouped_perplexity`), kept under the command's ``--out`` (never in the
run folder, which is only read) and reused while the run's weights are unchanged."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from ...checks import check_int
from ...files import read_json, sha256_file
from ...training import lock_output
from ...training.distributed import init_distributed
from ...training.lm import load_corpus, load_run
from ..common.provenance import write_record


def evaluate_run(run_dir: str | os.PathLike, *, split: str = "test", seq_len: int | None = None,
                 batch_size: int = 4, device: str = "auto", precision: str = "fp32",
                 cache_dir: str | None = None, out: str | os.PathLike | None = None) -> dict:
    """Grouped PPL of one finished run on packed windows of ``split``; the run folder is only read.

    With ``out``, the result is kept as ``<out>/<run folder name>/eval-<split>-L<len>-<precision>.json``
    (that folder locked while it is used, :func:`~bayeslayer.training.lock.lock_output`) and reused while the
    run's weights are unchanged; without it nothing is written.
    Returns ``{"run_dir", "label", "mixer", "seed", "split", "seq_len", "windows", "groups"}``;
    ``groups`` maps each of :data:`~bayeslayer.experiments.lm.report.GROUPS` to ``{"ppl", "mean_ce", "n_tokens"}``.
    """
    if split not in ("validation", "test"):
        raise ValueError(f"split must be 'validation' or 'test', got {split!r}")
    keep = None if out is None else Path(out) / Path(os.path.abspath(run_dir)).name
    with lock_output(keep):  # one writer per output folder
        return _evaluate_run(run_dir, keep, split=split, seq_len=seq_len, batch_size=batch_size, device=device,
                             precision=precision, cache_dir=cache_dir)


def _evaluate_run(run_dir, keep: Path | None, *, split: str, seq_len: int | None, batch_size: int, device: str,
                  precision: str, cache_dir: str | None) -> dict:
    ctx = init_distributed(device)
    config, model = load_run(run_dir, device=ctx.device)
    seq_len = config.seq_len if seq_len is None else check_int("seq_len", seq_len, minimum=2)
    cache = None if keep is None else keep / f"eval-{split}-L{seq_len}-{precision}.json"
    weights = sha256_file(Path(run_dir) / "final" / "model.safetensors")
    if cache is not None and cache.is_file():
        try:
            cached = read_json(cache, what="evaluation cache")
        except ValueError as err:  # derived data: recompute it
            warnings.warn(f"{err}; recomputing it", RuntimeWarning, stacklevel=3)
            cached = None
        if isinstance(cached, dict) and cached.get("weights_sha256") == weights:
            return {**cached, "run_dir": str(run_dir)}
    from ...evaluation.perplexity import grouped_perplexity

    corpus = load_corpus(config, ctx, cache_dir=cache_dir, splits=("train", split))
    windows = corpus.windows(split, seq_len)
    masks = corpus.annotate(split, seq_len).masks(shifted=True)
    groups = grouped_perplexity(model, windows, masks, batch_size=batch_size, ctx=ctx, precision=precision)
    record = {"run_dir": str(run_dir), "label": config.model_label, "mixer": config.mixer, "seed": config.seed,
              "preset": config.preset, "match": config.model.match,
              **({"compute_match": config.compute_match} if config.compute_match != "steps" else {}),
              "split": split, "seq_len": seq_len, "windows": int(windows.shape[0]),
              "precision": precision, "source": config.source, "groups": groups, "weights_sha256": weights}
    if ctx.is_main and cache is not None:
        write_record(cache, record, device=ctx.device, seeds=[config.seed],
                     optimizer_groups=trained_with(run_dir))
        record = json.loads(cache.read_text())
    return record


def trained_with(run_dir: str | os.PathLike) -> str | None:
    """The optimiser grouping rule recorded in a run's ``train_summary.json`` (None when it records none)."""
    path = Path(run_dir) / "train_summary.json"
    try:
        prov = json.loads(path.read_text()).get("provenance")
    except (OSError, ValueError, AttributeError):
        return None
    return prov.get("optimizer_groups") if isinstance(prov, dict) else None


__all__ = ["evaluate_run", "trained_with"]
