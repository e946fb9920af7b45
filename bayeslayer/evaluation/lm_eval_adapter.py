"""lm-evaluation-harness with bayeslayer models: the ``bayeslayer`` model and lm-eval's command line.

lm-eval 0.4.13 (the newest release) finds a model backend only in its own registry, filled by
its built-in modules or by ``@register_model`` in a module the running interpreter imported
(entry-point plugins are announced for a later release).  Its model guide says to register
out-of-tree models and call ``simple_evaluate`` from Python, or to load any model transformers'
``AutoModelForCausalLM`` knows with ``--model hf``.  We do both, as flash-linear-attention's
``evals/harness.py`` does for its architectures: importing this module imports
``bayeslayer.models`` (which registers ``model_type: bayeslayer`` with the Auto classes, no remote
code) and registers :class:`BayesLayerLM` as ``--model bayeslayer``; running it runs lm-eval's own
command line::

    python -m bayeslayer.evaluation --model bayeslayer --model_args pretrained=DIR,max_length=4096 \\
        --tasks wikitext --batch_size 1

``--model hf --model_args pretrained=DIR`` works the same way under this command (the Auto
classes are registered).  ``bayeslayer`` adds two things to lm-eval's ``HFLM``: a directory
holding only a ``tokenizer.json`` (what our pipelines write) becomes a transformers tokenizer with
its end-of-text token set (lm-eval needs it), and a flash-linear-attention Gated DeltaNet
checkpoint (``model_type: gated_deltanet``) is read with
:func:`~bayeslayer.models.load_gdn_checkpoint`, so the teacher runs on CPU too.

Generation (``generate_until``) goes through ``model.generate(..., use_cache=True)``: the prompt is
prefilled once with the chunked path and every new token is one decode step on the recurrent cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .. import models as _models  # noqa: F401  (registers model_type "bayeslayer" with the Auto classes)
from ..files import read_json
from ..models import load_gdn_checkpoint
from .tasks import hf_tokenizer

_DTYPES = {"float32": "float32", "fp32": "float32", "float64": "float64", "bfloat16": "bfloat16",
           "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "auto": None}


def _local_dir(path: Any) -> Path | None:
    return Path(path) if isinstance(path, (str, Path)) and Path(path).is_dir() else None


def _tokenizer_for(tokenizer: Any, pretrained: Any) -> Any:
    """A directory or ``tokenizer.json`` without a ``tokenizer_config.json`` becomes :func:`hf_tokenizer`."""
    source = tokenizer if tokenizer is not None else (pretrained if isinstance(pretrained, (str, Path)) else None)
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_file() and path.suffix == ".json":
            return hf_tokenizer(path)
        if path.is_dir() and (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            return hf_tokenizer(path)
    return tokenizer


@register_model("bayeslayer")
class BayesLayerLM(HFLM):
    """lm-eval's ``HFLM`` for bayeslayer models and flash-linear-attention Gated DeltaNet checkpoints.

    Takes ``HFLM``'s arguments (``pretrained``, ``tokenizer``, ``max_length``, ``batch_size``,
    ``dtype``, ``device``, ...).  ``pretrained`` is a model instance or a directory: a
    ``bayeslayer`` ``save_pretrained`` directory, or an fla Gated DeltaNet checkpoint, read with
    :func:`~bayeslayer.models.load_gdn_checkpoint`.  ``tokenizer`` defaults to ``pretrained``'s
    directory.  A recurrent model has no maximum length of its own, so lm-eval falls back to 2048
    tokens (it left-truncates longer prompts and uses it as the rolling window): pass
    ``max_length`` for long-context tasks.
    """

    def __init__(self, pretrained: Any = None, tokenizer: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("trust_remote_code", False)  # code from a model folder runs only on explicit request
        tokenizer = _tokenizer_for(tokenizer, pretrained)
        directory = _local_dir(pretrained)
        if directory is not None and (directory / "config.json").is_file():
            if read_json(directory / "config.json", what="model config").get("model_type") == "gated_deltanet":
                import torch

                dtype = _DTYPES.get(str(kwargs.pop("dtype", "float32")), "float32")
                device = kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")  # HFLM's default
                pretrained = load_gdn_checkpoint(directory, dtype=getattr(torch, dtype or "float32"),
                                                 device=device)
                if tokenizer is None:
                    tokenizer = hf_tokenizer(directory)
        super().__init__(pretrained=pretrained, tokenizer=tokenizer, **kwargs)


def main() -> None:
    """lm-eval's command line (``lm_eval ...``) with bayeslayer's models registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


__all__ = ["BayesLayerLM", "main"]

if __name__ == "__main__":
    main()
