"""``bayeslayer distill``: the retrofit end to end on CPU, stage resume, and bad input.

The end-to-end test trains a tiny Gated DeltaNet teacher with ``bayeslayer lm train`` on a
seeded word corpus the test writes (never on what happens to be installed: Debian's python3-doc
changed the trained tokenizer and so the NIAH prompt lengths, which is how a machine with it
installed by hand hid a failure on a fresh one), distills a student with one of its two layers
swapped through Phase A and Phase B, runs the GDN-FT control for the same tokens, and evaluates
all three on NIAH at a short length and on held-out perplexity, checking the JSON and the plots.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bayeslayer.cli import main as cli_main
from bayeslayer.data import niah
from bayeslayer.evaluation.lengths import length_label
from bayeslayer.experiments import distill
from bayeslayer.experiments.common.lm_run import train_lm
from bayeslayer.experiments.distill import PRESETS, DistillConfig, run_distill, stage_objective
from bayeslayer.models import BayesLayerConfig
from bayeslayer.training.distillation import load_teacher
from bayeslayer.training.lm_config import LMConfig

from .corpus import write_word_corpus

NIAH_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_2")
NIAH_DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)
NIAH_NEW_TOKENS = 8


def _corpus(root: Path) -> Path:
    """A seeded written corpus: the same bytes, tokenizer and token counts on every machine."""
    root.mkdir(parents=True, exist_ok=True)
    return write_word_corpus(root, {"train": 80, "validation": 10, "test": 10}, sentences=30)


def _niah_length(generator: niah.NiahGenerator) -> int:
    """The shortest multiple of 64 at which every test task and depth fits, read off the tokenization.

    The instruction, question and needles take a number of tokens that depends on the trained
    tokenizer; a fixed length broke the test when the corpus (and so the tokenizer) changed.
    """
    for length in range(128, 4097, 64):
        try:
            for task in NIAH_TASKS:
                for depth in NIAH_DEPTHS:
                    generator.sample(task, length, depth, max_new_tokens=NIAH_NEW_TOKENS)
        except ValueError as err:
            if "too short" not in str(err):
                raise
            continue
        return length
    raise AssertionError("no NIAH length up to 4096 fits the test tasks")


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["event"] == "train"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> tuple[Path, Path, str]:
    """A 2-layer GDN language model trained briefly, saved in Hugging Face format with its tokenizer."""
    root = tmp_path_factory.mktemp("distill")
    corpus = _corpus(root / "corpus")
    cache = str(root / "cache")
    config = LMConfig(preset="test", mixer="gated_deltanet", hidden_size=64, num_layers=2, num_heads=2, head_dim=16,
                      mlp_dropout=0.0, source=str(corpus), vocab_size=512, seq_len=128, steps=20, batch_size=8,
                      micro_batch_size=8, lr=3e-3, warmup_steps=2, eval_every=0, eval_windows=2, checkpoint_every=0,
                      log_every=1, seed=0)
    result = train_lm(config, root / "teacher", device="cpu", cache_dir=cache, progress=False)
    assert result.finished
    final = root / "teacher" / "final"
    assert (final / "tokenizer.json").is_file() and (final / "config.json").is_file()
    return final, corpus, cache


def _config(teacher_dir: Path, corpus: Path, **overrides) -> DistillConfig:
    base = dict(preset="test", teacher=str(teacher_dir), layers=(1,), source=str(corpus), seq_len=128,
                batch_size=4, micro_batch_size=2, phase_a_steps=8, phase_b_steps=8, lr_a=3e-3, lr_b=1e-3,
                warmup_steps=1, mlp_parts=("down_proj",), eval_every=0, eval_windows=2, checkpoint_every=4,
                log_every=1, seed=0)
    base.update(overrides)
    return DistillConfig(**base)


def test_retrofit_end_to_end(teacher, tmp_path):
    teacher_dir, corpus, cache = teacher
    out = tmp_path / "retrofit"
    report = run_distill(_config(teacher_dir, corpus), out, device="cpu", cache_dir=cache, progress=False)
    assert set(report["stages"]) == {"phase_a", "phase_b", "gdn_ft"}

    # losses finite and falling: the distillation losses over the run (mean of the last three steps
    # below the first three); GDN-FT's batch CE is too noisy for that at 16 steps, so its validation
    # PPL (all windows) must beat the teacher's on the same windows
    for stage in ("phase_a", "phase_b", "gdn_ft"):
        losses = _losses(out / stage)
        assert len(losses) == (16 if stage == "gdn_ft" else 8)
        assert all(math.isfinite(x) for x in losses)
        if stage != "gdn_ft":
            assert np.mean(losses[-3:]) < np.mean(losses[:3]), (stage, losses)
        summary = report["stages"][stage]
        assert summary["frozen_unchanged"] and summary["trainable_changed"] > 0
    teacher_summary = json.loads((teacher_dir.parent / "train_summary.json").read_text())
    assert report["stages"]["gdn_ft"]["validation"]["all"]["ppl"] < teacher_summary["validation"]["all"]["ppl"]

    # independently of the objective's own check: frozen tensors bit-equal the teacher's, trainable ones moved
    t = load_file(str(teacher_dir / "model.safetensors"))
    for stage in ("phase_a", "phase_b", "gdn_ft"):
        s = load_file(str(out / stage / "final" / "model.safetensors"))
        trainable = ("model.layers.1.attn.",) + (("model.layers.1.mlp.down_proj.",) if stage != "phase_a" else ())
        moved = []
        for name, value in s.items():
            if name.startswith(trainable):
                if name not in t or not torch.equal(value, t[name]):
                    moved.append(name)
            else:
                assert torch.equal(value, t[name]), f"{stage}: frozen {name} changed"
        assert "model.layers.1.attn.q_proj.weight" in moved and "model.layers.1.attn.o_proj.weight" in moved
        assert ("model.layers.1.mlp.down_proj.weight" in moved) == (stage != "phase_a")
        mixers = BayesLayerConfig.from_pretrained(out / stage / "final").layer_mixers
        assert mixers == ["gated_deltanet", "gated_deltanet" if stage == "gdn_ft" else "bayesian"]
        # every stage's model folder is written for generation on the cache
        assert json.loads((out / stage / "final" / "config.json").read_text())["use_cache"] is True
    # the trainable set: no MLP in Phase A (its loss never reaches them), down_proj in Phase B and GDN-FT
    assert report["stages"]["phase_a"]["trainable_elements"]["mlp"] == 0
    assert report["stages"]["phase_b"]["trainable_elements"]["mlp"] > 0
    assert report["stages"]["gdn_ft"]["tokens"] == report["stages"]["phase_a"]["tokens"] \
        + report["stages"]["phase_b"]["tokens"]

    # NIAH at a short length + held-out PPL, through the CLI
    gen = niah.NiahGenerator(str(teacher_dir), niah.load_essays(str(corpus), "test"), seed=3)
    length = _niah_length(gen)
    assert cli_main(["distill", "eval", "--out", str(out), "--niah-lengths", str(length), "--niah-depths", "0,100",
                     "--niah-tasks", ",".join(NIAH_TASKS), "--samples-per-cell", "1",
                     "--max-new-tokens", str(NIAH_NEW_TOKENS), "--haystack", str(corpus), "--ppl-lengths", "64,128",
                     "--split", "test", "--max-windows", "4", "--device", "cpu", "--cache-dir", cache,
                     "--quiet"]) == 0
    results = json.loads((out / "eval" / "niah" / "niah.json").read_text())
    assert list(results["models"]) == ["GDN-zero", "GDN-FT", "BL"]
    for m in results["models"].values():
        assert len(m["cells"]) == 3 * 2 and set(m["summary"]) == {length_label(length)}
        assert all(0 <= c["score"] <= 100 for c in m["cells"])
    for png in ("niah_length.png", "niah_diff_BL_minus_GDN-zero.png", "niah_diff_BL_minus_GDN-FT.png"):
        assert (out / "eval" / "niah" / png).stat().st_size > 1000
    heldout = json.loads((out / "eval" / "heldout" / "heldout.json").read_text())
    text = json.dumps(heldout)
    for label in ("GDN-zero", "GDN-FT", "BL"):
        assert label in text
    assert (out / "eval" / "heldout" / "heldout.md").read_text().count("|") > 10
    assert (out / "eval" / "heldout" / "heldout.png").stat().st_size > 1000

    # the NIAH generator with the teacher's tokenizer: exact length; the needle at the requested depth to
    # within one haystack unit (the noise paragraph on its own line, RULER's repeat haystack). Its token
    # count comes from the tokenizer, so the depth check runs at a length with room for >= 32 of them.
    unit = len(gen.tokenizer.encode("\n" + niah.NOISE_PARAGRAPH))
    depth_length = -(-(length + 32 * unit) // 64) * 64
    for check_length in (length, depth_length):
        for depth in NIAH_DEPTHS:
            for task in NIAH_TASKS:
                sample = gen.sample(task, check_length, depth, max_new_tokens=NIAH_NEW_TOKENS)
                assert len(sample.input_ids) == check_length - NIAH_NEW_TOKENS
                start, end = sample.context_span
                assert start <= sample.needle_start < end
                if task == "niah_single_1" and check_length == depth_length:
                    needle = len(gen.tokenizer.encode("\n" + niah.NEEDLE.format(
                        vtype="numbers", key=sample.queries[0], value=sample.answers[0])))
                    haystack = end - start - needle
                    assert haystack >= 32 * unit
                    located = 100.0 * (sample.needle_start - start) / haystack
                    assert abs(located - depth) <= 100.0 * unit / haystack, (depth, located)
                    assert sample.depth_realized == pytest.approx(located)


def test_a_stopped_stage_resumes_to_the_same_weights(teacher, tmp_path):
    teacher_dir, corpus, cache = teacher
    config = _config(teacher_dir, corpus, phase_a_steps=6)
    straight = run_distill(config, tmp_path / "a", stages=("phase_a",), device="cpu", cache_dir=cache,
                           progress=False)
    stopped = run_distill(config, tmp_path / "b", stages=("phase_a",), device="cpu", cache_dir=cache,
                          progress=False, stop_after=4)
    assert stopped["stages"]["phase_a"] == {"stopped_at": 4, "steps": 6}
    resumed = run_distill(config, tmp_path / "b", stages=("phase_a",), device="cpu", cache_dir=cache,
                          progress=False)
    assert resumed["stages"]["phase_a"]["weights_sha256"] == straight["stages"]["phase_a"]["weights_sha256"]
    assert _losses(tmp_path / "a" / "phase_a") == _losses(tmp_path / "b" / "phase_a")
    # phase_b refuses to start without Phase A's model; another objective in the same directory is refused
    with pytest.raises(FileNotFoundError, match="phase_a"):
        run_distill(config, tmp_path / "c", stages=("phase_b",), device="cpu", cache_dir=cache, progress=False)
    lm_config = distill.stage_config(config, "phase_a", load_teacher(teacher_dir).config,
                                     str(teacher_dir / "tokenizer.json"))
    with pytest.raises(ValueError, match="another objective"):
        train_lm(lm_config, tmp_path / "b" / "phase_a", device="cpu", cache_dir=cache, progress=False,
                 objective=stage_objective(config, "gdn_ft", teacher_dir))


def test_presets_and_bad_config():
    paper = PRESETS["paper"]
    assert paper.layers == (5, 11, 17, 23) and paper.seq_len == 2048
    assert 95e6 <= paper.tokens["phase_a"] <= 105e6 and 295e6 <= paper.tokens["phase_b"] <= 305e6
    assert paper.tokens["gdn_ft"] == paper.tokens["phase_a"] + paper.tokens["phase_b"]
    assert paper.switch_step == paper.phase_b_steps // 2
    for kwargs, match in ((dict(layers=()), "layers"), (dict(layers=(1, 1)), "layers"),
                          (dict(mlp_parts=("attn",)), "mlp_parts"), (dict(lr_a=0.0), "lr_a"),
                          (dict(lr_b=float("nan")), "lr_b"), (dict(switch_fraction=1.5), "switch_fraction"),
                          (dict(batch_size=5, micro_batch_size=2), "multiple"), (dict(seq_len=1), "seq_len"),
                          (dict(precision="fp16"), "precision"), (dict(phase_a_steps=0), "phase_a_steps")):
        with pytest.raises(ValueError, match=match):
            DistillConfig(teacher="x", **kwargs)
    with pytest.raises(ValueError, match="teacher"):
        run_distill(DistillConfig(teacher=""), "unused")
    with pytest.raises(ValueError, match="stages"):
        run_distill(DistillConfig(teacher="x"), "unused", stages=("phase_c",))
    with pytest.raises(ValueError, match="unknown DistillConfig"):
        DistillConfig.from_json({"teacher": "x", "bogus": 1})
    assert DistillConfig.from_json(paper.to_json()) == paper


def test_bad_teacher_and_tokenizer(teacher, tmp_path):
    teacher_dir, corpus, cache = teacher
    with pytest.raises(FileNotFoundError, match="checkpoint directory"):
        run_distill(_config(tmp_path / "missing", corpus), tmp_path / "o", device="cpu", cache_dir=cache)
    no_tok = tmp_path / "no_tok"
    shutil.copytree(teacher_dir, no_tok)
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json is missing"):  # the folder's manifest lists it
        run_distill(_config(no_tok, corpus), tmp_path / "o", device="cpu", cache_dir=cache)
    (no_tok / "manifest.json").unlink()  # its config.json still says the folder had one
    with pytest.raises(ValueError, match="manifest.json is missing"):
        run_distill(_config(no_tok, corpus), tmp_path / "o", device="cpu", cache_dir=cache)
    config = json.loads((no_tok / "config.json").read_text())
    del config["bayeslayer_manifest"]  # now a folder from elsewhere (or an older version), without a tokenizer
    (no_tok / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        run_distill(_config(no_tok, corpus), tmp_path / "o", device="cpu", cache_dir=cache)
    with pytest.raises(ValueError, match="out of range"):
        run_distill(_config(teacher_dir, corpus, layers=(5,)), tmp_path / "o2", device="cpu", cache_dir=cache,
                    progress=False)
    with pytest.raises(FileNotFoundError, match="distill train"):
        distill.eval_models(tmp_path / "nothing")


@pytest.mark.slow  # a two-rank spawn; the LM's two-rank run stays in the default suite
@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_torchrun_two_ranks_agree_and_match_one_process(teacher, tmp_path, shard):
    """`torchrun --nproc_per_node 2 -m bayeslayer.cli distill train [--shard fsdp]` (gloo, CPU): every stage ends
    with the same weights on both ranks (sharded: gathered once) and equals one process with the same global
    batch; with --shard fsdp, Phase B and GDN-FT shard the student and the teacher and Phase A runs DDP."""
    teacher_dir, corpus, cache = teacher
    config = _config(teacher_dir, corpus, phase_a_steps=3, phase_b_steps=2, batch_size=4, micro_batch_size=1,
                     checkpoint_every=2)
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "bayeslayer.cli", "distill", "train", "--preset", "tiny", "--no-progress", "--out", str(out),
           "--cache-dir", cache, "--device", "cpu", "--teacher", str(teacher_dir), "--layers", "1",
           "--mlp-parts", "down_proj", "--source", str(corpus), "--shard", shard]
    for name in ("seq_len", "batch_size", "micro_batch_size", "phase_a_steps", "phase_b_steps", "lr_a", "lr_b",
                 "warmup_steps", "eval_every", "eval_windows", "checkpoint_every", "log_every", "seed"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(config, name))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    single = run_distill(replace(config, preset="tiny"), tmp_path / "single", device="cpu", cache_dir=cache,
                         progress=False)
    for stage in ("phase_a", "phase_b", "gdn_ft"):
        summary = json.loads((out / stage / "train_summary.json").read_text())
        assert summary["world_size"] == 2 and len(set(summary["rank_weights_sha256"])) == 1
        assert summary["frozen_unchanged"]
        assert summary["shard"] == ("none" if stage == "phase_a" else shard)
        np.testing.assert_allclose(_losses(out / stage), _losses(tmp_path / "single" / stage), rtol=1e-4)
        a = load_file(str(out / stage / "final" / "model.safetensors"))
        b = load_file(str(tmp_path / "single" / stage / "final" / "model.safetensors"))
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
    assert single["stages"]["gdn_ft"]["steps"] == 5
