"""Held-out PPL (Table 7 layout): PPL against a hand computation over the same windows, the window
rules (non-overlapping count and layout, sliding coverage), relative change, JSON → table/plot,
the cell cache, model kinds (HF dir, lm run dir, fla GDN checkpoint), the CLI wiring, bad input.

Everything is CPU-only and offline: a tiny corpus and tokenizer written by the test, tiny models.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bayeslayer.cli import build_parser
from bayeslayer.cli import main as cli_main
from bayeslayer.data.text import train_bpe_tokenizer
from bayeslayer.experiments import heldout, lm
from bayeslayer.experiments.heldout import (
    HeldoutConfig,
    HeldoutSource,
    evaluate_heldout,
    heldout_perplexity,
    load_heldout_stream,
    relative_change,
    resolve_model,
    table7_markdown,
    window_plan,
)
from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM, loading
from bayeslayer.training import lm as training_lm
from bayeslayer.training import lm_config

from .corpus import WORDS, write_word_corpus


def _write_corpus(root: Path) -> Path:
    return write_word_corpus(root, {"train": 30, "validation": 4, "test": 6}, sentences=10, words=(4, 10))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("heldout_corpus") / "text")


@pytest.fixture(scope="module")
def tokenizer(corpus_dir):
    return train_bpe_tokenizer([(corpus_dir / "train.txt").read_text()], 300)


def _model(vocab: int, mixer: str, seed: int) -> BayesLayerForCausalLM:
    torch.manual_seed(seed)
    config = BayesLayerConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=8,
                              mixer=mixer, mlp_dropout=0.0)
    return BayesLayerForCausalLM(config).eval()


def _model_dir(path: Path, tokenizer, mixer: str, seed: int, *, with_tokenizer: bool = True) -> Path:
    _model(tokenizer.get_vocab_size(with_added_tokens=True), mixer, seed).save_pretrained(path)
    if with_tokenizer:
        tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heldout_models")
    return {"GDN": _model_dir(root / "gdn", tokenizer, "gated_deltanet", 1),
            "BL": _model_dir(root / "bl", tokenizer, "bayesian", 0)}


def _hand_ppl(model, windows: np.ndarray, scored: np.ndarray | None = None) -> tuple[float, int]:
    """exp(mean CE) with each window run alone from an empty state, log-softmax in float64."""
    total, n = 0.0, 0
    for i, row in enumerate(windows):
        ids = torch.from_numpy(np.asarray(row, dtype=np.int64))[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
        ce = -logp[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
        keep = torch.ones_like(ce, dtype=torch.bool) if scored is None else torch.from_numpy(scored[i].copy())
        total += float(ce[keep].sum())
        n += int(keep.sum())
    return math.exp(total / n), n


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
    model = _model(tokenizer.get_vocab_size(with_added_tokens=True), "bayesian", 0)
    tokens = load_heldout_stream(HeldoutSource("tiny", str(corpus_dir)), "test", tokenizer, cache_dir=tmp_path)
    windows, _ = window_plan(tokens, 20)
    out = heldout_perplexity(model, windows, batch_size=3)
    expected, n = _hand_ppl(model, windows)
    assert out["windows"] == windows.shape[0]
    assert out["n_tokens"] == n == windows.shape[0] * 19  # the first token of each window is context only
    assert out["ppl"] == pytest.approx(expected, rel=1e-5)
    assert out["mean_ce"] == pytest.approx(math.log(expected), rel=1e-5)
    first = heldout_perplexity(model, windows, batch_size=2, max_windows=3)
    assert first["windows"] == 3 and first["n_tokens"] == 3 * 19
    assert first["ppl"] == pytest.approx(_hand_ppl(model, windows[:3])[0], rel=1e-5)


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
    model = _model(tokenizer.get_vocab_size(with_added_tokens=True), "gated_deltanet", 1)
    out = heldout_perplexity(model, windows, scored=scored, batch_size=4, max_windows=7)
    expected, n = _hand_ppl(model, windows[:7], scored[:7])
    assert out["n_tokens"] == n == (L - 1) + 6 * S
    assert out["ppl"] == pytest.approx(expected, rel=1e-5)


def test_relative_change_arithmetic():
    assert relative_change(102.5, 100.0) == pytest.approx(2.5)
    assert relative_change(20.01, 18.75) == pytest.approx(100 * (20.01 / 18.75 - 1))
    assert relative_change(9.0, 10.0) == pytest.approx(-10.0)
    for bad in ((0.0, 1.0), (1.0, -2.0), (float("nan"), 1.0), (1.0, float("inf")), ("1", 1.0)):
        with pytest.raises(ValueError, match="ppl"):
            relative_change(*bad)


# ----------------------------------------------------------------------------- evaluate → JSON → table, plot


def _evaluate(model_dirs, corpus_dir, cache, **kwargs):
    args = dict(split="test", reference="GDN", batch_size=2, device="cpu", cache_dir=cache, progress=False)
    args.update(kwargs)
    models = [("BL", model_dirs["BL"]), ("GDN", model_dirs["GDN"])]
    return evaluate_heldout(models, [f"tiny={corpus_dir}"], [16, 32, 1_000_000], **args)


def test_evaluate_writes_table7_cells_with_the_change_vs_the_reference(model_dirs, corpus_dir, tokenizer, tmp_path):
    with pytest.warns(RuntimeWarning, match="fewer than one window"):
        record = _evaluate(model_dirs, corpus_dir, tmp_path / "cache")
    assert record["experiment"] == "heldout" and record["reference"] == "GDN"
    assert record["target"]["rel_change_pct"] == [2.3, 2.8] and "2.3–2.8%" in record["target"]["statement"]
    bl, gdn = record["models"]["BL"]["cells"]["tiny"], record["models"]["GDN"]["cells"]["tiny"]
    tokens = load_heldout_stream(HeldoutSource("tiny", str(corpus_dir)), "test", tokenizer, cache_dir=tmp_path / "c2")
    model = BayesLayerForCausalLM.from_pretrained(model_dirs["BL"]).eval()
    for L in (16, 32):
        windows, _ = window_plan(tokens, L)
        assert bl[str(L)]["windows"] == windows.shape[0] == tokens.shape[0] // L
        assert bl[str(L)]["n_tokens"] == windows.shape[0] * (L - 1)
        assert bl[str(L)]["ppl"] == pytest.approx(_hand_ppl(model, windows)[0], rel=1e-5)
        assert bl[str(L)]["rel_change_pct"] == pytest.approx(100 * (bl[str(L)]["ppl"] / gdn[str(L)]["ppl"] - 1))
        assert gdn[str(L)]["rel_change_pct"] is None  # the reference row
    assert "skipped" in bl["1000000"] and bl["1000000"]["split_tokens"] == tokens.shape[0]
    assert record["models"]["BL"]["same_tokenizer_as_reference"]

    paths = heldout.write_report(record, tmp_path / "out")
    saved = json.loads(paths["json"].read_text())
    assert saved.pop("provenance")["device"] == "cpu"
    assert saved == json.loads(json.dumps(record))
    md = paths["table"].read_text()
    assert md == table7_markdown(saved)
    assert "| model | tiny 16 | tiny 32 | tiny 1,000,000 |" in md
    row = next(line for line in md.splitlines() if line.startswith("| BL |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert cells[0] == f"{bl['16']['ppl']:.2f} ({bl['16']['rel_change_pct']:+.1f}%)"
    assert cells[2] == "–"
    assert re.search(r"\| GDN \| \d+\.\d\d \| \d+\.\d\d \| – \|", md)
    assert "2.3–2.8%" in md and "Skipped" in md
    assert paths["plot"].stat().st_size > 1000


def test_table_and_plot_come_from_the_json_alone(tmp_path):
    def cell(ppl, rel):
        return {"ppl": ppl, "mean_ce": math.log(ppl), "n_tokens": 100, "windows": 2, "rel_change_pct": rel}

    record = {"experiment": "heldout", "preset": "non-overlapping", "reference": "GDN",
              "config": {"split": "test", "lengths": [2048, 4096], "windows": "non-overlapping",
                         "sources": [{"label": "WikiText-103"}, {"label": "PG-19"}]},
              "models": {"GDN": {"same_tokenizer_as_reference": True,
                                 "cells": {"WikiText-103": {"2048": cell(20.0, None), "4096": cell(19.0, None)},
                                           "PG-19": {"2048": cell(30.0, None), "4096": cell(28.0, None)}}},
                         "BL": {"same_tokenizer_as_reference": False,
                                "cells": {"WikiText-103": {"2048": cell(20.5, 2.5), "4096": cell(19.5, 2.63)},
                                          "PG-19": {"2048": cell(30.7, 2.33), "4096": cell(28.8, 2.86)}}}},
              "target": heldout.PAPER_TABLE7}
    md = table7_markdown(record)
    assert "| model | WikiText-103 2k | WikiText-103 4k | PG-19 2k | PG-19 4k |" in md
    assert "| BL † | 20.50 (+2.5%) | 19.50 (+2.6%) | 30.70 (+2.3%) | 28.80 (+2.9%) |" in md
    assert "| GDN | 20.00 | 19.00 | 30.00 | 28.00 |" in md
    assert "† tokenizer differs" in md
    path = tmp_path / "h.json"
    path.write_text(json.dumps(record))
    assert heldout.redraw(tmp_path, "h") == record
    assert (tmp_path / "h.md").read_text() == md
    assert (tmp_path / "h.png").stat().st_size > 1000
    (tmp_path / "h.md").unlink()
    assert cli_main(["heldout", "--plot-only", "--out", str(tmp_path), "--name", "h"]) == 0
    assert (tmp_path / "h.md").read_text() == md
    with pytest.raises(ValueError, match="experiment 'heldout'"):
        table7_markdown({"experiment": "lm", "models": {}})


def test_a_rerun_is_served_from_the_cache_without_loading_a_model(model_dirs, corpus_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    with pytest.warns(RuntimeWarning):
        first = _evaluate(model_dirs, corpus_dir, cache)

    def no_model(*_args, **_kwargs):
        raise AssertionError("the model was loaded although every cell is cached")

    monkeypatch.setattr(heldout.HeldoutModel, "load", no_model)
    monkeypatch.setattr(heldout, "heldout_perplexity", no_model)
    second = _evaluate(model_dirs, corpus_dir, cache, precision="auto")  # auto is fp32 on a CPU
    assert second["models"] == first["models"]
    with pytest.raises(AssertionError, match="model was loaded"):  # a new cap is a new cell
        _evaluate(model_dirs, corpus_dir, cache, max_windows=2)


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
    assert cell["ppl"] == pytest.approx(_hand_ppl(model.eval(), windows)[0], rel=1e-5)


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


# ----------------------------------------------------------------------------- command line


def test_heldout_command_maps_its_options_onto_the_config_and_writes_the_report(model_dirs, corpus_dir, tmp_path,
                                                                              capsys):
    argv = ["heldout", "--windows", "non-overlapping", "--lengths", "16,32",
            "--model", f"GDN={model_dirs['GDN']}", "--model", f"BL={model_dirs['BL']}",
            "--source", f"tiny={corpus_dir}", "--split", "test", "--reference", "GDN",
            "--max-windows", "3", "--device", "cpu", "--cache-dir", str(tmp_path / "cache"),
            "--out", str(tmp_path / "out")]
    config = heldout.config_from_args(build_parser().parse_args(argv))
    assert config == HeldoutConfig(
        models=(("GDN", str(model_dirs["GDN"])), ("BL", str(model_dirs["BL"]))), sources=(f"tiny={corpus_dir}",),
        lengths=(16, 32), reference="GDN", max_windows=3, device="cpu", cache_dir=str(tmp_path / "cache"),
        out=str(tmp_path / "out"))
    assert cli_main(argv) == 0
    record = json.loads((tmp_path / "out" / "heldout.json").read_text())
    assert list(record["models"]) == ["GDN", "BL"]
    assert all(c["windows"] == 3 for m in record["models"].values() for c in m["cells"]["tiny"].values())
    assert (tmp_path / "out" / "heldout.md").is_file() and (tmp_path / "out" / "heldout.png").is_file()
    assert "| BL |" in capsys.readouterr().out


def test_heldout_run_is_called_with_a_config(model_dirs, corpus_dir, tmp_path, capsys):
    record = heldout.run(HeldoutConfig(
        models=[("BL", model_dirs["BL"])], sources=[str(corpus_dir)], lengths=[16], windows="sliding", stride=8,
        max_windows=2, max_documents=2, source_splits={str(corpus_dir): "validation"}, device="cpu",
        cache_dir=str(tmp_path / "cache"), out=str(tmp_path / "o2"), name="t7", progress=False))
    saved = json.loads((tmp_path / "o2" / "t7.json").read_text())
    assert saved.pop("provenance")["backfilled"] is False
    assert saved == json.loads(json.dumps(record))
    assert record["config"]["windows"] == "sliding" and record["config"]["stride"] == 8
    assert record["config"]["sources"][0]["max_documents"] == 2
    assert record["config"]["sources"][0]["split"] == "validation"
    cell = record["models"]["BL"]["cells"][str(corpus_dir)]["16"]
    assert cell["n_tokens"] == 15 + 8
    assert (tmp_path / "o2" / "t7.md").read_text() == table7_markdown(record)
    with pytest.raises(ValueError, match="at least one --model"):
        heldout.run(HeldoutConfig(out=str(tmp_path / "o3")))
    with pytest.raises(TypeError, match="HeldoutConfig"):
        heldout.run({"models": []})
    with pytest.raises(ValueError, match="model or run folder"):
        heldout.run(HeldoutConfig(models=[("X", tmp_path / "missing")], out=str(tmp_path / "o3")))


def test_heldout_is_its_own_command_and_lm_eval_no_longer_has_it(capsys):
    assert cli_main(["heldout", "--help"]) == 0
    assert "usage: bayeslayer heldout" in capsys.readouterr().out
    assert cli_main(["lm", "eval", "--lengths", "16", "--model", "x"]) == 2  # the old spelling moved
    assert "unrecognized arguments" in capsys.readouterr().err
    lm_source = Path(lm.__file__).read_text()
    assert "heldout" not in "".join(line for line in lm_source.splitlines() if "import" in line)  # no cycle back


@pytest.mark.slow
def test_torchrun_two_ranks_match_one_process_including_cached_and_skipped_cells(model_dirs, corpus_dir, tmp_path):
    """torchrun --nproc_per_node 2 (gloo): windows shared across ranks give one process's PPL; a rerun that mixes
    cached, new and skipped cells does not hang (every rank agrees on cache hits)."""
    base = ["--model", f"GDN={model_dirs['GDN']}", "--model", f"BL={model_dirs['BL']}", "--source",
            f"tiny={corpus_dir}", "--device", "cpu", "--batch-size", "2", "--cache-dir", str(tmp_path / "c2")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for lengths, out in (("16,1000000", "first"), ("16,24,1000000", "second")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "bayeslayer.cli", "heldout", "--lengths", lengths, "--out", str(tmp_path / out), *base]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dist_record = json.loads((tmp_path / "second" / "heldout.json").read_text())
    assert dist_record["config"]["world_size"] == 2
    with pytest.warns(RuntimeWarning):
        single = evaluate_heldout([("GDN", model_dirs["GDN"]), ("BL", model_dirs["BL"])], [f"tiny={corpus_dir}"],
                                  [16, 24, 1_000_000], device="cpu", cache_dir=tmp_path / "c1", progress=False)
    for label, m in single["models"].items():
        for L, cell in m["cells"]["tiny"].items():
            other = dist_record["models"][label]["cells"]["tiny"][L]
            if "skipped" in cell:
                assert "skipped" in other
            else:
                assert other["n_tokens"] == cell["n_tokens"] and other["windows"] == cell["windows"]
                assert other["ppl"] == pytest.approx(cell["ppl"], rel=1e-6)


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
    bare = _model_dir(tmp_path / "bare", tokenizer, "bayesian", 0, with_tokenizer=False)
    with pytest.raises(ValueError, match=r"no tokenizer.json .*pass a tokenizer \(--tokenizer"):
        evaluate_heldout([("bare", bare)], [str(corpus_dir)], [16], **ok)
    with pytest.raises(ValueError, match="tokenizer: no tokenizer.json"):
        evaluate_heldout([("bare", bare)], [str(corpus_dir)], [16], tokenizer=tmp_path / "nowhere", **ok)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither config.json"):
        resolve_model("E", tmp_path / "empty")
    small = tmp_path / "small"  # a tokenizer with more ids than the model's embedding
    _model(100, "bayesian", 0).save_pretrained(small)
    tokenizer.save(str(small / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"has 300 ids but model small only 100: it is not this model's tokenizer"):
        evaluate_heldout([("small", small)], [str(corpus_dir)], [16], **ok)


def test_bad_windows_and_scores():
    model = _model(300, "bayesian", 0)
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
