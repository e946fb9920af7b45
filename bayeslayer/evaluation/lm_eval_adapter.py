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
classes are registered, and ``model_type: bayeslayer`` is marked as a causal LM in the table lm-eval's
``HFLM`` reads, so it does not warn that the type is "neither marked as CausalLM or Seq2SeqLM").

The command line also finds the tasks the package ships (:func:`~bayeslayer.evaluation.tasks.default_task_dir`:
``bayeslayer_perplexity``, offline, on the default corpus) without ``--include_path``::

    python -m bayeslayer.evaluation run --model bayeslayer --model_args pretrained=DIR --tasks bayeslayer_perplexity

and records lm-eval's ``git_hash`` without running ``git`` (:func:`main`).

``bayeslayer`` adds three things to lm-eval's ``HFLM``: a directory holding only a ``tokenizer.json``
(what our pipelines write) becomes a transformers tokenizer with its end-of-text token set (lm-eval
needs it), an ``lm train`` run folder stands for its ``final/`` model, and a flash-linear-attention
Gated DeltaNet checkpoint (``model_type: gated_deltanet``) is read with
:func:`~bayeslayer.models.load_gdn_checkpoint`, so the teacher runs on CPU too.

Generation (``generate_until``) goes through ``model.generate(..., use_cache=True)``: the prompt is
prefilled once with the chunked path and every new token is one decode step on the recurrent cache.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..files import read_json
from ..models import BayesLayerConfig, BayesLayerForCausalLM, load_gdn_checkpoint  # registers the Auto classes
from .tasks import default_task_dir, hf_tokenizer

# lm-eval's HFLM tells a causal LM from a sequence-to-sequence one by transformers' tables of model-type
# names, which ``AutoModelForCausalLM.register`` (what bayeslayer.models does) leaves alone; without an
# entry it warns that the type is "neither marked as CausalLM or Seq2SeqLM".  transformers' own lookups
# only use names that also have a built-in config, so the entry changes nothing else.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(BayesLayerConfig.model_type, BayesLayerForCausalLM.__name__)

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
    ``bayeslayer`` ``save_pretrained`` directory, an ``lm train`` run folder (its ``final/``), or an fla
    Gated DeltaNet checkpoint, read with :func:`~bayeslayer.models.load_gdn_checkpoint`.  ``tokenizer``
    defaults to ``pretrained``'s directory.  A recurrent model has no maximum length of its own, so
    lm-eval falls back to 2048 tokens (it left-truncates longer prompts and uses it as the rolling
    window): pass ``max_length`` for long-context tasks.
    """

    def __init__(self, pretrained: Any = None, tokenizer: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("trust_remote_code", False)  # code from a model folder runs only on explicit request
        directory = _local_dir(pretrained)
        if directory is not None and (directory / "final" / "lm_config.json").is_file():
            pretrained = directory = directory / "final"  # an `lm train` run folder: its finished model
        tokenizer = _tokenizer_for(tokenizer, pretrained)
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


def task_manager(include_path: str | os.PathLike | list | None = None, **kwargs: Any):
    """lm-eval's ``TaskManager`` that also finds the package's tasks
    (:func:`~bayeslayer.evaluation.tasks.default_task_dir`), for ``simple_evaluate(..., task_manager=task_manager())``.

    ``include_path``: a folder of your own tasks or a list of them, searched after ours (a task of yours
    with the same name wins); ``kwargs`` go to ``TaskManager`` (``include_defaults=False`` skips indexing
    lm-eval's built-in tasks)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=_with_package_tasks(include_path), **kwargs)


def _with_package_tasks(include_path: Any, *, required: bool = True) -> list[str]:
    """``[our task folder, *include_path]``; without ``required``, a task folder that cannot be written (no
    standard library to read, a cache folder that is not writable) is a warning and only ``include_path``
    is returned, so tasks that do not need ours still run."""
    if include_path is None:
        theirs = []
    elif isinstance(include_path, (str, os.PathLike)):
        theirs = [str(include_path)]
    elif isinstance(include_path, (list, tuple)) and all(isinstance(p, (str, os.PathLike)) for p in include_path):
        theirs = [str(p) for p in include_path]
    else:
        raise TypeError(f"include_path must be a folder path, a list of them or None, got {include_path!r}")
    try:
        ours = default_task_dir()
    except (OSError, ValueError) as exc:
        if required:
            raise
        import warnings

        warnings.warn(f"bayeslayer's lm-eval tasks (bayeslayer_perplexity) are not available: {exc}", RuntimeWarning,
                      stacklevel=2)
        return theirs
    return [str(ours), *theirs]


def _git_hash_from_files() -> str | None:
    """The commit of the checkout holding the working directory, read from its ``.git`` with lm-eval's own
    reader (what lm-eval records when git is not installed); ``None`` outside a checkout."""
    from lm_eval.loggers.utils import get_commit_from_path

    here = Path.cwd()
    for folder in (here, *here.parents):
        if (folder / ".git").exists():
            return get_commit_from_path(folder)
    return None


@contextlib.contextmanager
def _git_hash_without_git() -> Iterator[None]:
    """lm-eval records ``git_hash`` (the commit of the working directory) by running ``git describe``, whose
    "fatal: not a git repository" reaches the terminal whenever the command runs outside a checkout.  Inside
    the block lm-eval reads the same commit from the ``.git`` folder instead (the full hash; no process)."""
    import lm_eval.evaluator as evaluator

    saved = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = _git_hash_from_files
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = saved


def main() -> None:
    """lm-eval's command line (``lm_eval ...``: ``run``, ``ls``, ``validate``) with bayeslayer's models registered
    and the package's tasks (:func:`~bayeslayer.evaluation.tasks.default_task_dir`) on lm-eval's task path,
    before any ``--include_path`` (the command's, or its ``--config`` file's), so ``--tasks
    bayeslayer_perplexity`` needs no ``--include_path``; lm-eval's ``git_hash`` is read from the working
    directory's ``.git`` folder instead of by running ``git`` (:func:`_git_hash_without_git`).

    The steps of lm-eval 0.4.13's ``cli_evaluate``, with the task path set between parsing and running."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    if getattr(args, "command", None) in ("run", "ls", "validate"):
        include_path = getattr(args, "include_path", None)
        if include_path is None and getattr(args, "config", None):
            from lm_eval.config.evaluate_config import EvaluatorConfig

            include_path = EvaluatorConfig.load_yaml_config(args.config).get("include_path")
        args.include_path = _with_package_tasks(include_path, required=False) or None
    with _git_hash_without_git():
        parser.execute(args)


__all__ = ["BayesLayerLM", "main", "task_manager"]

if __name__ == "__main__":
    main()
