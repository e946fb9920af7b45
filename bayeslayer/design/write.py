"""Deprecated: the names this module held, kept for one release.

A design model's write model is one object of the ops' write-model family: ``DesignModel.write_model``
returns it (:mod:`bayeslayer.ops.bayesian_layer.write_models` for ``bayes``, ``diagonal``, ``reset`` and
``latent``; :class:`bayeslayer.ops.bayesian_layer.lowrank.LowRankWrite` for ``lowrank``, built with the
design's rank).  The old names warn (``DeprecationWarning``) and give the nearest new object:

* ``DesignWrite``, ``FilterWrite`` — :class:`~bayeslayer.ops.bayesian_layer.write_models.WriteModel`;
* ``LowRankWrite`` — :class:`~bayeslayer.ops.bayesian_layer.lowrank.LowRankWrite` (now built with its rank);
* ``DESIGN_WRITES`` — ``{name: write model}`` of the general filter's four, and ``"lowrank"``: the
  ``LowRankWrite`` class (a name alone does not make one);
* ``get_design_write(name)`` — :func:`~bayeslayer.ops.bayesian_layer.write_models.get_write_model`.
"""

from __future__ import annotations

import warnings

from ..ops.bayesian_layer.lowrank import LowRankWrite
from ..ops.bayesian_layer.write_models import WRITES, WriteModel, get_write_model

_REPLACED = {
    "DesignWrite": ("bayeslayer.ops.WriteModel", lambda: WriteModel),
    "FilterWrite": ("bayeslayer.ops.WriteModel", lambda: WriteModel),
    "LowRankWrite": ("bayeslayer.ops.bayesian_layer.lowrank.LowRankWrite(rank, projection)", lambda: LowRankWrite),
    "DESIGN_WRITES": ("bayeslayer.ops.WRITE_MODELS (the names) and DesignModel.write_model (the object)",
                      lambda: {**WRITES, LowRankWrite.name: LowRankWrite}),
    "get_design_write": ("bayeslayer.ops.get_write_model, or DesignModel.write_model", lambda: get_write_model),
}


def __getattr__(name: str):
    if name in _REPLACED:
        new, value = _REPLACED[name]
        warnings.warn(f"bayeslayer.design.write.{name} is deprecated: the write models are one family; use {new}",
                      DeprecationWarning, stacklevel=2)
        return value()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
