"""Opt-in ``auto_map``: plain ``transformers`` loads a bayeslayer directory without ``import bayeslayer``.

``transformers`` resolves a ``model_type`` it does not ship in exactly two ways: a class registered
in the running interpreter (``import bayeslayer.models`` does that: the safe default, nothing in the
model directory runs), or ``auto_map`` in ``config.json`` naming a Python file *in the model
directory*, which ``from_pretrained`` imports only with ``trust_remote_code=True``.  It has no
entry-point or plugin lookup (``transformers`` 5.24), so "no import first" needs ``auto_map``.

:func:`export_auto_map` writes the smallest such file, :data:`SHIM_FILE`: three imports from the
*installed* ``bayeslayer`` package and nothing else (no model code is copied, so the directory never
carries a second, drifting copy of the model).  It is opt-in because a ``.py`` file next to the
weights is code a user is handed: ``trust_remote_code=True`` runs whatever that file says, so only
pass it for directories you wrote or checked.  Without ``trust_remote_code=True`` transformers
refuses the directory unless ``bayeslayer.models`` is imported, and then it ignores the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..files import atomic_write_text, read_json
from ..models.configuration import BayesLayerConfig

#: The file :func:`export_auto_map` writes next to the weights.
SHIM_FILE = "bayeslayer_auto.py"
_MODULE = SHIM_FILE.removesuffix(".py")
#: ``config.json``'s ``auto_map``: Auto class → ``module.Class`` in :data:`SHIM_FILE`.
AUTO_MAP = {
    "AutoConfig": f"{_MODULE}.BayesLayerConfig",
    "AutoModel": f"{_MODULE}.BayesLayerModel",
    "AutoModelForCausalLM": f"{_MODULE}.BayesLayerForCausalLM",
}
_SHIM = '''"""bayeslayer's model classes for transformers' auto_map, imported from the installed package.

Nothing else: the model code is `pip install bayeslayer`'s, not a copy in this directory.
"""

from bayeslayer.models.configuration import BayesLayerConfig
from bayeslayer.models.modeling import BayesLayerForCausalLM, BayesLayerModel

__all__ = ["BayesLayerConfig", "BayesLayerForCausalLM", "BayesLayerModel"]
'''


def export_auto_map(model_dir: str | os.PathLike) -> Path:
    """Add ``auto_map`` to ``model_dir/config.json`` and write :data:`SHIM_FILE` beside it.

    Afterwards ``AutoConfig/AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)``
    works in an interpreter that never imported bayeslayer (the shim imports the installed package;
    transformers says which package is missing if it is not installed).  ``model_dir`` must be a
    ``save_pretrained`` directory of a ``bayeslayer`` model.  Idempotent.  Returns the shim's path.
    """
    model_dir = Path(model_dir)
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model_dir {model_dir} has no config.json (a save_pretrained directory)")
    config = read_json(config_file, what="model config")
    if config.get("model_type") != BayesLayerConfig.model_type:
        raise ValueError(f"model_dir {model_dir} holds model_type {config.get('model_type')!r}, not "
                         f"{BayesLayerConfig.model_type!r}; save a BayesLayerForCausalLM there first "
                         "(a Gated DeltaNet checkpoint: load_gdn_checkpoint(dir).save_pretrained(out))")
    from ..models.loading import verify_model_dir, write_model_manifest

    signed = verify_model_dir(model_dir)  # a damaged folder is not re-signed below
    shim = model_dir / SHIM_FILE
    atomic_write_text(shim, _SHIM)
    config["auto_map"] = dict(AUTO_MAP)
    atomic_write_text(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n")
    if signed:  # the manifest covers the changed config.json and the shim
        write_model_manifest(model_dir)
    return shim


__all__ = ["AUTO_MAP", "SHIM_FILE", "export_auto_map"]
