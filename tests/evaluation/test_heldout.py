"""Held-out perplexity (bayeslayer.evaluation.heldout, .perplexity): the window rules, the PPL of a window set
against a hand computation, the cell cache, the model folders it reads, per-source caps and splits, bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from bayeslayer.evaluation import heldout
from bayeslayer.evaluation.heldout import (
    HeldoutSource,
    evaluate_heldout,
    load_heldout_stream,
    relative_change,
    resolve_model,
)
from bayeslayer.evaluation.perplexity import heldout_perplexity, window_plan
from bayeslayer.experiments.common.heldout_run import table7_markdown
from bayeslayer.models import loading
from bayeslayer.training import lm as training_lm
from bayeslayer.training import lm_config
from tests.experiments.corpus import WORDS

from . import heldout_setup
from .heldout_setup import evaluate_tiny, hand_ppl, model_dir, tiny_model

# the shared module-scoped fixtures
corpus_dir, tokenizer, model_dirs = heldout_setup.corpus_dir, heldout_setup.tokenizer, heldout_setup.model_dirs

# ----------------------------------------------------------------------------- windows and PPL


def test_non_overlapping_windows_tile_the_stream_exactly(corpus_dir, tokenizer, tmp_path):
    tokens = load_heldout_stream(HeldoutSource("tiny", str(corpus_dir)), "test", tokenizer, cache_dir=tmp_path)
    L = 24
    windows, scored = window_plan(tokens, L)
    n = tokens.shape[0] // L
    assert windows.shape == (n, L) and n >= 5
    assert np.array_equal(windows.reshape(-1), tokens[: n * L])  # consecutive, no overlap, tail dropped
    assert tokens.shape[0] - n * L < L
    assert scored.shape == (n, L - 1) and scored.all()


def test_ppl_is_exp_mean_ce_over_every_prediction_of_every_window(corpus_dir, tokenizer, tmp_path):
    model = tiny_model(tokenizer.get_vocab_size(with_added_tokens=True), "bayesian", 0)
    tokens = load_heldout_stream(HeldoutSource("tiny", str(corpus_dir)), "test", tokenizer, cache_dir=tmp_path)
    windows, _ = window_plan(tokens, 20)
    out = heldout_perplexity(model, windows, batch_size=3)
    expected, n = hand_ppl(model, windows)
    assert out["windows"] == windows.shape[0]
    assert out["n_tokens"] == n == windows.shape[0] * 19  # the first token of each window is context only
    assert out["ppl"] == pytest.approx(expected, rel=1e-5)
    assert out["mean_ce"] == pytest.approx(math.log(expected), rel=1e-5)
    first = heldout_perplexity(model, windows, batch_size=2, max_windows=3)
    assert first["windows"] == 3 and first["n_tokens"] == 3 * 19
    assert first["ppl"] == pytest.approx(hand_ppl(model, windows[:3])[0], rel=1e-5)


def test_sliding_windows_score_every_token_once_with_at_least_L_minus_S_context(corpus_dir, tokenizer, tmp_path):
    tokens = load_heldout_stream(HeldoutSource("tiny", str(corpus_dir)), "test", tokenizer, cache_dir=tmp_path)
    L, S = 16, 5
    windows, scored = window_plan(tokens, L, windows="sliding", stride=S)
    K = (tokens.shape[0] - L) // S + 1
    assert windows.shape == (K, L)
    for k in (0, 1, K - 1):
        assert np.array_equal(windows[k], tokens[k * S: k * S + L])
    k_idx, t_idx = np.nonzero(scored)
    positions = k_idx * S + t_idx + 1  # absolute position of the predicted token
    assert np.array_equal(np.sort(positions), np.arange(1, (K - 1) * S + L))  # each exactly once
    assert (t_idx[k_idx > 0] + 1 >= L - S).all()  # context inside the window
    model = tiny_model(tokenizer.get_vocab_size(with_added_tokens=True), "gated_deltanet", 1)
    out = heldout_perplexity(model, windows, scored=scored, batch_size=4, max_windows=7)
    expected, n = hand_ppl(model, windows[:7], scored[:7])
    assert out["n_tokens"] == n == (L - 1) + 6 * S
    assert out["ppl"] == pytest.approx(expected, rel=1e-5)


def test_relative_change_arithmetic():
    assert relative_change(102.5, 100.0) == pytest.approx(2.5)
    assert relative_change(20.01, 18.75) == pytest.approx(100 * (20.01 / 18.75 - 1))
    assert relative_change(9.0, 10.0) == pytest.approx(-10.0)
    # a diverged model's PPL is inf (a mean CE past exp's range): a change, not an error
    assert relative_change(math.inf, 10.0) == math.inf and relative_change(1.0, math.inf) == -100.0
    assert math.isnan(relative_change(math.inf, math.inf))
    for bad in ((0.0, 1.0), (1.0, -2.0), (float("nan"), 1.0), (1.0, float("nan")), ("1", 1.0), (-math.inf, 1.0)):
        with pytest.raises(ValueError, match="ppl"):
            relative_change(*bad)


def test_a_rerun_is_served_from_the_cache_without_loading_a_model(model_dirs, corpus_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    with pytest.warns(RuntimeWarning):
        first = evaluate_tiny(model_dirs, corpus_dir, cache)

    def no_model(*_args, **_kwargs):
        raise AssertionError("the model was loaded although every cell is cached")

    monkeypatch.setattr(heldout.HeldoutModel, "load", no_model)
    monkeypatch.setattr(heldout, "heldout_perplexity", no_model)
    second = evaluate_tiny(model_dirs, corpus_dir, cache, precision="auto")  # auto is fp32 on a CPU
    assert second["models"] == first["models"]
    with pytest.raises(AssertionError, match="model was loaded"):  # a new cap is a new cell
        evaluate_tiny(model_dirs, corpus_dir, cache, max_windows=2)


# ----------------------------------------------------------------------------- model kinds


def test_an_lm_run_directory_uses_its_final_model_and_its_corpus_tokenizer(corpus_dir, tmp_path):
    config = lm_config.LMConfig(preset="test", mixer="bayesian", hidden_size=32, num_layers=1, num_heads=2, head_dim=8,
                         mlp_dropout=0.0, source=str(corpus_dir), vocab_size=300, seq_len=16, steps=1,
                         batch_size=2, micro_batch_size=2, warmup_steps=0)
    cache = tmp_path / "cache"
    corpus = training_lm.load_corpus(config, cache_dir=str(cache), splits=("validation",))
    model = training_lm.build_model(config, corpus.vocab_size, corpus.eos_id)
    final = tmp_path / "run" / "final"
    loading.save_model_dir(model, final)
    (final / "lm_config.json").write_text(json.dumps(config.to_json()))
    spec = resolve_model("run", tmp_path / "run", cache_dir=cache)
    assert spec.kind == "lm-run" and spec.model_dir == final
    assert spec.tokenizer.to_str() == corpus.tokenizer.to_str()
    record = evaluate_heldout([("run", tmp_path / "run")], [str(corpus_dir)], [16], device="cpu", cache_dir=cache,
                              progress=False)
    cell = record["models"]["run"]["cells"][str(corpus_dir)]["16"]
    tokens = load_heldout_stream(HeldoutSource("x", str(corpus_dir)), "test", corpus.tokenizer, cache_dir=cache)
    windows, _ = window_plan(tokens, 16)
    assert cell["ppl"] == pytest.approx(hand_ppl(model.eval(), windows)[0], rel=1e-5)


def test_an_fla_gated_deltanet_checkpoint_is_read(tmp_path, tokenizer, corpus_dir):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Triton is not supported on current platform"
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    torch.manual_seed(0)
    fla = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), hidden_size=32, num_hidden_layers=1,
        num_heads=2, head_dim=8, expand_v=2, hidden_ratio=2, fuse_norm=False, fuse_swiglu=False,
        fuse_cross_entropy=False))
    fla.save_pretrained(tmp_path / "fla")
    tok_path = tmp_path / "tok.json"
    tokenizer.save(str(tok_path))
    spec = resolve_model("GDN-zero", tmp_path / "fla", tokenizer=tok_path)
    assert spec.kind == "gated_deltanet"
    record = evaluate_heldout([("GDN-zero", tmp_path / "fla")], [str(corpus_dir)], [32], device="cpu",
                              tokenizer=tok_path, cache_dir=tmp_path / "cache", progress=False)
    cell = record["models"]["GDN-zero"]["cells"][str(corpus_dir)]["32"]
    assert math.isfinite(cell["ppl"]) and cell["n_tokens"] == cell["windows"] * 31


def test_max_documents_keeps_the_first_documents(tokenizer, tmp_path):
    root = tmp_path / "books"  # one text file is one document: four test "books"
    root.mkdir()
    (root / "train.txt").write_text("the cat sat on a mat")
    for i in range(4):
        (root / f"test-{i:02d}.txt").write_text(" ".join(WORDS[i:i + 12]))
    all_docs = load_heldout_stream(HeldoutSource("t", str(root)), "test", tokenizer, cache_dir=tmp_path)
    two = load_heldout_stream(HeldoutSource("t", str(root), 2), "test", tokenizer, cache_dir=tmp_path)
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert int((two == eos).sum()) == 2 and int((all_docs == eos).sum()) == 4
    assert np.array_equal(two, all_docs[: two.shape[0]])


def test_each_source_can_have_its_own_split(model_dirs, corpus_dir, tokenizer, tmp_path):
    record = evaluate_heldout([("BL", model_dirs["BL"])], [f"T={corpus_dir}", f"V={corpus_dir}"], [16],
                              source_splits={"V": "validation"}, device="cpu", cache_dir=tmp_path, progress=False)
    assert [(s["label"], s["split"]) for s in record["config"]["sources"]] == [("T", "test"), ("V", "validation")]
    for label, split in (("T", "test"), ("V", "validation")):
        tokens = load_heldout_stream(HeldoutSource(label, str(corpus_dir)), split, tokenizer, cache_dir=tmp_path)
        assert record["models"]["BL"]["cells"][label]["16"]["split_tokens"] == tokens.shape[0]
    assert "Held-out PPL on splits T test, V validation" in table7_markdown(record)
    with pytest.raises(ValueError, match=r"source_splits names \['PG-19'\]"):
        evaluate_heldout([("BL", model_dirs["BL"])], [str(corpus_dir)], [16], source_splits={"PG-19": "test"},
                         device="cpu", cache_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="split of source 'T' must be one of"):
        evaluate_heldout([("BL", model_dirs["BL"])], [f"T={corpus_dir}"], [16], source_splits={"T": "dev"},
                         device="cpu", cache_dir=tmp_path, progress=False)


# ----------------------------------------------------------------------------- bad input


def test_bad_input_names_the_argument(model_dirs, corpus_dir, tokenizer, tmp_path):
    models = [("BL", model_dirs["BL"]), ("GDN", model_dirs["GDN"])]
    ok = dict(device="cpu", cache_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="sources: .*not a corpus"):
        evaluate_heldout(models, [str(tmp_path / "no-such-corpus")], [16], **ok)
    with pytest.raises(ValueError, match="lengths must be an integer >= 2"):
        evaluate_heldout(models, [str(corpus_dir)], [1], **ok)
    with pytest.raises(ValueError, match="lengths must be distinct"):
        evaluate_heldout(models, [str(corpus_dir)], [16, 16], **ok)
    with pytest.raises(ValueError, match=r"reference must be one of the model labels \['BL', 'GDN'\], got 'GDN-FT'"):
        evaluate_heldout(models, [str(corpus_dir)], [16], reference="GDN-FT", **ok)
    with pytest.raises(ValueError, match="labels must be distinct"):
        evaluate_heldout([("A", model_dirs["BL"]), ("A", model_dirs["GDN"])], [str(corpus_dir)], [16], **ok)
    with pytest.raises(ValueError, match="split must be one of"):
        evaluate_heldout(models, [str(corpus_dir)], [16], split="dev", **ok)
    with pytest.raises(ValueError, match="stride applies to windows='sliding' only"):
        evaluate_heldout(models, [str(corpus_dir)], [16], stride=4, **ok)
    with pytest.raises(ValueError, match=r"stride \(16\) must be < every length"):
        evaluate_heldout(models, [str(corpus_dir)], [16], windows="sliding", stride=16, **ok)
    with pytest.raises(ValueError, match="max_windows must be an integer >= 1"):
        evaluate_heldout(models, [str(corpus_dir)], [16], max_windows=0, **ok)
    with pytest.raises(ValueError, match="max_documents names"):
        evaluate_heldout(models, [str(corpus_dir)], [16], max_documents={"PG-19": 50}, **ok)
    with pytest.raises(ValueError, match="precision must be one of"):
        evaluate_heldout(models, [str(corpus_dir)], [16], precision="fp16", **ok)
    with pytest.raises(ValueError, match="models: .* is not a directory"):
        evaluate_heldout([("X", tmp_path / "missing")], [str(corpus_dir)], [16], **ok)
    bare = model_dir(tmp_path / "bare", tokenizer, "bayesian", 0, with_tokenizer=False)
    with pytest.raises(ValueError, match=r"no tokenizer.json .*pass a tokenizer \(--tokenizer"):
        evaluate_heldout([("bare", bare)], [str(corpus_dir)], [16], **ok)
    with pytest.raises(ValueError, match="tokenizer: no tokenizer.json"):
        evaluate_heldout([("bare", bare)], [str(corpus_dir)], [16], tokenizer=tmp_path / "nowhere", **ok)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither config.json"):
        resolve_model("E", tmp_path / "empty")
    small = tmp_path / "small"  # a tokenizer with more ids than the model's embedding
    tiny_model(100, "bayesian", 0).save_pretrained(small)
    tokenizer.save(str(small / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"has 300 ids but model small only 100: it is not this model's tokenizer"):
        evaluate_heldout([("small", small)], [str(corpus_dir)], [16], **ok)


def test_bad_windows_and_scores():
    model = tiny_model(300, "bayesian", 0)
    ids = np.zeros((2, 8), dtype=np.int64)
    with pytest.raises(ValueError, match="windows must be a numpy array"):
        heldout_perplexity(model, ids[0])
    with pytest.raises(TypeError, match="integer token ids"):
        heldout_perplexity(model, ids.astype(np.float32))
    with pytest.raises(ValueError, match=r"scored must be a boolean numpy array \[N, L-1\] = \(2, 7\)"):
        heldout_perplexity(model, ids, scored=np.ones((2, 8), dtype=bool))
    with pytest.raises(ValueError, match="selects no prediction"):
        heldout_perplexity(model, ids, scored=np.zeros((2, 7), dtype=bool))
    with pytest.raises(ValueError, match="batch_size"):
        heldout_perplexity(model, ids, batch_size=0)
    stream = np.arange(20, dtype=np.int64)
    with pytest.raises(ValueError, match="holds no window of length 32"):
        window_plan(stream, 32)
    with pytest.raises(ValueError, match="length must be an integer >= 2"):
        window_plan(stream, 1)
    with pytest.raises(ValueError, match="needs a stride"):
        window_plan(stream, 8, windows="sliding")
    with pytest.raises(ValueError, match="stride must be < length"):
        window_plan(stream, 8, windows="sliding", stride=8)
    with pytest.raises(ValueError, match="windows must be one of"):
        window_plan(stream, 8, windows="strided")
    with pytest.raises(ValueError, match="tokens must be a 1-D integer"):
        window_plan(stream.astype(float), 8)
