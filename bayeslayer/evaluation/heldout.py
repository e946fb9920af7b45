"""Held-out perplexity of models on corpora at window lengths: the paper's Table 7 (docs/theory.md §8.6).

For each model, each corpus (``source``) and each window length ``L``, the chosen split's token
stream (documents joined by EOS, :mod:`bayeslayer.data.text`) is cut into windows and scored by the rules of
:mod:`bayeslayer.evaluation.perplexity` (``non-overlapping``, the paper's protocol, or ``sliding``).

The relative change of a model against the reference model (default: the first) is, per cell,
``Δ = 100 · (PPL / PPL_ref − 1)`` percent.  It compares like with like only when both models use the
same tokenizer (same windows, same tokens); the record says when they do not.

Paper target (the paper's Table 7, docs/theory.md §8.6; :data:`PAPER_TABLE7`): on WikiText-103, SlimPajama
held-out and PG-19 validation (first 50 books), non-overlapping windows of 2k/4k/8k/16k, the retrofitted BL's
held-out PPL is ≈ 2.3–2.8 % above the GDN's.

Every cell is cached under ``<cache_dir>/heldout/`` (default ``$BAYESLAYER_CACHE``) by the model's
weight files, its tokenizer, the corpus fingerprint, split, length, window rule, caps and the
resolved precision, so a rerun (or a new model added to a table) evaluates only what is missing.

:func:`evaluate_heldout` runs it all and returns the record that ``bayeslayer heldout`` (and ``distill eval``)
write; :func:`resolve_model` finds a model folder's kind, tokenizer and weights digest without loading it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checks import check_int, check_optional_int
from ..data.text.sources import WIKITEXT_103
from ..files import atomic_write_json, read_json
from ..models.loading import find_model, model_files_digest
from ..training.distributed import PRECISIONS, DistContext, init_distributed, resolve_precision
from ..training.lm import load_corpus
from ..training.lm_config import LMConfig
from .lengths import PAPER_LENGTHS
from .perplexity import WINDOW_MODES, heldout_perplexity, window_plan

SINGLE_PROCESS = DistContext()
# Bump when anything that changes a cached cell's numbers changes (window rule, CE definition).
CACHE_FORMAT = 1
# docs/theory.md §8.6: the paper states the change, not the table's cells.
PAPER_TABLE7 = {
    "statement": "held-out PPL rises ≈2.3–2.8% for BL (retrofitted student vs the Gated DeltaNet)",
    "model": "BL",
    "reference": "GDN",
    "rel_change_pct": [2.3, 2.8],
    "corpora": ["WikiText-103", "SlimPajama held-out", "PG-19 validation (first 50 books)"],
    "lengths": list(PAPER_LENGTHS),
    "windows": "non-overlapping",
}
# Column names of well-known sources; any other source is named by what it is given as.
SOURCE_LABELS = {WIKITEXT_103: "WikiText-103", "python-docs": "python-docs"}


def relative_change(ppl: float, reference_ppl: float) -> float:
    """``100 · (ppl / reference_ppl − 1)``: percent change of a PPL against the reference's (a diverged
    model's PPL is ``inf``: ``inf`` against a finite reference, −100 for a finite one against it, NaN for two)."""
    for name, value in (("ppl", ppl), ("reference_ppl", reference_ppl)):
        if not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
            raise ValueError(f"{name} must be a positive number (inf for a diverged model), got {value!r}")
    return math.nan if math.isinf(ppl) and math.isinf(reference_ppl) else 100.0 * (ppl / reference_ppl - 1.0)


# --------------------------------------------------------------------------- corpora


@dataclass(frozen=True)
class HeldoutSource:
    """A corpus to evaluate on: its table ``label``, the ``source`` string of
    :func:`bayeslayer.data.text.corpus_files`, the first ``max_documents`` documents of the split
    (``None``: all; the paper's PG-19 rule is 50) and its own ``split`` (``None``: the evaluation's;
    Table 7 mixes held-out/test splits with PG-19's validation split)."""

    label: str
    source: str
    max_documents: int | None = None
    split: str | None = None

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"sources: a source must be a non-empty string, got {self.source!r}")
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"sources: the label of {self.source!r} must be a non-empty string, got {self.label!r}")
        check_optional_int(f"max_documents of source {self.label!r}", self.max_documents, minimum=1)
        from ..data.text import SPLITS

        if self.split is not None and self.split not in SPLITS:
            raise ValueError(f"split of source {self.label!r} must be one of {SPLITS}, got {self.split!r}")


def as_source(spec: str | HeldoutSource, max_documents: int | Mapping[str, int] | None = None,
              splits: Mapping[str, str] | None = None) -> HeldoutSource:
    """``"LABEL=SOURCE"`` or ``"SOURCE"`` (label from :data:`SOURCE_LABELS` or the source itself).

    ``max_documents``: one cap for every source, or a mapping from source label or source string;
    ``splits``: a mapping from source label or source string to that source's split.
    """
    if isinstance(spec, HeldoutSource):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"sources: each source must be a non-empty string, got {spec!r}")
    label, sep, source = spec.partition("=")
    if not sep:
        label, source = SOURCE_LABELS.get(spec, spec), spec
    cap = max_documents.get(label, max_documents.get(source)) if isinstance(max_documents, Mapping) else max_documents
    split = (splits or {}).get(label, (splits or {}).get(source))
    return HeldoutSource(label, source, cap, split)


def load_heldout_stream(source: HeldoutSource, split: str, tokenizer, *, cache_dir: str | os.PathLike | None = None,
                        files=None) -> np.ndarray:
    """The token stream ``[T]`` of ``split`` of ``source`` (its first ``max_documents`` documents).

    Tokenized with :func:`bayeslayer.data.text.tokenize_split` and cached like a training corpus;
    the cache key adds the document cap to the corpus fingerprint, so ``max_documents=None``
    shares the cache of :func:`~bayeslayer.data.text.load_text_corpus`.  ``files`` is the
    source's already resolved :func:`~bayeslayer.data.text.corpus_files` (resolved here if ``None``).
    """
    from ..data.text import default_cache_dir, find_eos_id, tokenize_split

    files = _corpus_files(source) if files is None else files
    docs = files.splits.get(split)
    if not docs:
        sizes = {s: len(d) for s, d in files.splits.items()}
        raise ValueError(f"sources: {source.label} ({source.source}) has no {split!r} documents "
                         f"(documents per split: {sizes})")
    fingerprint = files.fingerprint
    if source.max_documents is not None:
        docs = list(docs[: source.max_documents])
        fingerprint = {**fingerprint, "max_documents": source.max_documents}
    stream = tokenize_split(docs, tokenizer, split=split, corpus_fingerprint=fingerprint,
                            cache_dir=Path(cache_dir) if cache_dir is not None else default_cache_dir(),
                            eos_id=find_eos_id(tokenizer))
    return stream.tokens


def _corpus_files(source: HeldoutSource):
    from ..data.text import CorpusNotFoundError, corpus_files

    try:
        return corpus_files(source.source)
    except CorpusNotFoundError as err:
        raise ValueError(f"sources: {source.label} ({source.source!r}) is not a corpus on this machine: {err}") from err


# --------------------------------------------------------------------------- models


@dataclass
class HeldoutModel:
    """A model to evaluate, resolved without loading its weights.

    ``kind`` and ``model_dir``: :func:`~bayeslayer.models.loading.find_model`'s.  ``weights_sha256`` hashes the
    config and weight files (:func:`~bayeslayer.models.loading.model_files_digest`), which is what the cell cache
    is keyed by.
    """

    label: str
    path: Path
    kind: str
    model_dir: Path
    tokenizer: Any = field(repr=False)
    tokenizer_origin: str
    weights_sha256: str
    tokenizer_sha256: str

    def load(self, device: torch.device | str = "cpu") -> torch.nn.Module:
        """The model in eval mode on ``device`` (fp32 weights; autocast chooses the compute dtype)."""
        if self.kind == "lm-run":
            from ..training.lm import load_run

            return load_run(self.path, device=device)[1]
        from ..models.pretrained import load_model

        return load_model(self.model_dir, device=device, dtype=torch.float32).eval()


def resolve_model(label: str, path: str | os.PathLike, *, tokenizer=None, cache_dir: str | os.PathLike | None = None,
                  ctx: DistContext = SINGLE_PROCESS) -> HeldoutModel:
    """Find the model directory, kind, tokenizer and weights digest of ``label=path``.

    Tokenizer, first found: ``tokenizer`` (a ``tokenizer.json`` or a directory holding one);
    ``tokenizer.json`` in the model directory (for a run directory: ``final/``, then the run
    directory); for an ``lm`` run, the run's own tokenizer (``LMConfig.tokenizer``, else the BPE
    trained on its corpus, via :func:`bayeslayer.training.lm.load_corpus`).  None of these is
    a ``ValueError`` that says to pass one.
    """
    from ..data.text import load_tokenizer

    if not isinstance(label, str) or not label:
        raise ValueError(f"models: a label must be a non-empty string, got {label!r}")
    path = Path(path)
    kind, model_dir = find_model(path, name=f"models: {label}={path}")
    run_config = None
    if kind == "lm-run":
        run_config = LMConfig.from_json(read_json(model_dir / "lm_config.json", what="run config"))

    if tokenizer is not None:
        try:
            tok, origin = load_tokenizer(tokenizer), str(tokenizer)
        except FileNotFoundError as err:
            raise ValueError(f"tokenizer: {err}") from err
    elif (model_dir / "tokenizer.json").is_file() or (path / "tokenizer.json").is_file():
        where = model_dir if (model_dir / "tokenizer.json").is_file() else path
        tok, origin = load_tokenizer(where / "tokenizer.json"), str(where / "tokenizer.json")
    elif run_config is not None and run_config.tokenizer is not None:
        tok, origin = load_tokenizer(run_config.tokenizer), run_config.tokenizer
    elif run_config is not None:
        corpus = load_corpus(run_config, ctx, cache_dir=None if cache_dir is None else str(cache_dir),
                             splits=("validation",))
        tok = corpus.tokenizer
        origin = f"BPE of {run_config.vocab_size} trained on the run's corpus {run_config.source}"
    else:
        raise ValueError(f"models: {label}={path} has no tokenizer.json and is not an lm run directory; "
                         "pass a tokenizer (--tokenizer tokenizer.json)")
    return HeldoutModel(label=label, path=path, kind=kind, model_dir=model_dir, tokenizer=tok,
                        tokenizer_origin=origin, weights_sha256=model_files_digest(model_dir),
                        tokenizer_sha256=hashlib.sha256(tok.to_str().encode()).hexdigest())


# --------------------------------------------------------------------------- evaluation


def _cell_path(cache_root: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return cache_root / "heldout" / f"cell-{digest}.json"


def _read_cell(path: Path, key: dict) -> dict | None:
    if not path.is_file():
        return None
    try:
        cached = read_json(path, what="held-out cache cell")
    except ValueError:
        return None  # a damaged file is recomputed and rewritten
    if not isinstance(cached, dict):
        return None
    # the file name is a hash of the key: compare in full so a collision can never return another cell
    if json.loads(json.dumps(cached.get("key"), default=str)) != json.loads(json.dumps(key, default=str)):
        return None
    return cached.get("result")


def _cell_key(spec: HeldoutModel, source: HeldoutSource, corpus: str, *, split: str, length: int, windows: str,
              stride: int | None, max_windows: int | None, precision: str) -> dict:
    """Everything one cell's number depends on: the key of its entry in the result cache."""
    return {"format": CACHE_FORMAT, "weights_sha256": spec.weights_sha256, "tokenizer_sha256": spec.tokenizer_sha256,
            "source": source.source, "corpus": corpus, "max_documents": source.max_documents, "split": split,
            "length": length, "windows": windows, "stride": stride, "max_windows": max_windows,
            "precision": precision}


def _load_with_tokenizer(spec: HeldoutModel, device) -> torch.nn.Module:
    """``spec``'s model on ``device``; a tokenizer with more ids than the model's vocabulary is refused."""
    model = spec.load(device)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and spec.tokenizer.get_vocab_size(with_added_tokens=True) > vocab:
        raise ValueError(
            f"tokenizer ({spec.tokenizer_origin}) has "
            f"{spec.tokenizer.get_vocab_size(with_added_tokens=True)} ids but model "
            f"{spec.label} only {vocab}: it is not this model's tokenizer")
    return model


def _add_relative_changes(out_models: dict[str, dict], reference: str) -> None:
    """Each cell's ``rel_change_pct`` against the reference model's cell (``None`` for the reference itself and
    where either cell is skipped), and each model's ``same_tokenizer_as_reference``."""
    ref = out_models[reference]
    for m in out_models.values():
        m["same_tokenizer_as_reference"] = m["tokenizer_sha256"] == ref["tokenizer_sha256"]
        for source_label, row in m["cells"].items():
            for L, cell in row.items():
                ref_cell = ref["cells"][source_label][L]
                both = "ppl" in cell and "ppl" in ref_cell and m is not ref
                cell["rel_change_pct"] = relative_change(cell["ppl"], ref_cell["ppl"]) if both else None


def _checked_arguments(models, sources, lengths, split, reference, windows, stride, max_windows, max_documents,
                       source_splits, batch_size, precision) -> dict:
    """:func:`evaluate_heldout`'s arguments, every one checked (its name in the error) before anything loads;
    the normalised values by name (``pairs``, ``labels``, ``heldout_sources``, ``split_of``, ...)."""
    from ..data.text import SPLITS

    if isinstance(models, (str, bytes)) or not isinstance(models, Sequence) or not models:
        raise ValueError(f"models must be a non-empty list of (label, path) pairs, got {models!r}")
    pairs = []
    for item in models:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"models: each entry must be a (label, path) pair, got {item!r}")
        pairs.append((item[0], item[1]))
    labels = [label for label, _ in pairs]
    if any(not isinstance(label, str) or not label for label in labels) or len(set(labels)) != len(labels):
        raise ValueError(f"models: labels must be distinct non-empty strings, got {labels}")
    reference = labels[0] if reference is None else reference
    if reference not in labels:
        raise ValueError(f"reference must be one of the model labels {labels}, got {reference!r}")
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence) or not sources:
        raise ValueError(f"sources must be a non-empty list of corpus names, got {sources!r}")
    if isinstance(max_documents, Mapping):
        for name, cap in max_documents.items():
            check_int(f"max_documents[{name!r}]", cap, minimum=1)
    else:
        check_optional_int("max_documents", max_documents, minimum=1)
    if source_splits is not None and not isinstance(source_splits, Mapping):
        raise TypeError(f"source_splits must be a mapping source -> split, got {type(source_splits).__name__}")
    heldout_sources = [as_source(s, max_documents, source_splits) for s in sources]
    known = {s.label for s in heldout_sources} | {s.source for s in heldout_sources}
    for name, mapping in (("max_documents", max_documents), ("source_splits", source_splits)):
        unknown = sorted(set(mapping) - known) if isinstance(mapping, Mapping) else []
        if unknown:
            raise ValueError(f"{name} names {unknown}, which are not among the sources {sorted(known)}")
    source_labels = [s.label for s in heldout_sources]
    if len(set(source_labels)) != len(source_labels):
        raise ValueError(f"sources: labels must be distinct, got {source_labels}")
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or not lengths:
        raise ValueError(f"lengths must be a non-empty list of integers >= 2, got {lengths!r}")
    lengths = [check_int("lengths", L, minimum=2) for L in lengths]
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"lengths must be distinct, got {lengths}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    split_of = {s.label: s.split or split for s in heldout_sources}
    if windows not in WINDOW_MODES:
        raise ValueError(f"windows must be one of {WINDOW_MODES}, got {windows!r}")
    if windows == "sliding":
        if stride is None:
            raise ValueError("windows='sliding' needs a stride (--stride S, 1 <= S < every length)")
        stride = check_int("stride", stride, minimum=1)
        if any(stride >= L for L in lengths):
            raise ValueError(f"stride ({stride}) must be < every length {lengths} for sliding windows")
    elif stride is not None:
        raise ValueError(f"stride applies to windows='sliding' only, got stride={stride!r}")
    max_windows = check_optional_int("max_windows", max_windows, minimum=1)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")

    return dict(pairs=pairs, reference=reference, heldout_sources=heldout_sources, lengths=lengths,
                split_of=split_of, stride=stride, max_windows=max_windows, batch_size=batch_size)


def evaluate_heldout(
    models: Sequence[tuple[str, str | os.PathLike]],
    sources: Sequence[str | HeldoutSource],
    lengths: Sequence[int] = PAPER_LENGTHS,
    *,
    split: str = "test",
    reference: str | None = None,
    tokenizer=None,
    windows: str = "non-overlapping",
    stride: int | None = None,
    max_windows: int | None = None,
    max_documents: int | Mapping[str, int] | None = None,
    source_splits: Mapping[str, str] | None = None,
    batch_size: int = 1,
    device: str = "auto",
    precision: str = "fp32",
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> dict:
    """Held-out PPL of every model on every source × length, and its change vs ``reference``.

    Args:
        models: ``(label, path)`` pairs; ``path`` is a model directory with ``config.json`` (a
            flash-linear-attention Gated DeltaNet checkpoint or a Hugging Face causal LM, ours
            included) or an ``lm train`` run directory (its ``final/`` is evaluated).
        sources: corpora, ``"SOURCE"`` or ``"LABEL=SOURCE"`` (``python-docs``,
            ``hf:<name>[:<config>]`` or a local path) or :class:`HeldoutSource`.
        lengths: window lengths ``L >= 2``.
        split: ``train``, ``validation`` or ``test``: the split of every source not in ``source_splits``.
        reference: label of the model the relative change is against (default: the first).
        tokenizer: one tokenizer for every model (default: see :func:`resolve_model`).
        windows, stride: the window rule (module docstring).
        max_windows: evaluate the first ``max_windows`` windows of each source × length.
        max_documents: keep the first documents of the split (one cap, or per source label).
        source_splits: per-source splits (source label or string → split), e.g. PG-19's validation.
        batch_size, device, precision: forward passes of :func:`heldout_perplexity`.
        cache_dir: token caches and the per-cell result cache (default ``$BAYESLAYER_CACHE``).

    A length longer than a split's stream is a *recorded skip*: the cell holds
    ``{"skipped": reason, "split_tokens": T}`` and the table shows "–".

    Returns the record ``{"experiment": "heldout", "preset": windows, "config", "models", "reference",
    "target"}`` with ``models[label] = {"path", "kind", "tokenizer", "tokenizer_sha256", "weights_sha256",
    "same_tokenizer_as_reference", "cells": {source_label: {str(L): cell}}}`` with
    ``cell = {"ppl", "mean_ce", "n_tokens", "windows", "windows_available", "split_tokens",
    "rel_change_pct"}`` (``rel_change_pct`` is ``None`` for the reference and where either cell
    is skipped), and ``target`` = :data:`PAPER_TABLE7`.
    """
    from ..data.text import default_cache_dir

    args = _checked_arguments(models, sources, lengths, split, reference, windows, stride, max_windows,
                              max_documents, source_splits, batch_size, precision)
    pairs, reference, lengths = args["pairs"], args["reference"], args["lengths"]
    heldout_sources, split_of = args["heldout_sources"], args["split_of"]
    stride, max_windows, batch_size = args["stride"], args["max_windows"], args["batch_size"]

    ctx = init_distributed(device)
    dtype = resolve_precision(precision, ctx.device)
    resolved_precision = "fp32" if dtype is None else "bf16"
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    files = {s.label: _corpus_files(s) for s in heldout_sources}  # an unknown source fails before any model loads
    for s in heldout_sources:
        if not files[s.label].splits.get(split_of[s.label]):
            raise ValueError(f"sources: {s.label} ({s.source}) has no {split_of[s.label]!r} documents")
    specs = [resolve_model(label, path, tokenizer=tokenizer, cache_dir=cache_dir, ctx=ctx) for label, path in pairs]

    def say(message: str) -> None:
        if progress and ctx.is_main:
            print(f"[heldout] {message}", flush=True)

    streams: dict[tuple[str, str], np.ndarray] = {}

    def stream_of(spec: HeldoutModel, source: HeldoutSource) -> np.ndarray:
        key = (spec.tokenizer_sha256, source.label)
        if key not in streams:
            if ctx.distributed and not ctx.is_main:  # rank 0 tokenizes (or finds the cache) first
                ctx.barrier()
            streams[key] = load_heldout_stream(source, split_of[source.label], spec.tokenizer,
                                               cache_dir=cache_root, files=files[source.label])
            if ctx.distributed and ctx.is_main:
                ctx.barrier()
        return streams[key]

    out_models: dict[str, dict] = {}
    for spec in specs:
        model = None
        cells: dict[str, dict] = {}
        for source in heldout_sources:
            cells[source.label] = {}
            for L in lengths:
                key = _cell_key(spec, source, files[source.label].fingerprint, split=split_of[source.label],
                                length=L, windows=windows, stride=stride, max_windows=max_windows,
                                precision=resolved_precision)
                path = _cell_path(cache_root, key)
                cell = _read_cell(path, key)
                ctx.barrier()  # every rank has looked before rank 0 may write: all agree on hit or miss
                if cell is None:
                    tokens = stream_of(spec, source)
                    if tokens.shape[0] < L:
                        reason = (f"the {split_of[source.label]} split of {source.label} has {tokens.shape[0]:,} "
                                  f"tokens, fewer than one window of {L:,}")
                        cell = {"skipped": reason, "split_tokens": int(tokens.shape[0])}
                        warnings.warn(f"heldout: {spec.label} on {source.label} at L={L}: {cell['skipped']}; "
                                      "recorded as skipped", RuntimeWarning, stacklevel=2)
                    else:
                        if model is None:
                            say(f"loading {spec.label} ({spec.kind}) from {spec.model_dir}")
                            model = _load_with_tokenizer(spec, ctx.device)
                        plan, scored = window_plan(tokens, L, windows=windows, stride=stride)
                        cell = heldout_perplexity(model, plan, batch_size=batch_size, ctx=ctx, precision=precision,
                                                  max_windows=max_windows, scored=scored)
                        cell.update(windows_available=int(plan.shape[0]), split_tokens=int(tokens.shape[0]))
                    if ctx.is_main:
                        atomic_write_json(path, {"key": key, "result": cell})
                else:
                    say(f"{spec.label} {source.label} L={L}: cached")
                if "ppl" in cell:
                    say(f"{spec.label} {source.label} L={L}: PPL {cell['ppl']:.3f} "
                        f"over {cell['n_tokens']:,} tokens in {cell['windows']} windows")
                cells[source.label][str(L)] = dict(cell)
        out_models[spec.label] = {
            "path": str(spec.path), "kind": spec.kind, "tokenizer": spec.tokenizer_origin,
            "tokenizer_sha256": spec.tokenizer_sha256, "weights_sha256": spec.weights_sha256, "cells": cells}
        del model

    _add_relative_changes(out_models, reference)
    config = {"split": split, "lengths": lengths, "windows": windows, "stride": stride, "max_windows": max_windows,
              "precision": precision, "resolved_precision": resolved_precision,
              "sources": [{"label": s.label, "source": s.source, "max_documents": s.max_documents,
                           "split": split_of[s.label]} for s in heldout_sources],
              "world_size": ctx.world_size, "device": str(ctx.device)}
    return {"experiment": "heldout", "preset": windows, "config": config, "models": out_models, "reference": reference,
            "target": PAPER_TABLE7}


__all__ = [
    "CACHE_FORMAT", "PAPER_TABLE7", "SOURCE_LABELS", "HeldoutModel", "HeldoutSource", "as_source",
    "evaluate_heldout", "load_heldout_stream", "relative_change", "resolve_model",
]
