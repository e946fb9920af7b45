"""A model folder written by ``lm train --preset tiny`` generates on the recurrent cache: its config says
``use_cache: true``, and ``generate()`` (from ``AutoModelForCausalLM`` and from ``load_run``) feeds the
prompt once, then one token per forward call."""

from __future__ import annotations

import json

import pytest
import torch

from bayeslayer.cli import main

from .corpus import write_word_corpus

PROMPT, NEW = 6, 5


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """``lm train --preset tiny`` for three steps on a small word corpus (the preset's sizes otherwise)."""
    root = tmp_path_factory.mktemp("lm_generate")
    corpus = write_word_corpus(root / "text", {"train": 20, "validation": 4, "test": 4}, sentences=12)
    out = root / "run"
    argv = ["lm", "train", "--preset", "tiny", "--source", str(corpus), "--vocab-size", "300", "--steps", "3",
            "--eval-every", "3", "--checkpoint-every", "3", "--out", str(out), "--cache-dir", str(root / "cache"),
            "--no-progress"]
    assert main(argv) == 0
    return out


def tokens_per_forward(model, prompt: torch.Tensor, **generate) -> list[int]:
    """The number of tokens each forward call of ``model.generate(prompt, ...)`` received."""
    seen: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, min_new_tokens=NEW,
                       do_sample=False, pad_token_id=0, **generate)
    finally:
        handle.remove()
    return seen


def test_the_folder_says_use_cache_and_generate_prefills_once_then_one_token_per_forward(tiny_run):
    from transformers import AutoModelForCausalLM

    final = tiny_run / "final"
    assert json.loads((final / "config.json").read_text())["use_cache"] is True
    checkpoints = [c for c in (tiny_run / "checkpoints").iterdir() if c.is_dir()]
    assert checkpoints
    for checkpoint in checkpoints:  # the checkpoints are model folders as well
        assert json.loads((checkpoint / "config.json").read_text())["use_cache"] is True
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    prompt = torch.randint(1, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    assert tokens_per_forward(model, prompt) == [PROMPT] + [1] * (NEW - 1)


def test_load_run_and_pipeline_generate_on_the_cache_too(tiny_run):
    from transformers import AutoTokenizer, pipeline

    from bayeslayer.training.lm import load_run

    _, model = load_run(tiny_run)
    prompt = torch.randint(1, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    assert tokens_per_forward(model, prompt) == [PROMPT] + [1] * (NEW - 1)

    tokenizer = AutoTokenizer.from_pretrained(tiny_run / "final")  # tokenizer_config.json names the EOS
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    seen: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        generator("the cat sat on", max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    finally:
        handle.remove()
    assert seen[0] > 1 and seen[1:] == [1] * (NEW - 1)
