"""Local lm-eval tasks from our own data (no download), and the tokenizer lm-eval's HF backend needs.

Both writers produce a task directory for lm-eval's ``TaskManager(include_path=DIR)`` /
``--include_path DIR``: a JSONL of documents and a YAML that reads it with the ``json`` builder of
``datasets`` (local file, works with ``HF_DATASETS_OFFLINE=1``).

* :func:`write_perplexity_task`: ``loglikelihood_rolling`` over documents (lm-eval's ``wikitext``
  shape: ``word_perplexity``, ``byte_perplexity``, ``bits_per_byte``).  lm-eval scores *every*
  token of a document, the first one after its prefix token (BOS, else EOS), in windows of its
  ``max_length`` that each start from an empty state.  ``bayeslayer lm eval``'s non-overlapping
  windows ``[x_0 … x_{L−1}]`` score ``x_1 … x_{L−1}`` given ``x_0``.  The two are the same numbers
  when each document is one window whose first token is lm-eval's prefix token: a window
  ``[EOS, d, EOS]`` of the token stream is the document text of ``d`` followed by the EOS string.
  docs/models.md shows the construction; ``tests/evaluation/test_lm_eval.py`` checks it.
* :func:`default_task_dir`: the tasks the package ships, written on first use from what every machine
  has: ``bayeslayer_perplexity`` (:data:`PERPLEXITY_TASK`), :func:`write_perplexity_task` over the test
  split of the default corpus.  ``python -m bayeslayer.evaluation`` puts the folder on lm-eval's task path.
* :func:`write_niah_task`: ``generate_until`` over :class:`~bayeslayer.data.niah.NiahSample`
  prompts in the record layout of lm-eval's RULER tasks (``input``, ``gen_prefix``, ``outputs``,
  ``max_length``), scored by lm-eval's own ``ruler.common_utils.process_results``
  (``string_match_all``), so ``bayeslayer niah`` and lm-eval score the same prompts the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..data.niah import NiahSample, NiahTokenizer, prompt_template
from ..files import atomic_write, atomic_write_text

#: RULER's lm-eval tasks always report the 4096 column (``common_utils.DEFAULT_SEQ_LENGTHS``);
#: its ``process_results`` fills it with -1 for other lengths, so the metric list must hold it.
_RULER_DEFAULT_LENGTH = 4096
_RULER = "lm_eval.tasks.ruler.common_utils"


def hf_tokenizer(tokenizer: Any, *, eos_token: str | None = None):
    """A transformers fast tokenizer with ``eos_token`` (and ``pad_token``) set.

    ``tokenizer``: a ``tokenizers.Tokenizer``, a ``tokenizer.json`` path, a directory holding one,
    or a transformers tokenizer (returned as is when it already has an EOS).  ``eos_token=None``
    picks the first end-of-text token the vocabulary knows (:data:`bayeslayer.data.text.EOS_CANDIDATES`).
    lm-eval needs the EOS: it stops generation there and prefixes rolling windows with it when
    there is no BOS.
    """
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from ..data.text import find_eos_id, load_tokenizer

    if isinstance(tokenizer, PreTrainedTokenizerBase) and tokenizer.eos_token is not None and eos_token is None:
        return tokenizer
    backend = load_tokenizer(tokenizer)
    name = backend.id_to_token(find_eos_id(backend, eos_token))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=name, pad_token=name)


def _yaml_str(text: str) -> str:
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(f"name must be a task name of letters, digits, '_', '-', '.', got {name!r}")
    return name


def _write_jsonl(path: Path, records: Sequence[dict]) -> None:
    with atomic_write(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _dataset_lines(jsonl: Path, task_dir: Path) -> list[str]:
    return [
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {_yaml_str(str(jsonl.resolve()))}",
        f"  cache_dir: {_yaml_str(str((task_dir / 'hf_datasets_cache').resolve()))}",
        "test_split: test",
    ]


def write_perplexity_task(task_dir: str | os.PathLike, documents: Sequence[str], *,
                          name: str = "bayeslayer_perplexity") -> str:
    """Write a ``loglikelihood_rolling`` task over ``documents`` to ``task_dir``; return its name.

    ``task_dir/<name>.jsonl`` holds ``{"text": document}`` lines and ``task_dir/<name>.yaml`` the
    task (``doc_to_target: "{{text}}"``, an empty ``doc_to_text``, word/byte perplexity and bits
    per byte, each with its aggregation and direction, so lm-eval needs no defaults and warns of
    none).  Documents are scored verbatim.
    """
    name = _check_name(name)
    if isinstance(documents, str) or not documents or not all(isinstance(d, str) and d for d in documents):
        raise ValueError("documents must be a non-empty list of non-empty str")
    lines = ["output_type: loglikelihood_rolling",
             'doc_to_text: ""',
             'doc_to_target: "{{text}}"',
             "metric_list:",  # lm-eval's own aggregations of these metrics; lower is better for all three
             "  - metric: word_perplexity",
             "    aggregation: weighted_perplexity",
             "    higher_is_better: false",
             "  - metric: byte_perplexity",
             "    aggregation: weighted_perplexity",
             "    higher_is_better: false",
             "  - metric: bits_per_byte",
             "    aggregation: bits_per_byte",
             "    higher_is_better: false"]
    return _write_task(task_dir, name, [{"text": d} for d in documents], lines)


#: The perplexity task the package ships: ``--tasks bayeslayer_perplexity`` (:func:`default_task_dir`).
PERPLEXITY_TASK = "bayeslayer_perplexity"
#: Bump when what :func:`default_task_dir` writes changes, so that folders written before are rewritten.
_DEFAULT_TASKS_VERSION = 1


def default_task_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of the lm-eval tasks the package ships, written on first use; returns it.

    It holds :data:`PERPLEXITY_TASK` (``bayeslayer_perplexity``): :func:`write_perplexity_task` over the
    documents of the **test split of the package's default corpus**, ``python-docstrings`` (the docstrings
    of the running Python's standard library, one document per module, hash-split as
    :func:`bayeslayer.data.text.load_text_corpus` splits it: the documents ``lm train --preset tiny`` holds
    out), each document verbatim, empty ones left out.  Nothing is downloaded: it works with
    ``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1`` on any machine with Python.

    ``python -m bayeslayer.evaluation`` adds the folder to lm-eval's task path, so ``--tasks
    bayeslayer_perplexity`` needs no ``--include_path``; in Python, pass it as lm-eval's
    ``TaskManager(include_path=...)`` (or use :func:`bayeslayer.evaluation.lm_eval_adapter.task_manager`).

    The folder is ``<cache_dir>/lm_eval_tasks`` (``cache_dir`` default:
    :func:`~bayeslayer.data.text.default_cache_dir`, ``$BAYESLAYER_CACHE`` or ``~/.cache/bayeslayer``).  It
    is rewritten only when the corpus's fingerprint (its files' names, sizes and times, the Python version)
    or the folder's place changes (the YAML names its data file by absolute path), which
    ``<task>.source.json`` beside the task records.
    """
    import hashlib

    from ..data.text import PYTHON_DOCSTRINGS, corpus_files, default_cache_dir
    from ..files import read_json

    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a folder path or None, got {type(cache_dir).__name__}")
    root = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()
    if root.exists() and not root.is_dir():
        raise ValueError(f"cache_dir {root} is a file, not a folder")
    task_dir = root / "lm_eval_tasks"
    files = corpus_files(PYTHON_DOCSTRINGS)
    source = {"task": PERPLEXITY_TASK, "version": _DEFAULT_TASKS_VERSION, "source": PYTHON_DOCSTRINGS,
              "split": "test", "corpus": files.description, "folder": str(task_dir.resolve()),
              "fingerprint_sha256": hashlib.sha256(json.dumps(files.fingerprint, sort_keys=True).encode()).hexdigest()}
    stamp = task_dir / f"{PERPLEXITY_TASK}.source.json"
    written = [task_dir / f"{PERPLEXITY_TASK}{suffix}" for suffix in (".yaml", ".jsonl")]
    if stamp.is_file() and all(p.is_file() for p in written):
        try:
            saved = read_json(stamp, what="the default task's source")
        except ValueError:
            saved = None  # a damaged stamp: write the task again
        if isinstance(saved, dict) and {k: saved.get(k) for k in source} == source:
            return task_dir
    documents = [text for text in (doc.read() for doc in files.splits["test"]) if text.strip()]
    write_perplexity_task(task_dir, documents, name=PERPLEXITY_TASK)
    atomic_write_text(stamp, json.dumps({**source, "documents": len(documents)}, indent=1) + "\n")
    return task_dir


def niah_records(samples: Sequence[NiahSample], tokenizer: Any) -> list[dict]:
    """lm-eval RULER records of NIAH samples (the layout of ``ruler/prepare_niah.generate_samples``).

    ``input`` is the prompt text up to the question and ``gen_prefix`` the answer prefix (lm-eval
    joins them with the task's ``target_delimiter`` " "), ``outputs`` the expected values,
    ``length``/``max_length`` the sample's length (prompt + answer budget).  Our fields ride along:
    ``task``, ``depth``, ``depth_realized``, ``sample_index`` and ``token_exact`` — whether the text
    tokenizes back to exactly the sample's ids (what lm-eval will feed the model, with no special
    tokens added; a BOS the sample starts with is dropped from the text, see docs/models.md).
    """
    tok = tokenizer if isinstance(tokenizer, NiahTokenizer) else NiahTokenizer(tokenizer)
    if isinstance(samples, NiahSample) or not samples or not all(isinstance(s, NiahSample) for s in samples):
        raise ValueError("samples must be a non-empty list of NiahSample")
    records = []
    for i, s in enumerate(samples):
        _, _, prefix = prompt_template(s.task, s.queries)
        text = tok.decode(s.input_ids)
        if not text.endswith(" " + prefix):
            raise ValueError(f"sample {i} ({s.task}) does not decode to a prompt ending in its answer prefix; "
                             f"was it made with another tokenizer? It ends {text[-80:]!r}")
        records.append({
            "index": i, "input": text[: -len(prefix) - 1], "outputs": list(s.answers), "length": s.length,
            "max_length": s.length, "gen_prefix": prefix, "task": s.task, "depth": s.depth,
            "depth_realized": s.depth_realized, "sample_index": s.index,
            "token_exact": tok.encode(text) == list(s.input_ids),
        })
    return records


def write_niah_task(task_dir: str | os.PathLike, samples: Sequence[NiahSample], tokenizer: Any, *,
                    name: str = "bayeslayer_niah") -> str:
    """Write a RULER-style ``generate_until`` task of ``samples`` (:func:`niah_records`) to ``task_dir``.

    Generation is RULER's (greedy, ``until: []`` so only the EOS stops it, ``max_gen_toks`` the
    samples' ``max_new_tokens``); ``process_results`` and the per-length aggregation are lm-eval's
    ``ruler.common_utils`` functions, one metric per sample length plus RULER's fixed ``4096``
    (−1 when no sample has that length).  Returns the task name.
    """
    name = _check_name(name)
    records = niah_records(samples, tokenizer)
    budgets = {s.max_new_tokens for s in samples}
    if len(budgets) != 1:
        raise ValueError(f"samples must share one max_new_tokens (lm-eval has one max_gen_toks per task), "
                         f"got {budgets}")
    lengths = sorted({_RULER_DEFAULT_LENGTH, *(s.length for s in samples)})
    lines = ["output_type: generate_until",
             'doc_to_text: "{{input}}"',
             'doc_to_target: "{{outputs}}"',
             'gen_prefix: "{{gen_prefix}}"',
             'target_delimiter: " "',
             f"process_results: !function {_RULER}.process_results",
             "metric_list:"]
    for length in lengths:
        lines += [f'  - metric: "{length}"',
                  f"    aggregation: !function {_RULER}.aggregate_metrics",
                  "    higher_is_better: true"]
    lines += ["generation_kwargs:",
              "  do_sample: false",
              "  temperature: 0.0",
              f"  max_gen_toks: {budgets.pop()}",
              "  until: []",
              "repeats: 1"]
    return _write_task(task_dir, name, records, lines)


def _write_task(task_dir: str | os.PathLike, name: str, records: list[dict], task_lines: list[str]) -> str:
    """Write ``<name>.jsonl`` (the records) and ``<name>.yaml`` (the dataset, ``task_lines``, the metadata)
    to ``task_dir``; return ``name``."""
    task_dir = Path(task_dir)
    task_dir.mkdir(parents=True, exist_ok=True)
    jsonl = task_dir / f"{name}.jsonl"
    _write_jsonl(jsonl, records)
    lines = [f"task: {name}", *_dataset_lines(jsonl, task_dir), *task_lines, "metadata:", "  version: 1.0", ""]
    atomic_write_text(task_dir / f"{name}.yaml", "\n".join(lines))
    return name


def write_tokenizer_config(tokenizer, directory: str | os.PathLike) -> None:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` beside ``tokenizer.json``: they name the
    end-of-text token, so ``AutoTokenizer.from_pretrained(directory)`` (and lm-eval's ``hf`` model) has an
    EOS.  ``tokenizer.json`` itself is left as written."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        hf_tokenizer(tokenizer).save_pretrained(tmp)
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (Path(tmp) / name).is_file():
                (Path(directory) / name).write_bytes((Path(tmp) / name).read_bytes())


__all__ = ["PERPLEXITY_TASK", "default_task_dir", "hf_tokenizer", "niah_records", "write_niah_task",
           "write_perplexity_task", "write_tokenizer_config"]
