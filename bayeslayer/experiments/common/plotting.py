"""Figures drawn from saved results: every experiment plots from its JSON, never from live state.

An experiment writes its numbers with
:func:`bayeslayer.experiments.common.provenance.write_record`, then builds figures from the loaded
dict with :func:`line_plot`, so ``--plot-only DIR`` can redraw them without rerunning anything.
The helpers know nothing about a particular experiment: a figure is a list of :class:`Series`
plus axis labels and optional reference lines (phase boundaries, closed-form values, chance level).

>>> s = Series("model", x=[1, 2, 3], y=[0.5, 0.6, 0.7], err=[0.01, 0.02, 0.01])
>>> # line_plot("fig.png", [s], xlabel="step", ylabel="accuracy", hlines=[RefLine(0.5, "chance")])

Lengths are named alike in every table and plot by :func:`bayeslayer.evaluation.lengths.length_label`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Series:
    """One curve: ``y`` over ``x``, with an optional symmetric band ``y ± err`` (e.g. std over seeds).

    ``style`` is passed to ``Axes.plot`` (``marker``, ``linestyle``, ``color``, ...).
    """

    label: str
    x: Sequence[float]
    y: Sequence[float]
    err: Sequence[float] | None = None
    style: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.label, str):
            raise TypeError(f"Series label must be a str, got {type(self.label).__name__}")
        if len(self.x) != len(self.y):
            raise ValueError(f"Series {self.label!r}: x has {len(self.x)} points but y has {len(self.y)}")
        if len(self.x) == 0:
            raise ValueError(f"Series {self.label!r} is empty")
        if self.err is not None and len(self.err) != len(self.y):
            raise ValueError(f"Series {self.label!r}: err has {len(self.err)} points but y has {len(self.y)}")
        for name, values in (("x", self.x), ("y", self.y), ("err", self.err or ())):
            bad = [v for v in values if not isinstance(v, (int, float)) or not math.isfinite(v)]
            if bad:
                raise ValueError(
                    f"Series {self.label!r}: {name} has non-finite or non-numeric values {bad[:3]}"
                )


@dataclass(frozen=True)
class RefLine:
    """A labelled reference line at ``value`` (vertical in ``vlines``, horizontal in ``hlines``)."""

    value: float
    label: str = ""
    style: dict[str, Any] = field(default_factory=dict)


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Lay out ``fig`` and write it to ``path`` (PNG, 120 dpi), creating the folder; the caller closes it."""
    from ...files import atomic_write

    fig.tight_layout()
    path = Path(path)
    with atomic_write(path, "wb") as fh:  # never half a figure, never through a link at ``path``
        fig.savefig(fh, format=path.suffix.lstrip(".").lower() or "png", dpi=120)
    return path


class MissingKeyError(KeyError, ValueError):
    """A results file lacks a key its reader needs: a ``KeyError`` for code that looks keys up, and a
    ``ValueError`` (an expected failure, one line on the command line) whose message names the file."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class _Record(dict):
    """A JSON object read from ``path``: a missing key raises :class:`MissingKeyError` naming the file."""

    path: str = ""

    def __missing__(self, key):
        raise MissingKeyError(f"{self.path} has no key {key!r} where one was expected: it is not a results file "
                              "this command wrote, or it was edited; rerun the experiment to rewrite it")


def _records(obj, path: str):
    if isinstance(obj, dict):
        record = _Record({k: _records(v, path) for k, v in obj.items()})
        record.path = path
        return record
    if isinstance(obj, list):
        return [_records(v, path) for v in obj]
    return obj


def load_json(path: str | os.PathLike) -> dict:
    """Read a results JSON; a clear error when it is missing, damaged or not a JSON object.

    Every object in it is returned as a ``dict`` whose missing keys raise :class:`MissingKeyError`
    naming the file, so a reader that meets a file of the wrong shape says which file and key.
    """
    from ...files import read_json

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no results file at {path}; run the experiment with --out first")
    obj = read_json(path, what="results file")
    if not isinstance(obj, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(obj).__name__}")
    return _records(obj, str(path))


def line_plot(
    path: str | os.PathLike,
    series: Sequence[Series],
    *,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    vlines: Sequence[RefLine] = (),
    hlines: Sequence[RefLine] = (),
    xscale: str = "linear",
    ylim: tuple[float, float] | None = None,
    legend_loc: str = "best",
    figsize: tuple[float, float] = (6.4, 4.0),
    xticks: Sequence[float] | None = None,
) -> Path:
    """Draw ``series`` as lines (with ``± err`` bands) into a PNG at ``path`` and return the path.

    Vertical reference lines (e.g. phase boundaries) are dotted and labelled at the top of
    the axes; horizontal ones (e.g. a closed-form value, chance) are dashed and go in the legend.
    ``legend_loc="outside"`` puts the legend to the right of the axes, where it hides no point.
    ``xticks``: the x ticks, labelled as plain numbers (on a log axis too: 1, 2, 4, 8, not 10⁰, 2×10⁰).
    """
    if not series:
        raise ValueError("line_plot needs at least one Series")
    if xscale not in ("linear", "log"):
        raise ValueError(f"xscale must be 'linear' or 'log', got {xscale!r}")
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    try:
        for s in series:
            (line,) = ax.plot(s.x, s.y, label=s.label, **s.style)
            if s.err is not None:
                lo = [y - e for y, e in zip(s.y, s.err, strict=True)]
                hi = [y + e for y, e in zip(s.y, s.err, strict=True)]
                ax.fill_between(s.x, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        for ref in hlines:
            style = {"color": "0.4", "linestyle": "--", "linewidth": 1.0, **ref.style}
            ax.axhline(ref.value, label=ref.label or None, **style)
        for ref in vlines:
            style = {"color": "0.5", "linestyle": ":", "linewidth": 1.0, **ref.style}
            ax.axvline(ref.value, **style)
            if ref.label:
                ax.annotate(
                    ref.label,
                    xy=(ref.value, 1.0),
                    xycoords=("data", "axes fraction"),
                    xytext=(3, -3),
                    textcoords="offset points",
                    ha="left",
                    va="top",
                    fontsize=8,
                    color="0.3",
                )
        ax.set_xscale(xscale)
        if xticks is not None:
            from matplotlib.ticker import NullFormatter, NullLocator

            ax.set_xticks(list(xticks), [f"{t:g}" for t in xticks])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_minor_formatter(NullFormatter())
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if title:
            ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if legend_loc == "outside":
            ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)
        else:
            ax.legend(loc=legend_loc, fontsize=8)
        return save_figure(fig, path)
    finally:
        plt.close(fig)
