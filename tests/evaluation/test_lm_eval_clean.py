"""lm-eval runs the project's perplexity task on a tiny model without a warning from the task's YAML,
and a saved run directory gives ``AutoTokenizer`` its end-of-text token."""

from __future__ import annotations

import logging

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

from bayeslayer.evaluation import hf_tokenizer, write_perplexity_task
from bayeslayer.evaluation.lm_eval_adapter import BayesLayerLM
from bayeslayer.evaluation.tasks import write_tokenizer_config
from bayeslayer.models import BayesLayerForCausalLM


def test_the_perplexity_task_yaml_gives_no_warning(tmp_path, tokenizer, bl_dir, caplog):
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
