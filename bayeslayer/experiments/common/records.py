"""Results of the synthetic experiments: :func:`summarize` (mean ± std over seeds), :func:`summarize_curves`,
:func:`compute_summary` (a compute-matched model's steps, FLOPs and seconds), :func:`results_record` (the common
record layout) and :func:`write_json` (a cache file, written atomically).  Results records themselves are written
by :func:`bayeslayer.experiments.common.provenance.write_record`, which adds their provenance."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...files import atomic_write_json
from .provenance import jsonable


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Mean and sample standard deviation (``ddof = 1``; 0 for one seed) of per-seed numbers."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("summarize needs at least one value")
    arr = np.asarray(vals)
    std = float(arr.std(ddof=1)) if len(vals) > 1 else 0.0
    return {"mean": float(arr.mean()), "std": std, "values": vals}


def compute_summary(records: Sequence[dict]) -> dict:
    """Mean ± std over seeds of a compute-matched model's steps, FLOPs and CPU and wall seconds (``"compute"`` of
    each seed's record); a number some seed did not record (a resumed checkpoint of an older version) is left out."""
    out = {}
    for key in ("steps", "flops", "cpu_seconds", "wall_seconds"):
        values = [r["compute"].get(key) for r in records]
        if all(v is not None for v in values):
            out[key] = summarize(values)
    return out


def summarize_curves(curves: Sequence[Sequence[float]]) -> dict[str, list]:
    """Point-wise :func:`summarize` of per-seed curves of equal length: ``{"mean": [...], "std": [...]}``."""
    if not curves or len({len(c) for c in curves}) != 1:
        raise ValueError(f"curves must be a non-empty list of equal-length lists, got lengths "
                         f"{[len(c) for c in curves]}")
    cols = [summarize(col) for col in zip(*curves, strict=True)]
    return {"mean": [c["mean"] for c in cols], "std": [c["std"] for c in cols]}


def write_json(path: str | os.PathLike, obj: dict) -> None:
    """Write ``obj`` as indented JSON atomically and durably (:func:`bayeslayer.files.atomic_write_json`)."""
    atomic_write_json(path, jsonable(obj))


def results_record(experiment: str, preset: str, config: dict, models: dict, **extra: Any) -> dict:
    """The common results layout: ``{"experiment", "preset", "config", "models", ...extra}``.

    ``models[name]`` holds ``"seeds"`` (one dict of raw metrics per seed) and
    ``"summary"`` (mean ± std over seeds, from :func:`summarize` / :func:`summarize_curves`).
    """
    return {"experiment": experiment, "preset": preset, "config": config, "models": models, **extra}
