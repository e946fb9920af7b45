"""MQAR query accuracy (docs/theory.md §8.4): how many queries a model answers, overall and per slice of the data
(:func:`query_counts`), and the evaluation a trained MQAR model gets (:func:`final_evaluation`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..data.mqar import IGNORE_INDEX, MQARData, MQARDataset


def query_counts(model: nn.Module, data: MQARData, batch: int,
                 slice_of: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Correct and total queries of ``model`` on ``data``, overall and per slice.

    ``slice_of[name]``: ``[N]`` (per sequence) or ``[N, L]`` (per position) values; returns
    ``{"correct", "queries", "accuracy", "slices": {name: {value: {"correct", "queries", "accuracy"}}}}``.
    """
    slice_of = slice_of or {}
    correct = queries = 0
    per: dict[str, dict[int, list[int]]] = {name: {} for name in slice_of}
    for start in range(0, len(data), batch):
        idx = slice(start, start + batch)
        device = next(model.parameters(), torch.empty(0)).device  # (a parameterless model: CPU)
        labels = data.labels[idx].to(device)
        mask = labels != IGNORE_INDEX
        hit = (model(data.inputs[idx].to(device)).argmax(-1) == labels) & mask
        correct += int(hit.sum())
        queries += int(mask.sum())
        for name, values in slice_of.items():
            vals = values[idx].to(device)
            if vals.dim() == 1:
                vals = vals[:, None].expand_as(labels)
            for v in vals[mask].unique().tolist():
                sel = vals == v
                c = per[name].setdefault(int(v), [0, 0])
                c[0] += int((hit & sel).sum())
                c[1] += int((mask & sel).sum())

    def acc(c: int, n: int) -> float:
        return c / n if n else float("nan")

    return {"correct": correct, "queries": queries, "accuracy": acc(correct, queries),
            "slices": {name: {v: {"correct": c, "queries": n, "accuracy": acc(c, n)}
                              for v, (c, n) in sorted(d.items())} for name, d in per.items()}}


def final_evaluation(task: str, val: MQARDataset, tests: list[tuple[int, MQARData]], batch: int):
    """``final_eval(model)`` of an MQAR ``task`` (base, update or block): the accuracy on the validation set ``val``
    (a learning-rate grid's selection score) per segment and overall, and on every ``(x, test set)`` of ``tests``,
    per number of writes the queried key received, ``batch`` sequences at a time."""
    val_slices = {"base": "num_pairs", "update": "num_updates", "block": "num_pairs"}[task]

    def evaluate(model: nn.Module) -> dict[str, Any]:
        correct = queries = 0
        by_segment = []
        for seg in val.segments:
            r = query_counts(model, seg, batch)
            correct, queries = correct + r["correct"], queries + r["queries"]
            by_segment.append({"seq_len": seg.seq_len, val_slices: int(seg.slices[val_slices][0]),
                               "accuracy": r["accuracy"], "queries": r["queries"]})
        points = []
        for x, data in tests:
            r = query_counts(model, data, batch, {"writes_of_queried_key": data.query_writes})
            points.append({"x": x, "accuracy": r["accuracy"], "queries": r["queries"],
                           "by_writes_of_queried_key": r["slices"]["writes_of_queried_key"]})
        return {"val_accuracy": correct / queries, "val_by_segment": by_segment, "test": points}

    return evaluate


__all__ = ["final_evaluation", "query_counts"]
