"""lm-eval (installed, offline) evaluates tiny saved bayeslayer models on local tasks built from our own
data, and its numbers equal ours: held-out perplexity (``bayeslayer lm eval``'s ``evaluate_heldout``)
through a ``loglikelihood_rolling`` task, and RULER NIAH (``bayeslayer niah``'s ``evaluate``) through a
``generate_until`` task scored by lm-eval's own RULER functions.  Decoding goes through our
``generate()`` with the recurrent cache: one prefill, then one token per forward call."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bayeslayer.data.niah import NiahGenerator
from bayeslayer.data.text import find_eos_id
from bayeslayer.evaluation import hf_tokenizer, niah, niah_records, write_niah_task, write_perplexity_task
from bayeslayer.evaluation.heldout import evaluate_heldout
from bayeslayer.models import BayesLayerForCausalLM

from .conftest import ESSAYS, OFFLINE, WORDS

LENGTH = 48   # window length of the perplexity comparison
REL = 1e-5    # float32 forward passes, identical inputs; sums in float64 (ours) and float32 (lm-eval's per doc)


def window_documents(tokenizer, n_docs: int, length: int, seed: int = 0) -> tuple[list[str], list[list[int]]]:
    """Texts ``rest_i`` of exactly ``length − 2`` tokens that tokenize back to themselves.

    On disk each document is ``"<EOS>" + rest_i``, so the stream ``d_0 EOS d_1 EOS …`` is cut by
    ``bayeslayer lm eval`` into windows ``[EOS, rest_i, EOS]`` of ``length`` tokens; lm-eval's document
    is ``rest_i + "<EOS>"`` after its prefix token EOS: the same ``length − 1`` predictions.
    """
    rng = np.random.default_rng(seed)
    texts, ids = [], []
    while len(texts) < n_docs:
        words = " ".join(rng.choice(WORDS, size=3 * length))
        cut = tokenizer.encode(words, add_special_tokens=False).ids[: length - 2]
        text = tokenizer.decode(cut)
        if tokenizer.encode(text, add_special_tokens=False).ids == cut:
            texts.append(text)
            ids.append(cut)
    return texts, ids


def _lm_eval(model, tokenizer, task_dir, task, **hflm):
    # lm-eval is imported by the tests that run it, not when the suite collects this file
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from bayeslayer.evaluation.lm_eval_adapter import BayesLayerLM

    lm = BayesLayerLM(pretrained=model, tokenizer=hf_tokenizer(tokenizer), batch_size=1, **hflm)
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)  # our tasks only: no index of lm-eval's
    out = simple_evaluate(model=lm, tasks=[task], task_manager=manager,
                          log_samples=True, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
                          torch_random_seed=0, fewshot_random_seed=0)
    return out["results"][task], out["samples"][task]


@pytest.mark.parametrize("which", ["bl", "retrofit", "fla_gdn"])
def test_rolling_perplexity_equals_heldout_perplexity(tmp_path, tokenizer, model_dirs, which):
    eos = tokenizer.id_to_token(find_eos_id(tokenizer))
    texts, ids = window_documents(tokenizer, 6, LENGTH)
    corpus = tmp_path / "corpus" / "test"
    corpus.mkdir(parents=True)
    for i, text in enumerate(texts):
        (corpus / f"doc{i:02d}.txt").write_text(eos + text)
    tok_file = model_dirs[which] / "tokenizer.json"
    ours = evaluate_heldout([(which, model_dirs[which])], [f"T={corpus.parent}"], [LENGTH], split="test",
                            tokenizer=str(tok_file), device="cpu", cache_dir=tmp_path / "cache", progress=False)
    cell = ours["models"][which]["cells"]["T"][str(LENGTH)]
    assert cell["windows"] == len(texts) and cell["n_tokens"] == len(texts) * (LENGTH - 1)

    docs = [text + eos for text in texts]
    task = write_perplexity_task(tmp_path / "tasks", docs, name=f"ppl_{which}")
    # a model instance; the fla checkpoint by its path (BayesLayerLM reads it with load_gdn_checkpoint)
    model = str(model_dirs[which]) if which == "fla_gdn" else BayesLayerForCausalLM.from_pretrained(model_dirs[which])
    results, samples = _lm_eval(model, tok_file, tmp_path / "tasks", task, max_length=LENGTH)
    loglik = sum(float(s["filtered_resps"][0] if not isinstance(s["filtered_resps"][0], list)
                       else s["filtered_resps"][0][0]) for s in samples)
    assert len(samples) == len(texts)
    token_ppl = math.exp(-loglik / cell["n_tokens"])
    assert token_ppl == pytest.approx(cell["ppl"], rel=REL)
    n_bytes = sum(len(d.encode()) for d in docs)
    n_words = sum(len(d.split()) for d in docs)   # lm-eval's word count: whitespace-separated pieces
    ce_sum = cell["mean_ce"] * cell["n_tokens"]
    assert results["byte_perplexity,none"] == pytest.approx(math.exp(ce_sum / n_bytes), rel=REL)
    assert results["word_perplexity,none"] == pytest.approx(math.exp(ce_sum / n_words), rel=REL)
    assert results["bits_per_byte,none"] == pytest.approx(ce_sum / n_bytes / math.log(2), rel=REL)
    assert 1.0 < cell["ppl"] < 2 * tokenizer.get_vocab_size()  # an untrained model: near-uniform, finite


def _niah_samples(tokenizer):
    generator = NiahGenerator(tokenizer, ESSAYS, seed=0)
    tasks, depths, per_cell = ("niah_single_2", "niah_multivalue", "niah_multikey_2"), (0.0, 60.0), 1
    samples = [generator.sample(t, 256, d, i, max_new_tokens=8) for t in tasks for d in depths
               for i in range(per_cell)]
    return generator, samples, dict(tasks=tasks, lengths=[256], depths=depths, samples_per_cell=per_cell,
                                    max_new_tokens=8)


def test_niah_generate_until_equals_bayeslayer_niah_and_decodes_with_the_cache(tmp_path, tokenizer, bl_dir):
    generator, samples, grid = _niah_samples(tokenizer)
    records = niah_records(samples, generator.tokenizer)
    assert all(r["token_exact"] for r in records)  # lm-eval tokenizes the text back to our prompt ids
    task = write_niah_task(tmp_path / "tasks", samples, generator.tokenizer, name="niah_local")

    model = BayesLayerForCausalLM.from_pretrained(bl_dir).eval()
    predictions: list[dict] = []
    cells = niah.evaluate(model, generator, predictions=predictions, **grid)

    seen: list[int] = []   # the number of new tokens each forward call sees
    forward = model.forward

    def counting_forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append(int(ids.shape[1]))
        return forward(*args, **kwargs)

    model.forward = counting_forward
    results, lm_samples = _lm_eval(model, bl_dir / "tokenizer.json", tmp_path / "tasks", task)
    model.forward = forward

    # lm-eval fed exactly our prompts: one prefill of the whole prompt, then single tokens
    prompt_len = len(samples[0].input_ids)
    prefills = [i for i, n in enumerate(seen) if n > 1]
    assert [seen[i] for i in prefills] == [prompt_len] * len(samples)
    assert all(n == 1 for i, n in enumerate(seen) if i not in prefills)
    generated = len(seen) - len(samples)  # decode steps after the prefills
    assert generated <= len(samples) * (grid["max_new_tokens"] - 1)

    by_doc = {s["doc"]["index"]: s for s in lm_samples}
    assert len(by_doc) == len(samples)
    for i, (sample, pred) in enumerate(zip(samples, predictions, strict=True)):
        lm = by_doc[i]
        text = lm["filtered_resps"][0]
        assert (pred["task"], pred["depth"], pred["index"]) == (sample.task, sample.depth, sample.index)
        assert text == pred["prediction"]                            # the same greedy continuation
        assert lm["256"] * 100.0 == niah.score_prediction(text, sample.answers) * 100.0
    ours = sum(c["score"] * c["n"] for c in cells) / sum(c["n"] for c in cells)
    assert 100.0 * results["256,none"] == pytest.approx(ours, abs=1e-9)
    assert results["4096,none"] == -1  # RULER's fixed column, no sample of that length


def test_ruler_scoring_is_ours(tokenizer):
    """lm-eval's RULER process_results (string_match_all after its post-processing) on hand-made
    continuations equals niah.score_prediction."""
    from lm_eval.tasks.ruler.common_utils import process_results

    answers = ["1234567", "7654321", "8f2c0a1e-0000-4000-8000-000000000000"]
    for pred in (" 1234567.", "none", "1234567 and 7654321", " 8F2C0A1E-0000-4000-8000-000000000000 ",
                 "\x01 7654321\n", "12345 67", "7654321, 1234567, 8f2c0a1e-0000-4000-8000-000000000000"):
        doc = {"max_length": 4096, "outputs": answers}
        assert process_results(doc, [pred])["4096"] == niah.score_prediction(pred, answers)


def _cli_args(model: str, model_dir: Path, task: str, task_dir: Path, out: Path) -> list[str]:
    return ["run", "--model", model, "--model_args", f"pretrained={model_dir},max_length={LENGTH}", "--tasks", task,
            "--include_path", str(task_dir), "--batch_size", "1", "--output_path", str(out)]


def _cli_results(out: Path, task: str) -> dict:
    result_files = list(out.rglob("results*.json"))
    assert len(result_files) == 1, result_files
    return json.loads(result_files[0].read_text())["results"][task]


def _ppl_cli_task(tmp_path, tokenizer, bl_dir):
    eos = tokenizer.id_to_token(find_eos_id(tokenizer))
    texts, _ = window_documents(tokenizer, 3, LENGTH, seed=1)
    task = write_perplexity_task(tmp_path / "tasks", [t + eos for t in texts], name="ppl_cli")
    model = BayesLayerForCausalLM.from_pretrained(bl_dir).eval()
    expected, _ = _lm_eval(model, bl_dir / "tokenizer.json", tmp_path / "tasks", task, max_length=LENGTH)
    return task, expected


METRICS = ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none")


def test_the_command_line_runs_saved_directories(tmp_path, monkeypatch, tokenizer, bl_dir):
    """``python -m bayeslayer.evaluation`` is lm-eval's command line with our models registered:
    ``--model bayeslayer`` on a directory holding only config.json, model.safetensors and tokenizer.json,
    and ``--model hf`` on one whose tokenizer was saved by transformers, give the Python API's numbers.
    In-process, with lm-eval's task index limited to our task directory (indexing its ~15,000 built-in
    tasks takes most of a minute here; the fresh-interpreter run below is marked slow)."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    from bayeslayer.evaluation import lm_eval_adapter

    task, expected = _ppl_cli_task(tmp_path, tokenizer, bl_dir)

    class OurTasksOnly(TaskManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", OurTasksOnly)
    hf_dir = tmp_path / "hf_model"
    BayesLayerForCausalLM.from_pretrained(bl_dir).save_pretrained(hf_dir)
    hf_tokenizer(bl_dir / "tokenizer.json").save_pretrained(hf_dir)   # tokenizer_config.json names the EOS
    for model, model_dir in (("bayeslayer", bl_dir), ("hf", hf_dir)):
        out = tmp_path / f"out_{model}"
        monkeypatch.setattr(sys, "argv", ["lm_eval", *_cli_args(model, model_dir, task, tmp_path / "tasks", out)])
        lm_eval_adapter.main()
        got = _cli_results(out, task)
        for metric in METRICS:
            assert got[metric] == pytest.approx(expected[metric], rel=1e-6), (model, metric)


@pytest.mark.slow
def test_the_command_line_in_a_fresh_interpreter(tmp_path, tokenizer, bl_dir):
    """The same from a shell: ``python -m bayeslayer.evaluation run --model bayeslayer ...`` (≈ 1 min:
    lm-eval indexes all its built-in tasks first)."""
    task, expected = _ppl_cli_task(tmp_path, tokenizer, bl_dir)
    out = tmp_path / "out"
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([sys.executable, "-m", "bayeslayer.evaluation",
                          *_cli_args("bayeslayer", bl_dir, task, tmp_path / "tasks", out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = _cli_results(out, task)
    for metric in METRICS:
        assert got[metric] == pytest.approx(expected[metric], rel=1e-6)


def test_bad_task_arguments(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="documents"):
        write_perplexity_task(tmp_path, [])
    with pytest.raises(ValueError, match="documents"):
        write_perplexity_task(tmp_path, "one string")
    with pytest.raises(ValueError, match="name"):
        write_perplexity_task(tmp_path, ["a"], name="bad name/")
    with pytest.raises(ValueError, match="samples"):
        niah_records([], tokenizer)
    generator = NiahGenerator(tokenizer, ESSAYS, seed=0)
    a = generator.sample("niah_single_1", 128, 50.0, max_new_tokens=8)
    b = generator.sample("niah_single_1", 128, 50.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        write_niah_task(tmp_path, [a, b], tokenizer)
    torch.manual_seed(0)
