"""Evaluate bayeslayer models with EleutherAI's lm-evaluation-harness, load them with plain ``transformers``.

* :mod:`bayeslayer.evaluation.lm_eval_adapter` (needs ``lm-eval``, the ``eval`` extra): the ``bayeslayer``
  lm-eval model (a ``HFLM``; also reads flash-linear-attention Gated DeltaNet checkpoints) and
  ``python -m bayeslayer.evaluation.lm_eval_adapter ...``, lm-eval's own command line with bayeslayer's
  models registered (the way flash-linear-attention's ``evals/harness.py`` does it).
* :mod:`bayeslayer.evaluation.tasks`: local lm-eval tasks written from our own data, no
  download: a ``loglikelihood_rolling`` perplexity task over given documents and a
  ``generate_until`` RULER NIAH task from :class:`~bayeslayer.data.niah.NiahGenerator`
  samples, scored by lm-eval's own RULER functions.
* :func:`default_task_dir`: the tasks the package ships (``bayeslayer_perplexity``: the test split of the
  default corpus), written on first use; ``python -m bayeslayer.evaluation`` finds them by name.
* :func:`hf_tokenizer`: a ``tokenizer.json`` (or ``tokenizers.Tokenizer``) as a transformers
  fast tokenizer with its end-of-text token set, what lm-eval's HF backend needs.
* :func:`export_auto_map`: opt-in ``auto_map`` so ``AutoModelForCausalLM.from_pretrained(DIR,
  trust_remote_code=True)`` works without ``import bayeslayer`` (docs/models.md weighs it).

Only :mod:`~bayeslayer.evaluation.lm_eval_adapter` imports lm-eval; this package and ``tasks`` do not.
"""

from .autoload import AUTO_MAP, SHIM_FILE, export_auto_map
from .tasks import PERPLEXITY_TASK, default_task_dir, hf_tokenizer, niah_records, write_niah_task, write_perplexity_task

__all__ = ["AUTO_MAP", "PERPLEXITY_TASK", "SHIM_FILE", "default_task_dir", "export_auto_map", "hf_tokenizer",
           "niah_records", "write_niah_task", "write_perplexity_task"]
