"""Held-out perplexity per corpus and context length, in the layout of the paper's Table 7 (docs/theory.md §8.6).

For each model, each corpus (``source``) and each window length ``L``, the chosen split's token
stream (documents joined by EOS, :mod:`bayeslayer.data.text`) is cut into windows and scored:

* ``non-overlapping`` (the paper's protocol): windows ``x_i = stream[iL : (i+1)L]`` for
  ``i < N = ⌊T/L⌋`` (the tail shorter than one window is dropped).  Each window is scored from an
  empty state and its first token is context only, so every other token is predicted exactly once,
  with 1 … L−1 tokens of context (the context resets every L tokens)::

      PPL_L = exp( Σ_i Σ_{t=1}^{L−1} CE(x_{i,t} | x_{i,<t}) / (N·(L−1)) )

* ``sliding`` with stride ``S`` (1 ≤ S < L; Hugging Face's strided perplexity): windows
  ``stream[kS : kS+L]`` for ``k < K = ⌊(T−L)/S⌋ + 1``; window 0 scores its L−1 predictions,
  window k ≥ 1 only its last S, so every token of ``stream[1 : (K−1)S+L]`` is predicted exactly once,
  all but the first L−1 of them with at least L−S tokens of context.  Costs ≈ L/S times as much.

The relative change of a model against the reference model (default: the first) is, per cell,
``Δ = 100 · (PPL / PPL_ref − 1)`` percent.  It compares like with like only when both models use the
same tokenizer (same windows, same tokens); the record says when they do not.

Paper target (the paper's Table 7, docs/theory.md §8.6): on WikiText-103, SlimPajama held-out and PG-19
validation (first 50 books), non-overlapping windows of 2k/4k/8k/16k, the retrofitted BL's held-out PPL is
≈ 2.3–2.8 % above the GDN's.

Every cell is cached under ``<cache_dir>/heldout/`` (default ``$BAYESLAYER_CACHE``) by the model's
weight files, its tokenizer, the corpus fingerprint, split, length, window rule, caps and the
resolved precision, so a rerun (or a new model added to a table) evaluates only what is missing.

In Python, :func:`run` takes a :class:`HeldoutConfig` and returns the record; on the command line
(``bayeslayer heldout``, whose options are the config's fields; before it was its own command this
was ``bayeslayer lm eval --lengths ...``)::

    bayeslayer heldout --windows non-overlapping --lengths 2048,4096,8192,16384 \\
        --model GDN=ckpt/gdn --model BL=runs/distill/bl/final \\
        --source WikiText-103=hf:Salesforce/wikitext:wikitext-103-raw-v1 --split test \\
        --reference GDN --out results/heldout

writes ``heldout.json`` (results), ``heldout.md`` (Table 7 layout) and ``heldout.png`` (PPL vs length
per corpus), the last two drawn from the JSON only.
"""

from __future__ import annotations

import argparse
import contextlib
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

from ..data.text.sources import WIKITEXT_103
from ..errors import UsageError
from ..files import atomic_write_text, read_json
from ..training.distributed import PRECISIONS, DistContext, init_distributed, resolve_precision
from ..training.lm import load_corpus
from ..training.lm_config import LMConfig
from ..training.lock import OutputLock
from .common.harness import results_record, write_json
from .common.options import (
    DEVICE_HELP,
    PLOT_ONLY_HELP,
    cache_dir_arg,
    check_file_name,
    check_in_dir,
    check_int,
    check_out_dir,
    device_arg,
    model_arg,
    plot_only_json,
    positive_int_arg,
    redrawing,
)
from .common.plotting import PAPER_LENGTHS, length_label, load_json, save_figure
from .common.provenance import write_record
from .common.threads import TORCH_DEFAULT, add_threads_option

DESCRIPTION = (
    "Held-out perplexity of each model on each corpus at each window length, in "
    "the layout of the paper's Table 7, with each model's relative change against "
    "a reference model. Windows are non-overlapping by default (the paper's "
    "protocol) or sliding. Writes OUT/NAME.json, a markdown table and a plot drawn "
    "from it (--plot-only redraws them). The window rules: python -m pydoc "
    "bayeslayer.experiments.heldout."
)

SINGLE_PROCESS = DistContext()
WINDOW_MODES = ("non-overlapping", "sliding")
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


# --------------------------------------------------------------------------- small checks


def _check_optional_int(name: str, value: Any, *, minimum: int) -> int | None:
    return None if value is None else check_int(name, value, minimum=minimum)


def relative_change(ppl: float, reference_ppl: float) -> float:
    """``100 · (ppl / reference_ppl − 1)``: percent change of a PPL against the reference's."""
    for name, value in (("ppl", ppl), ("reference_ppl", reference_ppl)):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return 100.0 * (ppl / reference_ppl - 1.0)


# --------------------------------------------------------------------------- windows and scoring


def window_plan(tokens: np.ndarray, length: int, *, windows: str = "non-overlapping",
                stride: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Windows ``[N, L]`` of a 1-D token stream and the boolean ``scored [N, L−1]`` mask of their predictions.

    ``scored[i, t]`` says whether the prediction of ``windows[i, t+1]`` counts (see the module
    docstring for both rules).  Both arrays are views where they can be (no copy of the stream).
    A stream shorter than one window raises ``ValueError``.
    """
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D integer numpy array, got {getattr(tokens, 'shape', type(tokens))}")
    length = check_int("length", length, minimum=2)
    if windows not in WINDOW_MODES:
        raise ValueError(f"windows must be one of {WINDOW_MODES}, got {windows!r}")
    if tokens.shape[0] < length:
        raise ValueError(f"a stream of {tokens.shape[0]} tokens holds no window of length {length}")
    if windows == "non-overlapping":
        if stride is not None:
            raise ValueError(f"stride applies to windows='sliding' only, got stride={stride!r}")
        n = tokens.shape[0] // length
        out = tokens[: n * length].reshape(n, length)
        return out, np.broadcast_to(np.True_, (n, length - 1))
    if stride is None:
        raise ValueError("windows='sliding' needs a stride")
    stride = check_int("stride", stride, minimum=1)
    if stride >= length:
        raise ValueError(f"stride must be < length for sliding windows (stride = length is non-overlapping "
                         f"with the first token of each window unscored), got stride {stride}, length {length}")
    out = np.lib.stride_tricks.sliding_window_view(tokens, length)[::stride]
    scored = np.zeros((out.shape[0], length - 1), dtype=bool)
    scored[0] = True
    scored[1:, length - 1 - stride:] = True  # the S tokens the previous window did not reach
    return out, scored


def heldout_perplexity(model: torch.nn.Module, windows: np.ndarray, *, batch_size: int = 1,
                       ctx: DistContext = SINGLE_PROCESS, precision: str = "fp32", max_windows: int | None = None,
                       scored: np.ndarray | None = None) -> dict:
    """PPL ``exp(Σ CE / n)`` of next-token predictions over ``windows [N, L]`` (each from an empty state).

    Every window is one independent forward pass: the model starts from an empty state and the
    window's first token is context only, so with ``scored=None`` the ``n = N·(L−1)`` predictions
    ``x_{i,t} | x_{i,<t}`` (``t = 1 … L−1``) all count.  ``scored [N, L−1]`` (boolean) keeps only
    some of them (the sliding rule of :func:`window_plan`).  ``max_windows`` keeps the first
    ``max_windows`` windows.  Sums are float64; windows are shared out across ranks and the sums
    all-reduced by :func:`bayeslayer.evaluation.perplexity.grouped_perplexity`, so every rank returns the
    same numbers.

    Returns ``{"ppl", "mean_ce", "n_tokens", "windows"}``.
    """
    if not callable(model):
        raise TypeError(f"model must be a causal LM module, got {type(model).__name__}")
    if not isinstance(windows, np.ndarray) or windows.ndim != 2 or windows.shape[1] < 2 or windows.shape[0] < 1:
        raise ValueError(f"windows must be a numpy array [N >= 1, L >= 2], got {getattr(windows, 'shape', windows)}")
    if not np.issubdtype(windows.dtype, np.integer):
        raise TypeError(f"windows must hold integer token ids, got dtype {windows.dtype}")
    max_windows = _check_optional_int("max_windows", max_windows, minimum=1)
    n_windows, length = windows.shape
    if scored is None:
        scored = np.broadcast_to(np.True_, (n_windows, length - 1))
    if not isinstance(scored, np.ndarray) or scored.dtype != np.bool_ or scored.shape != (n_windows, length - 1):
        raise ValueError(f"scored must be a boolean numpy array [N, L-1] = {(n_windows, length - 1)}, got "
                         f"{getattr(scored, 'dtype', type(scored))} {getattr(scored, 'shape', '')}")
    if max_windows is not None:
        windows, scored = windows[:max_windows], scored[:max_windows]
    from ..evaluation.perplexity import grouped_perplexity

    result = grouped_perplexity(model, windows, {"scored": scored}, batch_size=batch_size, ctx=ctx,
                                precision=precision)["scored"]
    if not result["n_tokens"]:
        raise ValueError("scored selects no prediction; nothing to average")
    return {"ppl": result["ppl"], "mean_ce": result["mean_ce"], "n_tokens": result["n_tokens"],
            "windows": int(windows.shape[0])}


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
        _check_optional_int(f"max_documents of source {self.label!r}", self.max_documents, minimum=1)
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

    ``kind``: ``"lm-run"`` (an ``lm train`` run directory; the model is its ``final/``),
    ``"gated_deltanet"`` (a flash-linear-attention checkpoint) or ``"hf"`` (any other
    ``AutoModelForCausalLM`` directory, ours included).  ``weights_sha256`` hashes the config
    and weight files, which is what the cell cache is keyed by.
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
            from .common.lm_run import load_run

            return load_run(self.path, device=device)[1]
        from ..models.pretrained import load_model

        return load_model(self.model_dir, device=device, dtype=torch.float32).eval()


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _model_files_digest(model_dir: Path) -> str:
    """SHA-256 over ``config.json`` and every weight file (names and bytes, sorted by name)."""
    files = [model_dir / "config.json"] + sorted(p for p in model_dir.iterdir()
                                                   if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if len(files) == 1:
        raise ValueError(f"models: {model_dir} has config.json but no weight file ({', '.join(_WEIGHT_SUFFIXES)})")
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


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
    if not path.is_dir():
        raise ValueError(f"models: {label}={path} is not a directory")
    run_config = None
    if (path / "final" / "lm_config.json").is_file():
        kind, model_dir = "lm-run", path / "final"
        run_config = LMConfig.from_json(read_json(model_dir / "lm_config.json", what="run config"))
    elif (path / "config.json").is_file():
        model_dir = path
        model_type = read_json(path / "config.json", what="model config").get("model_type")
        kind = "gated_deltanet" if model_type == "gated_deltanet" else "hf"
    else:
        raise ValueError(f"models: {label}={path} has neither config.json (a model directory) nor "
                         "final/lm_config.json (a finished `lm train` run directory)")

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
                        tokenizer_origin=origin, weights_sha256=_model_files_digest(model_dir),
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
        _check_optional_int("max_documents", max_documents, minimum=1)
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
    max_windows = _check_optional_int("max_windows", max_windows, minimum=1)
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

    Returns the results layout of :func:`bayeslayer.experiments.common.harness.results_record`:
    ``models[label] = {"path", "kind", "tokenizer", "tokenizer_sha256", "weights_sha256",
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
                        write_json(str(path), {"key": key, "result": cell})
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
    return results_record("heldout", windows, config, out_models, reference=reference, target=PAPER_TABLE7)


# --------------------------------------------------------------------------- table and plot (from the JSON)


def _check_record(record: dict) -> None:
    if not isinstance(record, dict) or record.get("experiment") != "heldout" or not record.get("models"):
        seen = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError("record must be the JSON written by evaluate_heldout / `bayeslayer heldout` "
                         f"(experiment 'heldout' with models), got {seen}")


def table7_markdown(record: dict) -> str:
    """Table 7's layout: one row per model, one column per corpus × length, cells ``PPL (+x.x%)``.

    The percentage is the change against the reference model (its own row shows the PPL only);
    "–" marks a skipped cell, "†" a model whose tokenizer differs from the reference's.
    """
    _check_record(record)
    cfg = record.get("config", {})
    models = record["models"]
    reference = record.get("reference")
    sources = [s["label"] for s in cfg.get("sources", [])] or list(next(iter(models.values()))["cells"])
    lengths = [str(L) for L in cfg.get("lengths", [])]
    columns = [(s, L) for s in sources for L in lengths]
    rule = cfg.get("windows", "non-overlapping")
    if rule == "sliding":
        rule = f"sliding (stride {cfg.get('stride')})"
    splits = {s["label"]: s.get("split", cfg.get("split")) for s in cfg.get("sources", [])}
    where = (f"the {cfg.get('split')} split" if set(splits.values()) <= {cfg.get("split")}
             else "splits " + ", ".join(f"{k} {v}" for k, v in splits.items()))
    lines = [f"Held-out PPL on {where}, {rule} windows"
             + (f", first {cfg['max_windows']} windows per cell" if cfg.get("max_windows") else "")
             + f"; change vs {reference} in parentheses.", "",
             "| model | " + " | ".join(f"{s} {length_label(L)}" for s, L in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for label, m in models.items():
        cells = []
        for s, L in columns:
            cell = m["cells"].get(s, {}).get(L, {})
            if cell.get("ppl") is None:
                cells.append("–")
            elif cell.get("rel_change_pct") is None:
                cells.append(f"{cell['ppl']:.2f}")
            else:
                cells.append(f"{cell['ppl']:.2f} ({cell['rel_change_pct']:+.1f}%)")
        mark = "" if m.get("same_tokenizer_as_reference", True) else " †"
        lines.append(f"| {label}{mark} | " + " | ".join(cells) + " |")
    ref_cells = models[reference]["cells"] if reference in models else {}
    counts = [f"{s} {length_label(L)}: {c['windows']} windows, {c['n_tokens']:,} tokens"
              for s, L in columns if (c := ref_cells.get(s, {}).get(L, {})).get("ppl") is not None]
    lines.append("")
    if counts:
        lines.append(f"Scored ({reference}): " + "; ".join(counts) + ".")
    skipped = sorted({c["skipped"] for m in models.values() for row in m["cells"].values() for c in row.values()
                      if "skipped" in c})
    if skipped:
        lines.append("Skipped (–): " + "; ".join(skipped) + ".")
    if any(not m.get("same_tokenizer_as_reference", True) for m in models.values()):
        lines.append("† tokenizer differs from the reference's: different windows and tokens, so the PPLs "
                     "are not directly comparable.")
    target = record.get("target") or {}
    if target.get("statement"):
        lines.append(f"Paper target (docs/theory.md §8.6): {target['statement']}.")
    return "\n".join(lines) + "\n"


def plot(record: dict, path: str | os.PathLike) -> Path:
    """PPL vs window length (log-2 x axis), one panel per corpus, one line per model; from the JSON only."""
    _check_record(record)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = record.get("config", {})
    models = record["models"]
    sources = [s["label"] for s in cfg.get("sources", [])] or list(next(iter(models.values()))["cells"])
    fig, axes = plt.subplots(1, len(sources), figsize=(4.2 * len(sources), 3.6), squeeze=False)
    try:
        for ax, source in zip(axes[0], sources, strict=True):
            for label, m in models.items():
                row = m["cells"].get(source, {})
                points = sorted((int(L), c["ppl"]) for L, c in row.items() if c.get("ppl") is not None)
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, marker="o", label=label)
            lengths = sorted(int(L) for L in cfg.get("lengths", []))
            ax.set_xscale("log", base=2)
            if lengths:
                ax.set_xticks(lengths, [length_label(L) for L in lengths])
                ax.minorticks_off()
            ax.set_xlabel("window length (tokens)")
            ax.set_ylabel("perplexity")
            split = next((s.get("split") for s in cfg.get("sources", []) if s.get("label") == source), None)
            ax.set_title(f"{source} ({split or cfg.get('split')})", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def write_report(record: dict, out_dir: str | os.PathLike, name: str = "heldout") -> dict[str, Path]:
    """Write ``<name>.json``, ``<name>.md`` (Table 7 layout) and ``<name>.png``; the last two from the JSON."""
    _check_record(record)
    out_dir = Path(out_dir)
    check_file_name(name, option="name")
    paths = {"json": out_dir / f"{name}.json", "table": out_dir / f"{name}.md", "plot": out_dir / f"{name}.png"}
    write_record(paths["json"], record, device=record["config"].get("device", "cpu"))
    saved = load_json(paths["json"])  # draw from what was written, as a later --plot-only would
    atomic_write_text(paths["table"], table7_markdown(saved))
    plot(saved, paths["plot"])
    return paths


# --------------------------------------------------------------------------- command line


def _parse_lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths takes comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"--lengths takes comma-separated integers, got {text!r}")
    return values


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


@dataclass(frozen=True)
class HeldoutConfig:
    """One held-out evaluation (``bayeslayer heldout``); each field is the option of the same name.

    models: ``(label, directory)`` pairs (a model directory or an ``lm train`` run directory).
    sources: corpora, ``"SOURCE"`` or ``"LABEL=SOURCE"``; lengths: window lengths.
    max_documents: one cap for every source, or ``{source: cap}``; source_splits: ``{source: split}``.
    out, name: the report is ``<out>/<name>.json``, ``.md`` and ``.png``.
    The rest are :func:`evaluate_heldout`'s arguments of the same name.
    """

    models: tuple[tuple[str, str], ...] = ()
    sources: tuple[str, ...] = ("python-docs",)
    lengths: tuple[int, ...] = PAPER_LENGTHS
    split: str = "test"
    reference: str | None = None
    tokenizer: str | None = None
    windows: str = "non-overlapping"
    stride: int | None = None
    max_windows: int | None = None
    max_documents: int | Mapping[str, int] | None = None
    source_splits: Mapping[str, str] | None = None
    batch_size: int = 4
    device: str = "auto"
    precision: str = "fp32"
    cache_dir: str | None = None
    out: str = "results/heldout"
    name: str = "heldout"
    progress: bool = True

    def __post_init__(self) -> None:
        models = self.models
        if isinstance(models, (str, bytes)) or not isinstance(models, Sequence):
            raise TypeError(f"models must be a sequence of (label, path) pairs, got {type(models).__name__}")
        for item in models:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(f"models: each entry must be a (label, path) pair, got {item!r}")
        object.__setattr__(self, "models", tuple((label, str(path)) for label, path in models))
        for name in ("sources", "lengths"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise TypeError(f"{name} must be a sequence, got {type(value).__name__}")
            object.__setattr__(self, name, tuple(value))
        check_file_name(self.name, option="name")


def run(config: HeldoutConfig) -> dict:
    """Evaluate ``config``; write ``<out>/<name>.json``, ``.md`` (Table 7 layout) and ``.png``; return the record.

    Checks the output folder and every model folder before any corpus is resolved or a model loaded.
    """
    if not isinstance(config, HeldoutConfig):
        raise TypeError(f"config must be a HeldoutConfig, got {type(config).__name__}")
    check_out_dir(config.out)
    if not config.models:
        raise UsageError("give at least one --model [LABEL=]DIR")
    for label, path in config.models:  # before the corpora are resolved or a model is loaded
        check_in_dir(path, option=f"--model {label}=", what="model or run folder")
    record = evaluate_heldout(
        list(config.models), list(config.sources), list(config.lengths), split=config.split,
        reference=config.reference, tokenizer=config.tokenizer, windows=config.windows, stride=config.stride,
        max_windows=config.max_windows, max_documents=config.max_documents, source_splits=config.source_splits,
        batch_size=config.batch_size, device=config.device, precision=config.precision, cache_dir=config.cache_dir,
        progress=config.progress)
    if int(os.environ.get("RANK", "0")) == 0:
        paths = write_report(record, config.out, config.name)
        print(table7_markdown(record))
        print(f"wrote {paths['json']}, {paths['table']}, {paths['plot']}")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return record


def redraw(out: str | os.PathLike, name: str = "heldout") -> dict:
    """``bayeslayer heldout --plot-only``: redraw ``<out>/<name>.md`` and ``.png`` from ``<out>/<name>.json``."""
    out_dir = check_out_dir(out)
    record = plot_only_json(out_dir, name, experiment="heldout")
    with redrawing(out_dir / f"{name}.json"):
        _check_record(record)
        atomic_write_text(out_dir / f"{name}.md", table7_markdown(record))
        plot(record, out_dir / f"{name}.png")
        print(table7_markdown(record))
    return record


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
    out = check_out_dir(args.out)
    # a refused command leaves no folder behind (remove_if_unused)
    with OutputLock(out, remove_if_unused=True) if int(os.environ.get("RANK", "0")) == 0 \
            else contextlib.nullcontext():
        if args.plot_only:  # one writer per output folder, as for training runs
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
    p.add_argument("--lengths", type=_parse_lengths, default=None,
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


__all__ = [
    "PAPER_LENGTHS", "PAPER_TABLE7", "WINDOW_MODES", "HeldoutConfig", "HeldoutModel", "HeldoutSource", "add_parser",
    "as_source", "config_from_args", "evaluate_heldout", "heldout_perplexity", "load_heldout_stream", "plot",
    "redraw", "relative_change", "resolve_model", "run", "table7_markdown", "window_plan", "write_report",
]
