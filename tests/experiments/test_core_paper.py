"""``--core paper``: BL and the reset (Delta) core with per-head learnable scalar noise levels."""

import math

import pytest
import torch
import torch.nn.functional as F

from bayeslayer.cli import main as cli_main
from bayeslayer.design import DELTANET
from bayeslayer.experiments import recall
from bayeslayer.experiments.common.recall_models import PAPER_CORE_KINDS, PAPER_RESET_LAM, build_core_model
from bayeslayer.experiments.common.recall_sweep import models_for_core
from tests.experiments.test_recall import TINY

SIZES = dict(input_dim=9, num_classes=4, address_start=1, address_dim=4, head_dim=4, num_layers=1, width=8,
             num_heads=2)


def _batch():
    return recall.collision_recall_batch(2, n_f=3, rho=0.7, generator=torch.Generator().manual_seed(0),
                                         n_b=2, num_pairs=2, address_dim=4)


@pytest.mark.parametrize("kind", sorted(PAPER_CORE_KINDS.values()))
def test_paper_core_shapes_and_gradients(kind):
    torch.manual_seed(0)
    model = build_core_model(kind, **SIZES)
    batch = _batch()
    logits = model(batch.inputs)
    assert logits.shape == (2, batch.inputs.shape[1], 4) and bool(torch.isfinite(logits).all())
    logits.sum().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    mixer = model.blocks[0].mixer
    assert float(mixer.r2_head.grad.abs().sum()) > 0  # the per-head noise levels are trained


@pytest.mark.parametrize("kind, scalars", [("bayesian_paper", {"r2_head", "ell2_head"}), ("delta_paper", {"r2_head"})])
def test_paper_core_noise_is_one_learnable_scalar_per_head(kind, scalars):
    model = build_core_model(kind, **SIZES)
    mixer = model.blocks[0].mixer
    own = {n: p for n, p in mixer.named_parameters() if not n.startswith(("value.", "out."))}
    assert set(own) == scalars and all(p.shape == (SIZES["num_heads"],) for p in own.values())
    ours = build_core_model(kind.removesuffix("_paper"), **SIZES).blocks[0].mixer
    # ours maps the residual stream (width 8) to a noise level per head and token: 8·H weights + H biases each
    per_token = sum(p.numel() for n, p in ours.named_parameters() if not n.startswith(("value.", "out.")))
    assert per_token == len(scalars) * (SIZES["width"] + 1) * SIZES["num_heads"]
    # the same noise for every token and sequence, whatever the residual stream holds
    noise = mixer._paper_noise(torch.randn(3, 5, SIZES["width"]))
    for v in noise.values():
        assert v.shape == (3, 5, SIZES["num_heads"]) and bool((v == v[:1, :1]).all())


def test_paper_reset_core_is_the_reset_write_with_lambda_fixed_at_0_05():
    torch.manual_seed(0)
    mixer = build_core_model("delta_paper", **SIZES).blocks[0].mixer
    with torch.no_grad():
        mixer.r2_head.copy_(torch.tensor([-2.0, 0.5]))
    h = torch.randn(1, 6, SIZES["width"])
    address = F.normalize(torch.randn(1, 6, 4), dim=-1)
    qk = address.unsqueeze(2).expand(1, 6, 2, 4)
    v = mixer.value(h).view(1, 6, 2, 4)
    r2 = F.softplus(mixer.r2_head) + 1e-4
    eta = (PAPER_RESET_LAM / (r2 + PAPER_RESET_LAM)).expand(1, 6, 2)  # unit keys: η = λ/(r² + λ)
    want = mixer.out(DELTANET.chunk(qk, qk, v, gain=eta, chunk_size=mixer.chunk_size).o.reshape(1, 6, 8))
    torch.testing.assert_close(mixer(h, address), want, rtol=1e-5, atol=1e-6)
    fresh = build_core_model("delta_paper", **SIZES).blocks[0].mixer  # initial gain 0.5 (r² = λ = 0.05)
    assert math.isclose(float(F.softplus(fresh.r2_head.detach()[0])) + 1e-4, PAPER_RESET_LAM, rel_tol=1e-6)


def test_core_option_maps_models_and_refuses_models_without_a_paper_core():
    assert models_for_core(["bayesian", "delta"], "ours") == ("bayesian", "delta")
    assert models_for_core(["bayesian", "delta"], "paper") == ("bayesian_paper", "delta_paper")
    with pytest.raises(ValueError, match="--core paper.*'gla'"):
        models_for_core(["bayesian", "gla"], "paper")
    with pytest.raises(ValueError, match="--core must be one of"):
        models_for_core(["bayesian"], "theirs")


def test_core_paper_on_the_command_line(tmp_path, capsys):
    assert cli_main(["recall", "--core", "theirs", "--preset", "tiny", "--out", str(tmp_path / "a")]) != 0
    assert "--core" in capsys.readouterr().err
    assert cli_main(["recall", "--core", "paper", "--preset", "tiny", "--models", "linear_attention",
                     "--out", str(tmp_path / "b")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--core paper" in err[0]


def test_tiny_recall_run_with_the_paper_cores_records_them():
    record = recall.run(recall.RecallConfig(preset=TINY, models=("bayesian_paper", "delta_paper"), out=None,
                                            progress=False))
    assert list(record["models"]) == ["bayesian_paper", "delta_paper"]
    for kind, res in record["models"].items():
        assert res["model_config"]["kind"] == kind
        acc = res["summary"]["accuracy_vs_n_f"]["mean"]
        assert len(acc) == len(TINY.test_n_f) and all(0.0 <= a <= 1.0 for a in acc)


def test_tiny_crowding_run_with_the_paper_cores(tmp_path):
    from bayeslayer.experiments import crowding
    from tests.experiments.test_crowding import TINY as CROWDING_TINY

    record = crowding.run(crowding.CrowdingConfig(preset=CROWDING_TINY, models=models_for_core(["bayesian", "delta"],
                                                                                               "paper"),
                                                  out=str(tmp_path), progress=False))
    assert list(record["models"]) == ["bayesian_paper", "delta_paper"]
    assert all(len(m["summary"]["cross_entropy_vs_load"]["mean"]) == len(CROWDING_TINY.test_load)
               for m in record["models"].values())
