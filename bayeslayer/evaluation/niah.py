"""RULER needle-in-a-haystack evaluation (docs/theory.md §8.6): greedy decoding and RULER's scoring.

The prompts (the eight RULER NIAH tasks, RULER's text, exact length and located depth) come from
:mod:`bayeslayer.data.niah`.  :func:`evaluate` decodes a model's answers to every task × length × depth cell
(:func:`generate_answers`: ``model.generate`` with the recurrent cache) and scores them.

Scoring is RULER's ``string_match_all``: a sample scores the fraction of its expected values found
(case-insensitive substring) in the decoded continuation, reported in percent.  The summary
(:func:`summarize`) is the average over six tasks, :data:`SUMMARY_TASKS` (see there for why these six).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..checks import check_int
from ..data.niah import DEFAULT_MAX_NEW_TOKENS, TASKS, NiahGenerator, NiahSample, NiahTokenizer, check_task
from .lengths import PAPER_LENGTHS

#: The six tasks of the summary average.  The paper names niah_single_1, niah_single_2,
#: niah_multivalue and niah_multiquery among its six and excludes CWE; of the other four
#: NIAH variants we keep the two that share the essay haystack (niah_single_3,
#: niah_multikey_1) and drop niah_multikey_2/3, whose haystack is made of needles (a
#: key-value-list lookup rather than a needle in prose; small models score near zero
#: there, which would dilute the average).  ``--summary-tasks`` changes the choice.
SUMMARY_TASKS: tuple[str, ...] = (
    "niah_single_1", "niah_single_2", "niah_single_3",
    "niah_multikey_1", "niah_multivalue", "niah_multiquery",
)
DEFAULT_DEPTHS = tuple(float(d) for d in range(0, 101, 10))


# ----------------------------------------------------------------------------- scoring


def score_prediction(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all`` for one sample: the fraction of ``answers`` that occur in
    ``prediction`` (case-insensitive substring), in [0, 1]."""
    if not isinstance(prediction, str):
        raise TypeError(f"prediction must be a str, got {type(prediction).__name__}")
    if isinstance(answers, str) or not answers or not all(isinstance(a, str) and a for a in answers):
        raise ValueError(f"answers must be a non-empty list of non-empty str, got {answers!r}")
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def score_predictions(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """Mean per-sample score in percent (RULER reports 0..100)."""
    if len(predictions) != len(answers) or not predictions:
        raise ValueError(f"need as many predictions as answer lists (>0), got {len(predictions)} and {len(answers)}")
    return 100.0 * sum(score_prediction(p, a) for p, a in zip(predictions, answers, strict=True)) / len(predictions)


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def generate_answers(model: torch.nn.Module, samples: Sequence[NiahSample], tokenizer: Any,
                     *, batch_size: int = 1) -> list[str]:
    """Greedy continuations (``model.generate(do_sample=False, use_cache=True)``: one prefill, then one token
    per step on the recurrent cache, also for a model folder whose config says ``use_cache: false``, as
    ``lm train`` wrote them before) of ``samples``, decoded up to the first end-of-text token.  Samples of
    one batch must have the same length (a cell's samples do), so no padding is needed."""
    tok = tokenizer if isinstance(tokenizer, NiahTokenizer) else NiahTokenizer(tokenizer)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    eos = tok.eos_id()
    device = next(model.parameters()).device
    out: list[str] = []
    for i in range(0, len(samples), batch_size):
        batch = samples[i:i + batch_size]
        lengths = {len(s.input_ids) for s in batch}
        new_tokens = {s.max_new_tokens for s in batch}
        if len(lengths) != 1 or len(new_tokens) != 1:
            raise ValueError(f"a batch needs samples of one length and max_new_tokens, got {lengths}, {new_tokens}")
        ids = torch.tensor([s.input_ids for s in batch], dtype=torch.long, device=device)
        kwargs = {"eos_token_id": eos, "pad_token_id": eos} if eos is not None else {"pad_token_id": 0}
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens.pop(),
                             do_sample=False, use_cache=True, **kwargs)
        for row in gen[:, ids.shape[1]:].tolist():
            if eos is not None and eos in row:
                row = row[: row.index(eos)]
            out.append(tok.decode(row))
    return out


def evaluate(
    model: torch.nn.Module,
    generator: NiahGenerator,
    *,
    tasks: Sequence[str] = tuple(TASKS),
    lengths: Sequence[int] = PAPER_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples_per_cell: int = 30,
    max_new_tokens: int | dict[str, int] = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = 1,
    progress: Callable[[str], None] | None = None,
    predictions: list[dict] | None = None,
) -> list[dict]:
    """Score ``model`` on every task × length × depth cell.

    Returns one record per cell: ``{"task", "length", "depth", "n", "score", "scores",
    "depth_realized"}`` with ``score`` the mean of the per-sample ``scores`` (percent).
    Each decoded prediction is appended to ``predictions`` when a list is given.
    """
    for t in tasks:
        check_task(t)
    samples_per_cell = check_int("samples_per_cell", samples_per_cell, minimum=1)
    model.eval()
    cells = []
    for task in tasks:
        budget = max_new_tokens[task] if isinstance(max_new_tokens, dict) else max_new_tokens
        for length in lengths:
            for depth in depths:
                samples = [generator.sample(task, length, depth, i, max_new_tokens=budget)
                           for i in range(samples_per_cell)]
                answers = generate_answers(model, samples, generator.tokenizer, batch_size=batch_size)
                scores = [100.0 * score_prediction(p, s.answers) for p, s in zip(answers, samples, strict=True)]
                cells.append({
                    "task": task, "length": int(length), "depth": float(depth), "n": len(scores),
                    "score": sum(scores) / len(scores), "scores": scores,
                    "depth_realized": [round(s.depth_realized, 3) for s in samples],
                })
                if predictions is not None:
                    predictions.extend({"task": task, "length": length, "depth": depth, "index": s.index,
                                        "answers": s.answers, "prediction": p}
                                       for s, p in zip(samples, answers, strict=True))
                if progress is not None:
                    progress(f"{task} length={length} depth={depth:g}: {cells[-1]['score']:.1f}")
    return cells


def summarize(cells: Sequence[dict], summary_tasks: Sequence[str] = SUMMARY_TASKS) -> dict:
    """Per task × length means (over depths and samples, every cell weighted equally) and the
    summary: the mean over ``summary_tasks`` per length (tasks missing from ``cells`` are
    left out of the average and listed under ``"missing"``)."""
    by_task: dict[str, dict[str, list[float]]] = {}
    for c in cells:
        by_task.setdefault(c["task"], {}).setdefault(str(c["length"]), []).append(c["score"])
    task_length = {t: {L: sum(v) / len(v) for L, v in d.items()} for t, d in by_task.items()}
    present = [t for t in summary_tasks if t in task_length]
    lengths = sorted({L for d in task_length.values() for L in d}, key=int)
    summary = {}
    for L in lengths:
        vals = [task_length[t][L] for t in present if L in task_length[t]]
        if vals:
            summary[L] = sum(vals) / len(vals)
    return {"task_length": task_length, "summary": summary, "summary_tasks": present,
            "missing": [t for t in summary_tasks if t not in task_length]}


def depth_length_grid(cells: Sequence[dict], summary_tasks: Sequence[str] = SUMMARY_TASKS) -> dict:
    """``{(depth, length): (mean over summary tasks, fewest samples of any summary task)}``."""
    acc: dict[tuple[float, int], list[tuple[float, int]]] = {}
    for c in cells:
        if c["task"] in summary_tasks:
            acc.setdefault((float(c["depth"]), int(c["length"])), []).append((c["score"], c["n"]))
    return {k: (sum(s for s, _ in v) / len(v), min(n for _, n in v)) for k, v in acc.items()}


__all__ = ["DEFAULT_DEPTHS", "SUMMARY_TASKS", "depth_length_grid", "evaluate", "generate_answers", "score_prediction",
           "score_predictions", "summarize"]
