"""The shared training harness: schedule, learning, exact resume, seeds and results files."""

import json
import math
import os
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn

from bayeslayer.experiments.common.harness import (
    TrainConfig,
    lr_lambda,
    masked_cross_entropy,
    query_accuracy,
    summarize,
    summarize_curves,
    train,
    train_lr_grid,
    train_seeds,
    write_json,
)


class Batch(NamedTuple):
    inputs: torch.Tensor
    labels: torch.Tensor


def sample_copy(step, batch_size, generator):
    """Toy task: the last token's label is the class of the first (one-hot of 4); no loss elsewhere."""
    cls = torch.randint(0, 4, (batch_size,), generator=generator)
    x = torch.randn(batch_size, 3, 4, generator=generator) * 0.1
    x[:, 0] += torch.nn.functional.one_hot(cls, 4).float()
    labels = torch.full((batch_size, 3), -100)
    labels[:, -1] = cls
    return Batch(x, labels)


class Toy(nn.Module):
    """Mixes the sequence by a mean over time; dropout makes the run depend on the torch RNG."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = self.drop(torch.tanh(self.inp(x))).cumsum(1)
        return self.out(h)


def make_model(seed=0):
    torch.manual_seed(seed)
    return Toy()


CFG = TrainConfig(steps=12, batch_size=8, lr=3e-2, warmup_steps=2, eval_every=4, checkpoint_every=3)


def test_schedule_warmup_then_cosine():
    f = lr_lambda(TrainConfig(steps=10, warmup_steps=4, min_lr_ratio=0.1))
    assert [f(t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 6)))
    assert f(10) == pytest.approx(0.1)


def test_training_lowers_the_loss_and_evaluates():
    model = make_model()
    evals = []

    def evaluate(m):
        assert not m.training and not torch.is_grad_enabled()
        b = sample_copy(0, 64, torch.Generator().manual_seed(99))
        evals.append(1)
        return {"acc": query_accuracy(m(b.inputs), b.labels)}

    cfg = TrainConfig(steps=60, batch_size=32, lr=3e-2, warmup_steps=5, eval_every=20)
    res = train(model, sample_copy, cfg, evaluate=evaluate, progress=False)
    assert res.finished and res.step == 60 and len(res.losses) == 60
    assert sum(res.losses[-10:]) / 10 < 0.5 * sum(res.losses[:10]) / 10
    assert [e["step"] for e in res.evals] == [20, 40, 60]
    assert res.evals[-1]["acc"] > 0.9


def test_checkpoint_resume_gives_the_same_trajectory(tmp_path):
    full = train(make_model(), sample_copy, CFG, progress=False)
    ckpt = str(tmp_path / "run.ckpt")
    part = train(make_model(), sample_copy, CFG, checkpoint_path=ckpt, stop_after=7, progress=False)
    assert part.step == 7 and not part.finished and os.path.exists(ckpt)
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp")] == []  # atomic: no temp files left
    # a fresh process would rebuild the model with another init; the checkpoint must override it
    resumed_model = make_model(seed=123)
    torch.manual_seed(555)  # and scramble the global RNG: it must be restored from the checkpoint
    resumed = train(resumed_model, sample_copy, CFG, checkpoint_path=ckpt, progress=False)
    assert resumed.finished and resumed.step == CFG.steps
    assert resumed.losses == full.losses
    ref = make_model()
    train(ref, sample_copy, CFG, progress=False)
    for a, b in zip(ref.state_dict().values(), resumed_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_resume_refuses_a_different_config(tmp_path):
    ckpt = str(tmp_path / "run.ckpt")
    train(make_model(), sample_copy, CFG, checkpoint_path=ckpt, stop_after=3, progress=False)
    other = TrainConfig(**{**CFG.__dict__, "lr": 1e-3})
    with pytest.raises(ValueError, match="config"):
        train(make_model(), sample_copy, other, checkpoint_path=ckpt, progress=False)


def test_train_seeds_caches_finished_seeds(tmp_path):
    built = []

    def build(seed):
        built.append(seed)
        return Toy()

    def final(m):
        return {"curve": [1.0, float(len(built))]}

    cfg = TrainConfig(steps=5, batch_size=4, lr=1e-2)
    recs = train_seeds("toy", build, sample_copy, cfg, [0, 1], final, run_dir=str(tmp_path), progress=False,
                       fingerprint={"task": "copy"})
    assert [r["seed"] for r in recs] == [0, 1] and built == [0, 1]
    assert recs[0]["loss_curve"]["step"][-1] == 5 and len(recs[0]["loss_curve"]["loss"]) == 5
    assert not any(p.endswith(".ckpt") for p in os.listdir(tmp_path))  # checkpoints removed when done
    again = train_seeds("toy", build, sample_copy, cfg, [0, 1], final, run_dir=str(tmp_path), progress=False,
                        fingerprint={"task": "copy"})
    assert built == [0, 1] and again == recs  # nothing retrained
    train_seeds("toy", build, sample_copy, cfg, [0], final, run_dir=str(tmp_path), progress=False,
                fingerprint={"task": "other"})
    assert built == [0, 1, 0]  # a different task setting is not reused


def test_summaries_and_json(tmp_path):
    s = summarize([1.0, 2.0, 3.0])
    assert s["mean"] == 2.0 and s["std"] == pytest.approx(1.0) and s["values"] == [1.0, 2.0, 3.0]
    assert summarize([4.0])["std"] == 0.0
    c = summarize_curves([[0.0, 1.0], [2.0, 3.0]])
    assert c["mean"] == [1.0, 2.0] and c["std"] == pytest.approx([math.sqrt(2)] * 2)
    path = tmp_path / "sub" / "r.json"
    write_json(str(path), {"a": (1, 2), "t": torch.tensor([0.5])})
    assert json.loads(path.read_text()) == {"a": [1, 2], "t": [0.5]}


def test_masked_metrics():
    logits = torch.tensor([[[0.0, 5.0], [5.0, 0.0], [0.0, 5.0]]])
    labels = torch.tensor([[1, -100, 0]])
    assert query_accuracy(logits, labels) == 0.5
    expected = (torch.log1p(torch.exp(torch.tensor(-5.0))) + torch.log1p(torch.exp(torch.tensor(5.0)))) / 2
    assert float(masked_cross_entropy(logits, labels)) == pytest.approx(float(expected))
    with pytest.raises(ValueError, match="no token"):
        query_accuracy(logits, torch.full((1, 3), -100))
    with pytest.raises(ValueError, match="disagree"):
        masked_cross_entropy(logits, labels[:, :2])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(steps=0), "steps"),
        (dict(batch_size=-1), "batch_size"),
        (dict(lr=0.0), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(grad_clip=0.0), "grad_clip"),
        (dict(steps=10, warmup_steps=10), "warmup_steps"),
        (dict(min_lr_ratio=2.0), "min_lr_ratio"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_bad_train_arguments():
    with pytest.raises(TypeError, match="model"):
        train(lambda x: x, sample_copy, CFG, progress=False)
    with pytest.raises(TypeError, match="sample_batch"):
        train(Toy(), None, CFG, progress=False)
    with pytest.raises(TypeError, match="TrainConfig"):
        train(Toy(), sample_copy, {"steps": 3}, progress=False)
    with pytest.raises(ValueError, match="stop_after"):
        train(Toy(), sample_copy, CFG, stop_after=CFG.steps + 1, progress=False)
    with pytest.raises(ValueError, match="seeds"):
        train_seeds("x", lambda s: Toy(), sample_copy, CFG, [], lambda m: {})


def test_lr_grid_selects_by_the_validation_metric_and_skips_diverged_rates(tmp_path):
    def val_accuracy(m):
        b = sample_copy(0, 128, torch.Generator().manual_seed(7))  # held-out batch: not a training step
        return {"val_acc": query_accuracy(m(b.inputs), b.labels)}

    cfg = TrainConfig(steps=40, batch_size=16, lr=1.0, warmup_steps=2)
    out = train_lr_grid("toy", lambda s: make_model(s), sample_copy, cfg, [1e-5, 3e-2], [0], val_accuracy,
                        select_key="val_acc", run_dir=str(tmp_path), progress=False)
    scores = {g["lr"]: g["score"] for g in out["grid"]}
    assert scores[3e-2] > scores[1e-5]  # a tiny lr learns nothing in 40 steps
    assert out["best_lr"] == 3e-2 and out["records"] == out["all_records"][3e-2]
    assert out["records"][0]["val_acc"] == scores[3e-2]
    assert {"toy_lr1e-05_seed0.json", "toy_lr0.03_seed0.json"} <= set(os.listdir(tmp_path))

    def sample_nan(step, bs, g):  # a batch whose loss is not finite: training "diverges" at every lr
        b = sample_copy(step, bs, g)
        return Batch(b.inputs * float("nan"), b.labels)

    with pytest.raises(FloatingPointError, match="every learning rate"):
        train_lr_grid("bad", make_model, sample_nan, cfg, [1e-3, 1e-2], [0], val_accuracy,
                      select_key="val_acc", progress=False)


class CheckedToy(Toy):
    """Toy whose logits go through the ops' finiteness check (as a mixer's inputs do), scaled so that a huge
    lr overflows them after an update while the weights stay finite."""

    def forward(self, x):
        from bayeslayer.ops.utils.validation import check_tensor

        return check_tensor("hidden_states", super().forward(x) * 1e28)


def test_lr_grid_scores_an_lr_that_overflows_a_layer_nan_and_goes_on():
    """A diverged lr met by a layer's input check (not by the loss) is scored NaN too; the grid continues."""
    def accuracy(m):
        b = sample_copy(0, 64, torch.Generator().manual_seed(7))
        return {"acc": query_accuracy(m(b.inputs), b.labels)}

    def build(seed):
        torch.manual_seed(seed)
        return CheckedToy()

    cfg = TrainConfig(steps=6, batch_size=8, lr=1.0, warmup_steps=0)
    out = train_lr_grid("grid", build, sample_copy, cfg, [1e12, 1e-3], [0], accuracy, select_key="acc",
                        progress=False)
    first, second = out["grid"]
    assert math.isnan(first["score"]) and "training diverged" in first["diverged"]
    assert math.isfinite(second["score"]) and out["best_lr"] == 1e-3


def test_lr_grid_bad_arguments():
    cfg = TrainConfig(steps=2, batch_size=4)
    ev = lambda m: {"acc": 1.0}  # noqa: E731
    with pytest.raises(ValueError, match="lrs"):
        train_lr_grid("x", lambda s: Toy(), sample_copy, cfg, [], [0], ev, select_key="acc", progress=False)
    with pytest.raises(ValueError, match="lrs"):
        train_lr_grid("x", lambda s: Toy(), sample_copy, cfg, [1e-3, -1.0], [0], ev, select_key="acc",
                      progress=False)
    with pytest.raises(ValueError, match="repeated"):
        train_lr_grid("x", lambda s: Toy(), sample_copy, cfg, [1e-3, 1e-3], [0], ev, select_key="acc",
                      progress=False)
    with pytest.raises(KeyError, match="nope"):
        train_lr_grid("x", lambda s: Toy(), sample_copy, cfg, [1e-3], [0], ev, select_key="nope", progress=False)

def test_train_seeds_does_not_resume_a_checkpoint_of_other_settings(tmp_path):
    def final(m):
        return {}

    cfg = TrainConfig(steps=6, batch_size=4, lr=1e-2)
    fresh = train_seeds("toy", lambda s: make_model(s), sample_copy, cfg, [0], final, progress=False)
    # an interrupted run of task "a" leaves a checkpoint (and its stamp) behind
    ckpt = tmp_path / "toy_seed0.ckpt"
    train_seeds("toy", lambda s: make_model(s), sample_copy, cfg, [0], final, run_dir=str(tmp_path),
                progress=False, fingerprint={"task": "a"})  # finishes: nothing left
    assert not ckpt.exists()
    train(make_model(seed=5), sample_copy, TrainConfig(**{**cfg.__dict__, "seed": 0}), checkpoint_path=str(ckpt),
          stop_after=3, progress=False, identity={"fingerprint": {"task": "a"}})
    os.remove(tmp_path / "toy_seed0.json")
    # task "b" with the same TrainConfig must start from scratch, not from task "a"'s step 3
    with pytest.warns(RuntimeWarning, match="task/model settings.*from scratch"):
        other = train_seeds("toy", lambda s: make_model(s), sample_copy, cfg, [0], final, run_dir=str(tmp_path),
                            progress=False, fingerprint={"task": "b"})
    assert other[0]["loss_curve"] == fresh[0]["loss_curve"]


def test_a_checkpoint_or_cached_seed_of_another_checkpoint_interval_is_used(tmp_path, capsys):
    """When checkpoints are written changes nothing a run computes: a run resumes a checkpoint written at
    another interval, reuses a seed cached with one, and records the trained weights' SHA-256."""
    def final(m):
        return {}

    full = train_seeds("toy", make_model, sample_copy, CFG, [0], final, progress=False)
    ckpt = str(tmp_path / "toy_seed0.ckpt")
    train(make_model(), sample_copy, CFG, checkpoint_path=ckpt, stop_after=6, progress=False,
          identity={"fingerprint": None})
    other = TrainConfig(**{**CFG.__dict__, "checkpoint_every": 5})
    built = []

    def build(seed):
        built.append(seed)
        return make_model(seed)

    resumed = train_seeds("toy", build, sample_copy, other, [0], final, run_dir=str(tmp_path), progress=False)
    assert f"resuming from step 6 ({ckpt}" in capsys.readouterr().err
    assert resumed[0]["weights_sha256"] == full[0]["weights_sha256"] and len(full[0]["weights_sha256"]) == 64
    assert resumed[0]["loss_curve"] == full[0]["loss_curve"] and resumed[0]["evals"] == full[0]["evals"]
    again = train_seeds("toy", build, sample_copy, CFG, [0], final, run_dir=str(tmp_path), progress=False)
    assert built == [0] and again == resumed  # cached with checkpoint_every=5, reused with 3
