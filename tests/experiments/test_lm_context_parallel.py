"""``lm train --context-parallel``: a torchrun job whose two ranks share every window, against one process.

The corpus is the tiny one the LM tests write; the job runs on CPU with gloo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from bayeslayer.cli import main as cli_main
from bayeslayer.experiments.common.lm_run import train_lm
from bayeslayer.training.lm import load_run
from bayeslayer.training.lm_config import LMConfig

from .corpus import write_word_corpus


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("cp_corpus") / "text", {"train": 40, "validation": 6, "test": 6},
                             sentences=12, repeat_phrase=True)


def _log_losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["event"] == "train"]


@pytest.mark.slow
def test_torchrun_context_parallel_matches_one_process(tmp_path, corpus_dir):
    """torchrun --nproc_per_node 2 lm train --context-parallel 2: each 32-token window split over both ranks;
    the losses and final weights equal a single process's (float32: rtol 1e-5 on losses, 1e-4 on weights)."""
    cache_dir = str(tmp_path / "cache")
    out = tmp_path / "cp"
    options = dict(mixer="bayesian", hidden_size=32, num_layers=2, num_heads=2, head_dim=8, mlp_dropout=0.0,
                   source=str(corpus_dir), vocab_size=300, seq_len=32, steps=3, batch_size=4, micro_batch_size=2,
                   lr=3e-3, warmup_steps=1, eval_every=2, eval_windows=2, checkpoint_every=2, log_every=1, seed=0)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "bayeslayer.cli", "lm", "train", "--preset", "tiny", "--no-progress", "--out", str(out),
           "--cache-dir", cache_dir, "--device", "cpu", "--context-parallel", "2"]
    for name, value in options.items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["context_parallel"] == 2 and summary["steps"] == 3
    assert len(set(summary["rank_weights_sha256"])) == 1

    saved = LMConfig.from_json(json.loads((out / "config.json").read_text()))
    single = train_lm(replace(saved, preset="tiny"), tmp_path / "single", cache_dir=cache_dir, progress=False)
    np.testing.assert_allclose(_log_losses(out), single.losses, rtol=1e-5)
    _, cp_model = load_run(out)
    _, one_model = load_run(tmp_path / "single")
    for (name, a), (_, b) in zip(cp_model.state_dict().items(), one_model.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_context_parallel_without_torchrun_is_refused(tmp_path, corpus_dir, capsys):
    code = cli_main(["lm", "train", "--preset", "tiny", "--no-progress", "--out", str(tmp_path / "run"),
                     "--source", str(corpus_dir), "--device", "cpu", "--context-parallel", "2"])
    assert code != 0
    assert "context_parallel=2 must divide the number of ranks (1)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
