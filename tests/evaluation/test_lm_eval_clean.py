"""lm-eval runs the project's perplexity task on a tiny model without a warning from the task's YAML,
a saved run directory gives ``AutoTokenizer`` its end-of-text token, and the task the package ships
(``bayeslayer_perplexity`` on the default corpus) runs from ``python -m bayeslayer.evaluation`` offline, without
``--include_path``, and without "HF model type is neither marked as CausalLM" or git's "fatal: not a git
repository" in the output."""

from __future__ import annotations

import json
import logging

import pytest

from bayeslayer.evaluation import PERPLEXITY_TASK, default_task_dir, hf_tokenizer, write_perplexity_task
from bayeslayer.evaluation.tasks import write_tokenizer_config
from bayeslayer.models import BayesLayerForCausalLM


def test_the_perplexity_task_yaml_gives_no_warning(tmp_path, tokenizer, bl_dir, caplog):
    # lm-eval is imported by the tests that run it, not when the suite collects this file
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from bayeslayer.evaluation.lm_eval_adapter import BayesLayerLM

    task = write_perplexity_task(tmp_path / "tasks", ["a short document.", "another short one."], name="clean_ppl")
    model = BayesLayerLM(pretrained=BayesLayerForCausalLM.from_pretrained(bl_dir),
                         tokenizer=hf_tokenizer(bl_dir / "tokenizer.json"), batch_size=1, max_length=64)
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    with caplog.at_level(logging.WARNING):
        out = simple_evaluate(model=model, tasks=[task], task_manager=manager, bootstrap_iters=0, random_seed=0,
                              numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    assert out["results"][task]["word_perplexity,none"] > 1.0
    about_the_task = [r.getMessage() for r in caplog.records if task in r.getMessage()]
    assert about_the_task == []


def test_a_saved_tokenizer_has_its_eos_for_auto_tokenizer(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    tokenizer.save(str(tmp_path / "tokenizer.json"))
    write_tokenizer_config(tokenizer, tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.eos_token == "<|endoftext|>" and loaded.eos_token_id == tokenizer.token_to_id("<|endoftext|>")


# ----------------------------------------------------------------------------- the shipped task, offline

NOISE = ("neither marked as CausalLM", "not a git repository", "fatal:")


def _run_args(model_dir, out) -> list[str]:
    return ["run", "--model", "bayeslayer", "--model_args", f"pretrained={model_dir}", "--tasks", PERPLEXITY_TASK,
            "--limit", "4", "--batch_size", "1", "--output_path", str(out)]


def _results(out) -> dict:
    [path] = list(out.rglob("results*.json"))
    return json.loads(path.read_text())


def test_the_default_task_is_the_default_corpus_test_split_written_once(tmp_path, monkeypatch):
    from bayeslayer.data.text import PYTHON_DOCSTRINGS, corpus_files

    task_dir = default_task_dir(tmp_path / "cache")
    assert task_dir == tmp_path / "cache" / "lm_eval_tasks"
    docs = [json.loads(line)["text"] for line in (task_dir / f"{PERPLEXITY_TASK}.jsonl").read_text().splitlines()]
    expected = [d.read() for d in corpus_files(PYTHON_DOCSTRINGS).splits["test"]]
    assert docs == [d for d in expected if d.strip()] and len(docs) >= 4
    assert f"task: {PERPLEXITY_TASK}" in (task_dir / f"{PERPLEXITY_TASK}.yaml").read_text()
    stamp = (task_dir / f"{PERPLEXITY_TASK}.source.json").stat().st_mtime_ns
    assert default_task_dir(tmp_path / "cache") == task_dir  # found, not written again
    assert (task_dir / f"{PERPLEXITY_TASK}.source.json").stat().st_mtime_ns == stamp
    monkeypatch.setenv("BAYESLAYER_CACHE", str(tmp_path / "env"))
    assert default_task_dir() == tmp_path / "env" / "lm_eval_tasks"
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cache_dir .* is a file"):
        default_task_dir(tmp_path / "file")


def test_the_command_line_finds_the_shipped_task_without_include_path_and_prints_no_noise(
        tmp_path, monkeypatch, capfd, bl_dir):
    """``python -m bayeslayer.evaluation run --model bayeslayer --model_args pretrained=DIR --tasks
    bayeslayer_perplexity --limit 4``, in-process, outside any git checkout, with lm-eval's task index limited
    to the folders it is given (its ~15,000 built-in tasks take most of a minute: the fresh-interpreter run
    below is marked slow).  lm-eval's own warnings still show (``--limit``); ours do not."""
    import sys

    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    from bayeslayer.evaluation import lm_eval_adapter

    class GivenFoldersOnly(TaskManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", GivenFoldersOnly)
    monkeypatch.setenv("BAYESLAYER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # no .git here or above: lm-eval's `git describe` would print "fatal: ..."
    monkeypatch.setattr(sys, "argv", ["lm_eval", *_run_args(bl_dir, tmp_path / "out")])
    # lm-eval sets its log handler up once per process, on the stderr of that moment: an earlier test's
    # captured stream when another test ran lm-eval first in this process
    import logging

    for handler in logging.getLogger("lm_eval").handlers:
        if type(handler) is logging.StreamHandler:  # lm-eval's own, not pytest's log capture
            monkeypatch.setattr(handler, "stream", sys.stderr)
    capfd.readouterr()
    lm_eval_adapter.main()
    seen = "".join(capfd.readouterr())
    assert "SHOULD ONLY BE USED FOR TESTING" in seen  # lm-eval's warnings reach this output
    assert not [n for n in NOISE if n in seen], seen[-3000:]
    record = _results(tmp_path / "out")
    assert record["git_hash"] is None  # no checkout here, and nothing printed about it
    result = record["results"][PERPLEXITY_TASK]
    assert 1.0 < result["byte_perplexity,none"] < float("inf")
    assert record["n-samples"][PERPLEXITY_TASK]["effective"] == 4


def test_task_manager_and_the_git_hash_of_a_checkout(tmp_path, monkeypatch):
    from bayeslayer.evaluation.lm_eval_adapter import _git_hash_from_files, task_manager

    monkeypatch.setenv("BAYESLAYER_CACHE", str(tmp_path / "cache"))
    write_perplexity_task(tmp_path / "mine", ["a document."], name="my_ppl")
    manager = task_manager(str(tmp_path / "mine"), include_defaults=False)
    assert {PERPLEXITY_TASK, "my_ppl"} <= set(manager.all_tasks)
    with pytest.raises(TypeError, match="include_path"):
        task_manager(3, include_defaults=False)
    git = tmp_path / "repo" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("0123456789abcdef0123456789abcdef01234567\n")
    (tmp_path / "repo" / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "repo" / "sub")
    assert _git_hash_from_files() == "0123456789abcdef0123456789abcdef01234567"


def test_the_command_line_still_runs_other_tasks_when_ours_cannot_be_written(tmp_path, monkeypatch):
    """A cache folder that is a file: the command line warns that bayeslayer_perplexity is not available and
    keeps the user's task path; an explicit ``task_manager()`` raises."""
    from bayeslayer.evaluation.lm_eval_adapter import _with_package_tasks, task_manager

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("BAYESLAYER_CACHE", str(tmp_path / "file"))
    with pytest.warns(RuntimeWarning, match="bayeslayer_perplexity.*is a file"):
        assert _with_package_tasks(str(tmp_path / "mine"), required=False) == [str(tmp_path / "mine")]
    with pytest.raises(ValueError, match="is a file"):
        task_manager(include_defaults=False)


def test_lm_eval_marks_our_model_type_as_causal():
    from lm_eval.models.huggingface import HFLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from bayeslayer.models import BayesLayerConfig

    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["bayeslayer"] == "BayesLayerForCausalLM"
    lm = HFLM.__new__(HFLM)
    lm.AUTO_MODEL_CLASS = None
    lm._get_backend(BayesLayerConfig(vocab_size=8, hidden_size=8, num_heads=1, head_dim=8, num_hidden_layers=1))
    assert lm.backend == "causal"


@pytest.mark.slow
def test_the_shipped_task_runs_offline_in_a_fresh_interpreter(tmp_path, bl_dir):
    """The same command from a shell, as in a fresh clone: a new interpreter, offline (``HF_HUB_OFFLINE``,
    ``HF_DATASETS_OFFLINE``), an empty cache (the task is written from the standard library there), empty
    Hugging Face caches, outside any git checkout; lm-eval indexes all its built-in tasks (≈ 1 min)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from .conftest import OFFLINE

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root),
           "BAYESLAYER_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run([sys.executable, "-m", "bayeslayer.evaluation", *_run_args(bl_dir, tmp_path / "out")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = run.stdout + run.stderr
    assert not [n for n in NOISE if n in seen], seen[-3000:]
    assert PERPLEXITY_TASK in run.stdout  # lm-eval's results table
    result = _results(tmp_path / "out")["results"][PERPLEXITY_TASK]
    assert 1.0 < result["byte_perplexity,none"] < float("inf")
