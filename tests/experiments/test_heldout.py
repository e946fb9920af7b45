"""``bayeslayer heldout`` (Table 7 layout): JSON → table and plot, the command line's wiring onto the config, the
report files, and torchrun ranks against one process.  The evaluation itself: tests/evaluation/test_heldout.py.

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

import pytest

from bayeslayer.cli import build_parser
from bayeslayer.cli import main as cli_main
from bayeslayer.evaluation.heldout import HeldoutSource, evaluate_heldout, load_heldout_stream
from bayeslayer.evaluation.perplexity import window_plan
from bayeslayer.experiments import heldout, lm
from bayeslayer.experiments.heldout import HeldoutConfig, table7_markdown
from bayeslayer.models import BayesLayerForCausalLM
from tests.evaluation import heldout_setup
from tests.evaluation.heldout_setup import evaluate_tiny, hand_ppl

# the shared module-scoped fixtures
corpus_dir, tokenizer, model_dirs = heldout_setup.corpus_dir, heldout_setup.tokenizer, heldout_setup.model_dirs

# ----------------------------------------------------------------------------- evaluate → JSON → table, plot


def test_evaluate_writes_table7_cells_with_the_change_vs_the_reference(model_dirs, corpus_dir, tokenizer, tmp_path):
    with pytest.warns(RuntimeWarning, match="fewer than one window"):
        record = evaluate_tiny(model_dirs, corpus_dir, tmp_path / "cache")
    assert record["experiment"] == "heldout" and record["reference"] == "GDN"
    assert record["target"]["rel_change_pct"] == [2.3, 2.8] and "2.3–2.8%" in record["target"]["statement"]
    bl, gdn = record["models"]["BL"]["cells"]["tiny"], record["models"]["GDN"]["cells"]["tiny"]
    tokens = load_heldout_stream(HeldoutSource("tiny", str(corpus_dir)), "test", tokenizer, cache_dir=tmp_path / "c2")
    model = BayesLayerForCausalLM.from_pretrained(model_dirs["BL"]).eval()
    for L in (16, 32):
        windows, _ = window_plan(tokens, L)
        assert bl[str(L)]["windows"] == windows.shape[0] == tokens.shape[0] // L
        assert bl[str(L)]["n_tokens"] == windows.shape[0] * (L - 1)
        assert bl[str(L)]["ppl"] == pytest.approx(hand_ppl(model, windows)[0], rel=1e-5)
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
