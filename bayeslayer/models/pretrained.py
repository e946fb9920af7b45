"""A causal language model from a folder, whatever wrote it: ours, a Gated DeltaNet checkpoint, any ``AutoModel``.

The one loader the evaluations (``niah``, ``heldout``, ``distill``'s teacher) share.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def load_model(path: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
               trust_remote_code: bool = False):
    """A causal LM from a directory: a flash-linear-attention Gated DeltaNet checkpoint
    (``model_type: gated_deltanet``, read by :func:`~bayeslayer.models.load_gdn_checkpoint`)
    or any ``AutoModelForCausalLM`` (``bayeslayer`` models are registered on import).

    Loading is strict (:mod:`bayeslayer.models.loading`): a folder with a ``manifest.json`` (or whose
    ``config.json`` says it had one) is verified, only safetensors weights are read, a config whose sizes
    cannot fit in memory is refused naming the field, and missing, unexpected or mis-shaped tensors, then
    NaN/Inf weights, are one ``ValueError`` naming the folder.  A config that asks to run code from the folder
    (``auto_map`` of a model type this installation does not know) is refused unless
    ``trust_remote_code=True`` — transformers is never left to ask on the terminal.
    """
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from .fla_import import load_gdn_checkpoint
    from .loading import (
        check_finite,
        check_loading_info,
        check_remote_code,
        naming_config,
        quiet_transformers,
        read_model_config,
        safetensors_error,
        verify_model_dir,
    )

    path = Path(path)
    verify_model_dir(path)
    raw = read_model_config(path)
    if raw.get("model_type") == "gated_deltanet":
        return load_gdn_checkpoint(path, dtype=dtype, device=device)
    check_remote_code(path, raw, trust_remote_code=trust_remote_code)
    try:
        # no "Loading weights" bar per model burying the evaluation's own lines
        with quiet_transformers(), naming_config(path):
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                               ignore_mismatched_sizes=True, use_safetensors=True,
                                                               output_loading_info=True)
    except SafetensorError as exc:
        raise safetensors_error(path, exc) from exc
    except (TypeError, KeyError, StrictDataclassError) as exc:  # a config transformers cannot build a model from
        raise ValueError(f"cannot build a model from {path / 'config.json'} (model_type "
                         f"{raw.get('model_type')!r}): {' '.join(str(exc).split())[:300]}") from exc
    check_loading_info(path, info)  # shapes before values: a tensor of another shape was never loaded
    check_finite(model, path)
    return model.to(device)


__all__ = ["load_model"]
