"""``bayeslayer lm``: training, exact resume after a kill, DDP with gloo, grouped PPL, eval outputs, bad input.

Everything runs on a tiny corpus written by the test (no network, no python3-doc) and
a tiny model; the torchrun test starts two CPU processes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bayeslayer.cli import main as cli_main
from bayeslayer.data.arhit import BigramCounts, annotate_ar_hits
from bayeslayer.data.text.windows import WindowSchedule
from bayeslayer.evaluation.perplexity import grouped_perplexity
from bayeslayer.experiments import lm
from bayeslayer.experiments.common.lm_run import latest_checkpoint, train_lm
from bayeslayer.experiments.lm import GROUPS, PRESETS, markdown_table, summarize_runs
from bayeslayer.training.distributed import resolve_precision
from bayeslayer.training.lm import build_model, load_run
from bayeslayer.training.lm_config import LMConfig
from bayeslayer.training.state import weights_digest

from ..training.faults import Forked, single_thread
from .corpus import write_word_corpus


def _write_corpus(root: Path) -> Path:
    """Three split files of English-like text with repeated phrases (so AR-hit tokens exist)."""
    return write_word_corpus(root, {"train": 40, "validation": 6, "test": 6}, sentences=12, repeat_phrase=True)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return _write_corpus(tmp_path_factory.mktemp("lm_corpus") / "text")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("lm_cache"))


def _config(corpus_dir: Path, **overrides) -> LMConfig:
    base = dict(preset="test", mixer="bayesian", hidden_size=32, num_layers=1, num_heads=2, head_dim=8,
                mlp_dropout=0.1, source=str(corpus_dir), vocab_size=300, seq_len=32, steps=8, batch_size=4,
                micro_batch_size=2, lr=3e-3, warmup_steps=2, eval_every=4, eval_windows=2, eval_batch_size=4,
                checkpoint_every=3, log_every=1, seed=0)
    base.update(overrides)
    return LMConfig(**base)


def _train_losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r["event"] == "train"]


def test_resume_after_kill_matches_uninterrupted_run(tmp_path, corpus_dir, cache_dir):
    """SIGKILL a training process mid-run (between checkpoints), leave a half-written checkpoint
    behind, rerun: the loss trajectory, the log and the final weights equal an uninterrupted
    run's bit for bit (same machine, fp32, dropout on so the RNG state matters).  The killed process is forked
    from the test's (``tests/training/faults.py``), so it starts without importing anything again."""
    config = _config(corpus_dir)
    run = tmp_path / "killed"

    def kill_at_5(step, loss):
        if step == 5:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no final checkpoint: a real kill -9

    with single_thread():  # the killed run and the others alike, so the floats are reduced in the same order
        full = train_lm(config, tmp_path / "full", cache_dir=cache_dir, progress=False)
        assert full.finished and len(full.losses) == config.steps
        killed = Forked(lambda say: train_lm(config, run, cache_dir=cache_dir, progress=False, on_step=kill_at_5))
        assert killed.wait() == -signal.SIGKILL, "the training process was not killed (its traceback is on stderr)"
    assert latest_checkpoint(run).name == "step-00000003"  # steps 4-5 were lost with the process
    assert [s for s, _ in _train_losses(run)] == [1, 2, 3, 4, 5]
    (run / "checkpoints" / ".tmp-halfwritten").mkdir()  # a kill during a checkpoint write
    (run / "checkpoints" / ".tmp-halfwritten" / "model.safetensors").write_bytes(b"\0" * 10)

    with single_thread():
        resumed = train_lm(config, run, cache_dir=cache_dir, progress=False)
    assert resumed.resumed_from == 3
    assert resumed.losses == full.losses  # exact: same floats
    assert _train_losses(run) == _train_losses(tmp_path / "full")  # the log has each step once
    assert resumed.summary["weights_sha256"] == full.summary["weights_sha256"]
    assert resumed.summary["validation"] == full.summary["validation"]
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_graceful_stop_and_resume_and_finished_run(tmp_path, corpus_dir, cache_dir):
    config = _config(corpus_dir, steps=5, checkpoint_every=0, mlp_dropout=0.0)
    first = train_lm(config, tmp_path / "r", cache_dir=cache_dir, progress=False, stop_after=2)
    assert not first.finished and first.step == 2 and not (tmp_path / "r" / "final").exists()
    assert latest_checkpoint(tmp_path / "r").name == "step-00000002"
    second = train_lm(config, tmp_path / "r", cache_dir=cache_dir, progress=False)
    assert second.finished and second.resumed_from == 2 and len(second.losses) == 5
    saved = json.loads((tmp_path / "r" / "train_summary.json").read_text())
    assert saved["steps"] == 5 and saved["tokens"] == 5 * config.batch_size * config.seq_len
    assert set(saved["validation"]) >= {"all", "ar_hit", "other"}
    # the saved final model is the trained one, loadable from the run directory alone
    loaded_config, model = load_run(tmp_path / "r")
    assert loaded_config == config
    assert weights_digest(model) == saved["weights_sha256"]
    # bookkeeping may change on resume; anything that shapes the trajectory may not
    train_lm(replace(config, log_every=2), tmp_path / "r", cache_dir=cache_dir, progress=False)
    with pytest.raises(ValueError, match="different configuration.*lr"):
        train_lm(replace(config, lr=1e-3), tmp_path / "r", cache_dir=cache_dir, progress=False)


@pytest.mark.parametrize("mixer", ["gated_deltanet", "mamba2", "attention"])
def test_any_mixer_trains(tmp_path, corpus_dir, cache_dir, mixer):
    config = _config(corpus_dir, mixer=mixer, steps=2, warmup_steps=1, checkpoint_every=0, eval_every=0)
    result = train_lm(config, tmp_path / mixer, cache_dir=cache_dir, progress=False)
    assert result.finished and all(math.isfinite(x) for x in result.losses)
    assert result.summary["mixer"] == mixer


def test_bf16_autocast_trains_and_evaluates(tmp_path, corpus_dir, cache_dir):
    config = _config(corpus_dir, steps=2, warmup_steps=1, checkpoint_every=0, eval_every=0, precision="bf16")
    result = train_lm(config, tmp_path / "bf16", cache_dir=cache_dir, progress=False)
    fp32 = train_lm(replace(config, precision="fp32"), tmp_path / "fp32", cache_dir=cache_dir, progress=False)
    assert all(math.isfinite(x) for x in result.losses)
    assert result.losses != fp32.losses  # autocast really ran in bf16 ...
    np.testing.assert_allclose(result.losses, fp32.losses, rtol=2e-2)  # ... and computes the same loss
    assert resolve_precision("auto", torch.device("cpu")) is None
    assert resolve_precision("bf16", torch.device("cpu")) is torch.bfloat16


def test_loss_decreases_on_repetitive_text(tmp_path, corpus_dir, cache_dir):
    config = _config(corpus_dir, steps=30, lr=1e-2, warmup_steps=3, checkpoint_every=0, eval_every=0,
                     mlp_dropout=0.0)
    result = train_lm(config, tmp_path / "learn", cache_dir=cache_dir, progress=False)
    assert np.mean(result.losses[-5:]) < np.mean(result.losses[:3]) - 0.5


def ddp_argv(out: Path, corpus_dir: Path, cache_dir: Path) -> list[str]:
    """The ``bayeslayer lm train`` arguments of the two-rank run below (the default suite's two-rank job,
    ``tests/two_rank_job.py``, runs them on both of its ranks, each with the environment ``torchrun`` gives)."""
    config = _config(corpus_dir, steps=3, batch_size=4, micro_batch_size=1, mlp_dropout=0.0, checkpoint_every=2)
    argv = ["lm", "train", "--preset", "tiny", "--no-progress", "--out", str(out), "--cache-dir", str(cache_dir),
            "--device", "cpu"]
    for name in ("mixer", "hidden_size", "num_layers", "num_heads", "head_dim", "mlp_dropout", "source", "vocab_size",
                 "seq_len", "steps", "batch_size", "micro_batch_size", "lr", "warmup_steps", "eval_every",
                 "eval_windows", "checkpoint_every", "log_every", "seed"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(config, name))]
    return argv


def test_torchrun_two_ranks_gloo_agree_and_match_one_process(tmp_path, two_rank_job):
    """torchrun --nproc_per_node 2 (gloo, CPU): both ranks end with identical weights, and the run equals a
    single process with the same global batch (gradient accumulation instead of a second rank).

    The two ranks are the default suite's one two-rank job (``tests/two_rank_job.py``, part ``lm_ddp``): each runs
    ``bayeslayer.cli.main`` with :func:`ddp_argv`'s arguments in ``torchrun``'s environment."""
    out = two_rank_job / "lm_ddp" / "run"
    cache_dir = str(two_rank_job / "lm_ddp" / "cache")
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert len(summary["rank_weights_sha256"]) == 2 and len(set(summary["rank_weights_sha256"])) == 1

    saved_config = LMConfig.from_json(json.loads((out / "config.json").read_text()))
    single = train_lm(replace(saved_config, preset="tiny"), tmp_path / "single", cache_dir=cache_dir,
                      progress=False)
    ddp_losses = [loss for _, loss in _train_losses(out)]
    np.testing.assert_allclose(ddp_losses, single.losses, rtol=1e-5)
    _, ddp_model = load_run(out)
    _, one_model = load_run(tmp_path / "single")
    for (name, a), (_, b) in zip(ddp_model.state_dict().items(), one_model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_grouped_perplexity_is_exp_mean_ce_over_exactly_the_selected_tokens(corpus_dir):
    torch.manual_seed(0)
    config = _config(corpus_dir)
    model = build_model(config, vocab_size=50).eval()
    rng = np.random.default_rng(1)
    windows = rng.integers(0, 50, size=(5, 24))
    windows[:, 12:] = windows[:, :12]  # repeats, so some tokens are AR-hits
    counts = BigramCounts.from_tokens(rng.integers(0, 50, size=400), vocab_size=50)
    masks = annotate_ar_hits(windows, counts).masks(shifted=True)
    masks["sparse"] = rng.random(masks["all"].shape) < 0.1
    assert 0 < masks["ar_hit"].sum() < masks["all"].sum()
    got = grouped_perplexity(model, windows, masks, batch_size=2)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(windows)).logits.double()
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), torch.from_numpy(windows[:, 1:]).flatten(),
                         reduction="none").view(5, 23).numpy()
    for name, mask in masks.items():
        assert got[name]["n_tokens"] == mask.sum()
        if not mask.any():  # windows of 24 tokens have no hit beyond distance 64
            assert got[name]["ppl"] is None and name in ("ar_hit_65_256", "ar_hit_257_1024")
            continue
        expected = math.exp(ce[mask].mean())
        assert got[name]["ppl"] == pytest.approx(expected, rel=1e-5), name
    # the last window alone (a different batch split) gives the same per-token numbers
    one = grouped_perplexity(model, windows[-1:], {"all": masks["all"][-1:]}, batch_size=1)
    assert one["all"]["ppl"] == pytest.approx(math.exp(ce[-1].mean()), rel=1e-5)


def _fake_record(label, seed, scale, split="test", seq_len=32):
    groups = {g: {"ppl": scale * (i + 1), "mean_ce": math.log(scale * (i + 1)), "n_tokens": 10 * (i + 1)}
              for i, g in enumerate(GROUPS)}
    return {"label": label, "mixer": label.lower(), "seed": seed, "preset": "test", "split": split,
            "seq_len": seq_len, "groups": groups}


def test_summary_table_and_plot_layout(tmp_path):
    records = [_fake_record("BL", 0, 10.0), _fake_record("BL", 1, 12.0), _fake_record("GDN", 0, 11.0)]
    record = summarize_runs(records)
    assert list(record["models"]) == ["BL", "GDN"]
    bl = record["models"]["BL"]["summary"]["all"]
    assert bl["mean"] == pytest.approx(11.0) and bl["std"] == pytest.approx(math.sqrt(2.0))
    assert bl["values"] == [10.0, 12.0]
    table = markdown_table(record)
    lines = table.splitlines()
    assert "| model | all | AR-hit | other |" in lines
    assert "| BL | 11.00 ± 1.41 | 22.00 ± 2.83 | 33.00 ± 4.24 |" in lines
    assert "| GDN | 11.00 | 22.00 | 33.00 |" in lines  # one seed: no ± shown
    assert "| model | AR-hit 1–64 | AR-hit 65–256 | AR-hit 257–1,024 |" in lines
    paths = lm.write_report(record, tmp_path, "t")
    assert paths["plot"].stat().st_size > 1000
    assert json.loads(paths["json"].read_text())["models"]["GDN"]["summary"]["other"]["values"] == [33.0]
    paths["table"].unlink()
    paths["plot"].unlink()
    assert cli_main(["lm", "eval", "--plot-only", "--out", str(tmp_path), "--name", "t"]) == 0  # from the JSON alone
    assert paths["table"].read_text() == table and paths["plot"].exists()


def test_eval_command_end_to_end(tmp_path, corpus_dir, cache_dir):
    for seed in (0, 1):
        config = _config(corpus_dir, steps=2, warmup_steps=1, seed=seed, checkpoint_every=0, eval_every=0)
        train_lm(config, tmp_path / f"bl{seed}", cache_dir=cache_dir, progress=False)
    out = tmp_path / "results"
    runs = sorted(p.relative_to(tmp_path) for p in tmp_path.glob("bl*/**/*"))
    argv = ["lm", "eval", str(tmp_path / "bl0"), str(tmp_path / "bl1"), "--split", "validation", "--out", str(out),
            "--cache-dir", cache_dir, "--device", "cpu"]
    assert cli_main(argv) == 0
    record = json.loads((out / "lm.json").read_text())
    assert record["config"] == {"split": "validation", "seq_len": 32}
    seeds = record["models"]["BL"]["seeds"]
    assert [s["seed"] for s in seeds] == [0, 1]
    for s in seeds:
        g = s["groups"]
        assert g["all"]["n_tokens"] == g["ar_hit"]["n_tokens"] + g["other"]["n_tokens"]
        assert g["ar_hit"]["n_tokens"] == sum(g[b]["n_tokens"] for b in GROUPS[3:])
        assert g["ar_hit"]["n_tokens"] > 0
    assert record["models"]["BL"]["summary"]["all"]["values"] == [s["groups"]["all"]["ppl"] for s in seeds]
    assert (out / "lm.md").read_text().startswith("PPL on packed windows of length 32 of the validation split")
    # a second evaluation reads the per-run cache under --out, which holds the weights' hash; the runs are only read
    cached = json.loads((out / "bl0" / "eval-validation-L32-fp32.json").read_text())
    assert cached["groups"] == seeds[0]["groups"]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.glob("bl*/**/*")) == runs
    # every file of the run and of the evaluation records where it came from, through the one writer
    from bayeslayer.experiments.common.provenance import missing_fields
    from bayeslayer.training.optim import DECAY_POLICY

    for path in [out / "lm.json", *(tmp_path / "bl0").glob("*.json"), *(out / "bl0").glob("*.json")]:
        saved = json.loads(path.read_text())
        assert missing_fields(saved) == [], path
        assert saved["provenance"]["optimizer_groups"] == DECAY_POLICY and saved["provenance"]["device"] == "cpu", path
    assert record["provenance"]["seeds"] == [0, 1]
    summary = json.loads((tmp_path / "bl1" / "train_summary.json").read_text())["provenance"]
    assert summary["seeds"] == [1] and summary["wall_seconds"] > 0


def test_window_schedule_is_a_permutation_per_epoch_and_ranks_split_the_batch():
    sched = WindowSchedule(n_windows=10, batch_size=4, seed=3)
    first_epoch = np.concatenate([sched.step_windows(s) for s in range(2)] + [sched.step_windows(2)[:2]])
    assert sorted(first_epoch) == list(range(10))
    for step in range(6):
        whole = sched.step_windows(step)
        halves = np.concatenate([sched.step_windows(step, r, 2) for r in range(2)])
        assert (whole == halves).all()
        assert (WindowSchedule(10, 4, 3).step_windows(step) == whole).all()  # a pure function of (seed, step)
    assert not (WindowSchedule(10, 4, 4).step_windows(0) == sched.step_windows(0)).all()


def test_presets_follow_the_spec():
    paper = PRESETS["paper"]
    assert (paper.hidden_size, paper.num_layers, paper.num_heads, paper.head_dim) == (512, 4, 4, 128)
    assert paper.seq_len == 2048 and paper.lr == 6e-4 and paper.mlp_dropout == 0.4 and paper.vocab_size == 32000
    assert paper.tokens_per_step == 65536 and paper.steps == 7935  # 520M tokens
    assert "wikitext-103" in paper.source
    for preset in PRESETS.values():
        assert preset.batch_size % preset.micro_batch_size == 0
    from bayeslayer.models import count_parameters

    for mixer in ("bayesian", "gated_deltanet"):  # the paper: about 16-18M non-embedding parameters
        with torch.device("meta"):  # sizes only: no memory, no initialisation work
            n = count_parameters(build_model(replace(paper, mixer=mixer), paper.vocab_size)).non_embedding
        assert 16e6 <= n <= 18e6, (mixer, n)


def test_bad_arguments(tmp_path, corpus_dir, cache_dir):
    with pytest.raises(ValueError, match="mixer must be one of"):
        _config(corpus_dir, mixer="transformer")
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        _config(corpus_dir, batch_size=6, micro_batch_size=4)
    with pytest.raises(ValueError, match="precision"):
        _config(corpus_dir, precision="fp16")
    with pytest.raises(ValueError, match="seq_len"):
        _config(corpus_dir, seq_len=1)
    with pytest.raises(ValueError, match="mlp_dropout"):
        _config(corpus_dir, mlp_dropout=1.0)
    with pytest.raises(ValueError, match="lr must be finite"):
        _config(corpus_dir, lr=float("nan"))
    with pytest.raises(ValueError, match="warmup_steps"):
        _config(corpus_dir, warmup_steps=8)
    with pytest.raises(ValueError, match="unknown LMConfig fields"):
        LMConfig.from_json({"mixer": "bayesian", "width": 3})
    config = _config(corpus_dir)
    with pytest.raises(TypeError, match="LMConfig"):
        train_lm({"mixer": "bayesian"}, tmp_path / "x")
    with pytest.raises(ValueError, match="stop_after"):
        train_lm(config, tmp_path / "x", stop_after=9)
    with pytest.raises(FileNotFoundError, match="python3-doc|not found|no such|does not exist"):
        train_lm(replace(config, source=str(tmp_path / "missing")), tmp_path / "y", cache_dir=cache_dir,
                 progress=False)
    with pytest.raises(FileNotFoundError, match="no finished model"):
        load_run(tmp_path / "nothing")
    model = build_model(config, vocab_size=50)
    windows = np.zeros((2, 8), dtype=np.int64)
    with pytest.raises(ValueError, match="masks\\['all'\\] has shape"):
        grouped_perplexity(model, windows, {"all": np.ones((2, 8), dtype=bool)})
    with pytest.raises(ValueError, match="windows must be"):
        grouped_perplexity(model, windows[:, :1], {"all": np.ones((2, 0), dtype=bool)})
    with pytest.raises(ValueError, match="at least one run"):
        summarize_runs([])
    with pytest.raises(ValueError, match="different splits"):
        summarize_runs([_fake_record("BL", 0, 1.0), _fake_record("BL", 1, 1.0, split="validation")])
    with pytest.raises(ValueError, match="repeated seeds"):
        summarize_runs([_fake_record("BL", 0, 1.0), _fake_record("BL", 0, 2.0)])
    with pytest.raises(ValueError, match="no models"):
        markdown_table({"models": {}})
    with pytest.raises(ValueError, match="--mixer-kwargs must be a JSON object"):
        lm.config_from_args(argparse.Namespace(preset="tiny", mixer_kwargs="[1]"))
    assert cli_main(["lm", "train", "--preset", "tiny", "--mixer-kwargs", "[1]", "--out", str(tmp_path / "z")]) == 2
    assert cli_main(["lm", "train", "--preset", "huge"]) == 2
    assert cli_main(["lm", "eval", "--out", str(tmp_path)]) == 2
