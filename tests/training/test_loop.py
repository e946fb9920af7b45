"""The one loop itself: gradient accumulation, the checkpoint formats it reads, its input checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bayeslayer.errors import NonFiniteError
from bayeslayer.training import CheckpointStore
from bayeslayer.training.loop import Checkpoints, TrainConfig, raise_if_diverged, train_loop

CFG = TrainConfig(steps=5, batch_size=8, lr=1e-2, weight_decay=0.1, warmup_steps=1, checkpoint_every=2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.LayerNorm(8), nn.Linear(8, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def _loss(module, batch):
    x, y = batch
    return F.cross_entropy(module(x), y)


def _split(k: int):
    def micro_batches(step: int):
        x, y = _batch(step)
        return [(x[i::k], y[i::k]) for i in range(k)]

    return micro_batches


def test_accumulated_micro_batches_make_the_update_of_the_whole_batch():
    """Mean loss over equal micro-batches, each divided by their number: the gradient of the whole batch."""
    models, states = [], []
    for k in (1, 2, 4):
        model = _model()
        model[1].p = 0.0  # dropout draws differ with the micro-batch shapes; without it the maths must agree
        states.append(train_loop(model, _split(k), _loss, CFG, progress=False))
        models.append(model)
    for model, state in zip(models[1:], states[1:], strict=True):
        torch.testing.assert_close(state.losses, states[0].losses, rtol=1e-6, atol=1e-7)
        for a, b in zip(model.parameters(), models[0].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _Plain(Checkpoints):
    def __init__(self, store, model, *, single_rng_dict: bool = False) -> None:
        super().__init__(store)
        self.model, self.single_rng_dict = model, single_rng_dict

    def write_weights(self, directory: Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, str(directory / "w.safetensors"))

    def read_weights(self, directory: Path) -> None:
        from safetensors.torch import load_file

        self.model.load_state_dict(load_file(str(directory / "w.safetensors")))

    def save(self, step, trainer_state):
        if self.single_rng_dict:  # what the harness wrote before the loops were one: one RNG dict, no list
            trainer_state = {**trainer_state, "rng": trainer_state["rng"][0]}
        return super().save(step, trainer_state)


@pytest.mark.parametrize("old_format", [False, True])
def test_a_stopped_run_resumes_to_the_uninterrupted_one(tmp_path, old_format, capsys):
    ref = _model()
    ref_state = train_loop(ref, _split(2), _loss, CFG, progress=False)
    model = _model()
    part = train_loop(model, _split(2), _loss, CFG, progress=False, stop_after=3,
                      checkpoints=_Plain(CheckpointStore(tmp_path), model, single_rng_dict=old_format))
    assert part.step == 3 and not part.finished and part.saved_step == 3
    torch.manual_seed(123)  # the resumed run must not depend on the RNG state it starts in
    model = _model()
    done = train_loop(model, _split(2), _loss, CFG, progress=False, desc="probe",
                      checkpoints=_Plain(CheckpointStore(tmp_path), model))
    assert "probe: resuming from step 3" in capsys.readouterr().err
    assert done.resumed_from == 3 and done.finished and done.losses == ref_state.losses
    for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_evaluation_hook_runs_every_eval_every_steps_and_once_at_the_end():
    cfg = TrainConfig(steps=5, batch_size=8, lr=1e-2, eval_every=2)
    state = train_loop(_model(), _split(1), _loss, cfg, progress=False,
                       evaluate=lambda s, final: {"step": s.step, "final": final})
    assert state.evals == [{"step": 2, "final": False}, {"step": 4, "final": False}, {"step": 5, "final": True}]


def test_bad_arguments_are_named():
    model = _model()
    with pytest.raises(TypeError, match="trainee"):
        train_loop("model", _split(1), _loss, CFG)
    with pytest.raises(TypeError, match="config"):
        train_loop(model, _split(1), _loss, {"steps": 3})
    with pytest.raises(ValueError, match="stop_after"):
        train_loop(model, _split(1), _loss, CFG, stop_after=CFG.steps + 1)
    with pytest.raises(ValueError, match="no micro-batch"):
        train_loop(model, lambda step: [], _loss, CFG, progress=False)
    with pytest.raises(FloatingPointError, match="loss became nan at step 0"):
        train_loop(model, _split(1), lambda m, b: _loss(m, b) * float("nan"), CFG, progress=False)
    frozen = _model().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter to train"):
        train_loop(frozen, _split(1), _loss, CFG)


class _Checked(nn.Module):
    """A linear layer whose scaled output goes through the ops' finiteness check, as every mixer's input does."""

    def __init__(self, scale: float = 1e30):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.scale = nn.Linear(4, 3), scale

    def forward(self, x):
        from bayeslayer.ops.utils.validation import check_tensor

        return check_tensor("hidden_states", self.lin(x) * self.scale)


def test_a_diverged_update_is_named_with_its_step():
    """lr 1e10 makes the weights huge within a few updates; then the layer's output overflows and its input
    check raises.  The loop reports that as training diverging, at that step, not as a bad input."""
    cfg = TrainConfig(steps=4, batch_size=8, lr=1e10, warmup_steps=0)
    with pytest.raises(FloatingPointError, match=r"training diverged: .* at step [1-3] \(hidden_states contains NaN"):
        train_loop(_Checked(), _split(1), _loss, cfg, progress=False)
    # the same failure before any update is the input's fault: it stays the layer's ValueError
    with pytest.raises(ValueError, match="hidden_states contains NaN or Inf") as info:
        train_loop(_Checked(scale=1e40), _split(1), _loss, cfg, progress=False)
    assert not isinstance(info.value, FloatingPointError)
    # after step 0, NaN weights are divergence whatever error meets them; before it, nothing diverged yet
    nan = [torch.tensor([1.0, float("nan")])]
    with pytest.raises(FloatingPointError, match="run: training diverged: .* at step 3 \\(a kernel failed\\)"):
        raise_if_diverged(RuntimeError("a kernel failed"), nan, desc="run", step=3)
    assert raise_if_diverged(RuntimeError("a kernel failed"), nan, desc="run", step=0) is None
    assert raise_if_diverged(NonFiniteError("x"), [torch.ones(2)], desc="run", step=0) is None
