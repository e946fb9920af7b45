"""MQAR model layouts: the hybrid layout is Zoology's block, the gate and conv options reach the layers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bayeslayer.cli import build_parser
from bayeslayer.cli import main as cli_main
from bayeslayer.experiments.common.plotting import load_json
from bayeslayer.experiments.mqar import (
    PRESETS,
    BaseConv,
    MQARModel,
    MQARModelConfig,
    build_model,
    gate_kwargs,
    known_mixers,
    model_config,
    preset_from_args,
    results_stem,
    train_config,
)
from bayeslayer.layers import BayesianLayer, DeltaNet, GatedDeltaNet, Mamba2

TINY = PRESETS["tiny"]
HYBRID = replace(TINY, layout="hybrid")


@pytest.mark.parametrize("mixer, layer", [("bayesian", BayesianLayer), ("gated_deltanet_noconv", GatedDeltaNet),
                                          ("deltanet", DeltaNet), ("mamba2", Mamba2)])
@pytest.mark.parametrize("num_layers", [2, 4])
def test_hybrid_builds_zoologys_blocks_in_zoologys_order(mixer, layer, num_layers):
    """Zoology's ``Hybrid`` takes ``configs[layer_idx % 2]`` of ``[BaseConv(kernel 3), mixer]``; every block is a
    ``TransformerBlock``: LayerNorm → sequence mixer, LayerNorm → state mixer (``Identity`` in MQAR)."""
    model = build_model(mixer, replace(HYBRID, num_layers=num_layers), 16)
    kinds = [type(m) for m in model.sequence_mixers]
    assert kinds == [BaseConv, layer] * (num_layers // 2)
    assert [type(m) for m in model.recurrent_mixers()] == [layer] * (num_layers // 2)
    assert [m.layer_idx for m in model.recurrent_mixers()] == list(range(1, num_layers, 2))
    assert all(type(n) is nn.LayerNorm for n in list(model.norms1) + list(model.norms2))
    assert all(type(s) is nn.Identity for s in model.state_mixers)
    assert len(model.norms1) == len(model.norms2) == len(model.state_mixers) == num_layers
    conv = model.sequence_mixers[0]
    assert conv.conv.kernel_size == (3,) and conv.conv.groups == 16 and conv.conv.bias is not None
    assert conv.conv.activation is None
    assert conv.projection.weight.shape == (16, 16) and conv.projection.bias is not None
    assert not hasattr(model, "mixers")  # the stacked layout's modules are not built
    # the stacked layout is today's model: num_layers identical mixer blocks, no conv block
    stacked = build_model(mixer, replace(TINY, num_layers=num_layers), 16)
    assert [type(m) for m in stacked.mixers] == [layer] * num_layers
    assert not any(isinstance(m, BaseConv) for m in stacked.modules())


def test_hybrid_forward_is_zoologys_fused_residual_flow():
    """Zoology's ``TransformerBlock``/``LMBackbone`` carry ``(hidden, residual)`` and add the state mixer's
    output at the next block; written out that way here, it must equal the model's ``h + s(LN h)``,
    ``h + F(LN h)`` form (with ``F`` the identity: ``LN(h)`` enters the stream)."""
    torch.manual_seed(0)
    model = build_model("gated_deltanet_noconv", replace(HYBRID, num_layers=4), 16).eval()
    x = torch.randint(0, TINY.vocab_size, (2, 13))
    hidden, residual = model.embed(x), None
    for seq, n1, n2, state in zip(model.sequence_mixers, model.norms1, model.norms2, model.state_mixers,
                                  strict=True):
        residual = hidden + residual if residual is not None else hidden
        y = seq(n1(residual))
        hidden = y if isinstance(seq, BaseConv) else y.o
        residual = hidden + residual
        hidden = state(n2(residual))
    expected = model.head(model.norm(hidden + residual))
    torch.testing.assert_close(model(x), expected)
    # and the identity state mixer is not a no-op: dropping LN₂(h) from the stream changes the output
    h = model.embed(x)
    for seq, n1 in zip(model.sequence_mixers, model.norms1, strict=True):
        y = seq(n1(h))
        h = h + (y if isinstance(seq, BaseConv) else y.o)
    assert not torch.allclose(model.head(model.norm(h)), expected)


def test_base_conv_is_a_causal_kernel_3_conv_times_a_projection_plus_skip():
    torch.manual_seed(1)
    conv = BaseConv(6, 3)
    u = torch.randn(2, 9, 6)
    padded = F.pad(u.transpose(1, 2), (2, 0))
    ref = F.conv1d(padded, conv.conv.weight, conv.conv.bias, groups=6).transpose(1, 2)
    torch.testing.assert_close(conv(u), ref * (u @ conv.projection.weight.T + conv.projection.bias) + u)
    v = u.clone()
    v[:, 5] += 1.0
    diff = (conv(v) - conv(u)).abs().sum(-1)
    assert torch.all(diff[:, :5] == 0) and torch.all(diff[:, 5:8] > 0) and torch.all(diff[:, 8] == 0)


def test_hybrid_parameter_count():
    cfg = MQARModelConfig("gated_deltanet_noconv", vocab_size=20, width=16, num_layers=4, mlp_mult=2,
                          mixer_kwargs={"num_heads": 2, "head_dim": 8, "expand_v": 1.0}, layout="hybrid")
    model = MQARModel(cfg)
    V, d, W = 20, 16, 3
    expected = (2 * V * d + V + 2 * d + 4 * (4 * d + 2 * 2 * d * d + 3 * d)  # ends, norms, MLPs
                + 2 * (d * d + d + W * d + d)  # two BaseConvs
                + sum(m.num_parameters_formula() for m in model.recurrent_mixers()))
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.parametrize("layout, gate, expected", [
    ("stacked", "default", {"bayesian": True, "gated_deltanet": True, "gated_deltanet_noconv": True,
                            "deltanet": False, "linear_attention": False}),
    ("hybrid", "default", dict.fromkeys(("bayesian", "gated_deltanet", "gated_deltanet_noconv", "deltanet",
                                         "linear_attention"), False)),
    ("stacked", "off", dict.fromkeys(("bayesian", "gated_deltanet_noconv", "deltanet"), False)),
    ("hybrid", "on", dict.fromkeys(("bayesian", "gated_deltanet_noconv", "deltanet"), True)),
])
def test_gate_option_reaches_the_layer(layout, gate, expected):
    preset = replace(TINY, layout=layout, gate=gate)
    for mixer, on in expected.items():
        model = build_model(mixer, preset, 16)
        for layer in model.recurrent_mixers():
            assert layer.use_gate is on, mixer
            assert hasattr(layer, "g_proj") is on, mixer  # no gate: no gate projection at all
        cfg, _ = model_config(mixer, preset, 16)
        assert cfg.mixer_kwargs.get("use_gate", on) is on
    # Mamba-2's z gate belongs to its SSD block: no setting touches it
    assert gate_kwargs("mamba2", gate, layout) == {}
    assert model_config("mamba2", preset, 16)[0].mixer_kwargs.keys() == {"num_heads", "head_dim", "state_size",
                                                                          "chunk_size"}


def test_gate_off_output_does_not_depend_on_a_gate():
    """With the gate off, GDN's readout is ``o_proj(RMSNorm(o))``: no gate branch feeds the output."""
    torch.manual_seed(0)
    layer = build_model("gated_deltanet_noconv", replace(TINY, gate="off"), 16).mixers[0]
    assert isinstance(layer, GatedDeltaNet) and not layer.use_gate
    x = torch.randn(1, 7, 16)
    o_norm_in = {}
    layer.o_norm.register_forward_hook(lambda mod, inp, out: o_norm_in.update(args=inp))
    layer(x)
    assert len(o_norm_in["args"]) == 1 or o_norm_in["args"][1] is None


def test_conv_variants_reach_the_layer():
    for mixer, conv in (("bayesian", True), ("bayesian_noconv", False), ("deltanet", True),
                        ("deltanet_noconv", False), ("gated_deltanet", True), ("gated_deltanet_noconv", False)):
        for preset in (TINY, HYBRID):
            (layer, *_) = build_model(mixer, preset, 16).recurrent_mixers()
            assert layer.use_short_conv is conv, (mixer, preset.layout)
            assert hasattr(layer, "q_conv1d") is conv
    assert {"bayesian_noconv", "deltanet_noconv"} <= set(known_mixers())


def test_results_stem_keeps_layouts_apart():
    assert results_stem("update", TINY) == "mqar_update"
    assert results_stem("update", HYBRID) == "mqar_update_hybrid"
    assert results_stem("block", replace(HYBRID, gate="on")) == "mqar_block_hybrid_gate-on"


def test_cli_records_layout_gate_and_conv_in_the_json(tmp_path):
    rc = cli_main(["mqar", "update", "--preset", "tiny", "--layout", "hybrid", "--mixers", "bayesian_noconv",
                   "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    record = load_json(tmp_path / "mqar_update_hybrid.json")
    cfg = record["config"]
    assert (cfg["layout"], cfg["gate"], cfg["hybrid_conv_size"], cfg["num_layers"]) == ("hybrid", "default", 3, 2)
    assert "_no_weight_decay" in cfg["optimizer_groups"]
    (run,) = record["models"]["bayesian_noconv"]["runs"]
    assert run["use_gate"] is False and run["use_short_conv"] is False
    assert run["model_config"]["layout"] == "hybrid" and run["model_config"]["mixer"] == "bayesian"
    assert run["model_config"]["mixer_kwargs"]["use_short_conv"] is False
    assert record["models"]["bayesian_noconv"]["label"] == "BL (no conv)"
    assert (tmp_path / "mqar_update_hybrid.png").stat().st_size > 0
    assert not (tmp_path / "mqar_update.json").exists()


@pytest.mark.parametrize("over, match", [({"layout": "interleaved"}, "layout"), ({"gate": "maybe"}, "gate"),
                                         ({"layout": "hybrid", "num_layers": 1}, "num_layers")])
def test_bad_layout_settings(over, match):
    with pytest.raises(ValueError, match=match):
        replace(TINY, **over)
    with pytest.raises(ValueError, match="layout"):
        MQARModelConfig("bayesian", 8, 8, layout="zoology")
    with pytest.raises(ValueError, match="num_layers"):
        MQARModelConfig("bayesian", 8, 8, num_layers=1, layout="hybrid")


def test_cpu_paper_data_preset_is_the_default_on_the_papers_data():
    default, paper_data, paper = PRESETS["default"], PRESETS["cpu-paper-data"], PRESETS["paper"]
    assert (paper_data.vocab_size, paper_data.random_non_queries) == (paper.vocab_size, paper.random_non_queries)
    assert replace(paper_data, name="default", vocab_size=default.vocab_size, random_non_queries=False) == default


def test_max_steps_caps_training_and_keeps_warmup_a_fraction():
    paper = PRESETS["paper"]
    assert train_config(paper, 22_500).warmup_steps == 1024  # uncapped: the paper's 1,024 steps
    capped = replace(paper, max_steps=600)
    assert train_config(capped, 600).warmup_steps == int(0.05 * 600)
    with pytest.raises(ValueError, match="max_steps"):
        replace(TINY, max_steps=0)
    args = build_parser().parse_args(["mqar", "update", "--preset", "paper", "--max-steps", "600", "--layout",
                                      "hybrid", "--gate", "on", "--device", "cpu", "--num-layers", "4"])
    preset = preset_from_args(args)
    assert (preset.max_steps, preset.layout, preset.gate, preset.num_layers) == (600, "hybrid", "on", 4)
    assert preset.name == "paper-custom" and args.device == "cpu"
