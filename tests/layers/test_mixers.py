"""Contract tests run on every registered mixer: decoding = chunked forward, gradients, masks, errors."""

from __future__ import annotations

import pytest
import torch

from bayeslayer.layers import MIXER_LABELS, MIXER_REGISTRY, MIXERS, MixerOutput, build_mixer
from bayeslayer.ops.bayesian_layer.lowrank import lowrank_covariance

HIDDEN = 16

# case -> (registry name, constructor kwargs of a small instance); BL variants cover every dynamics,
# noise groups and the diagonal-covariance ablation
CONFIGS = {
    "bayesian": ("bayesian", dict(num_heads=2, head_dim=8)),
    "bayesian_diagonal": ("bayesian", dict(num_heads=2, head_dim=8, dynamics="diagonal", groups=2)),
    "bayesian_rotation": ("bayesian", dict(num_heads=2, head_dim=8, dynamics="rotation", expand_v=1.0)),
    "bayesian_identity_noconv": ("bayesian", dict(num_heads=2, head_dim=8, dynamics="identity",
                                                  use_short_conv=False)),
    "bayesian_diagcov": ("bayesian", dict(num_heads=2, head_dim=8, covariance="diagonal", groups=4)),
    "bayesian_lowrank": ("bayesian", dict(num_heads=2, head_dim=8, covariance="lowrank", rank=3, groups=2)),
    "bayesian_lowrank_diagonal": ("bayesian", dict(num_heads=2, head_dim=8, covariance="lowrank", rank=1,
                                                   dynamics="diagonal")),
    "gated_deltanet": ("gated_deltanet", dict(num_heads=2, head_dim=8)),
    "gated_deltanet_noconv": ("gated_deltanet_noconv", dict(num_heads=2, head_dim=8)),
    "deltanet": ("deltanet", dict(num_heads=2, head_dim=8)),
    "linear_attention": ("linear_attention", dict(num_heads=2, head_dim=8)),
    "gla": ("gla", dict(num_heads=2, head_dim=8)),
    "mamba2": ("mamba2", dict(num_heads=2, head_dim=8, state_size=4)),
    "mamba2_groups": ("mamba2", dict(num_heads=4, head_dim=4, state_size=4, n_groups=2)),
    "attention": ("attention", dict(num_heads=2, head_dim=8)),
}


def make(case: str, dtype=torch.float64, seed: int = 0, **extra):
    torch.manual_seed(seed)
    name, kwargs = CONFIGS[case]
    mixer = build_mixer(name, HIDDEN, **kwargs, **extra)
    # move every parameter off its initial value so that no piece (a zero-initialised weight, a
    # ones-initialised norm) can hide an error in the comparisons below; then cast, so the same
    # seed gives the same weights in every dtype
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer.to(dtype)


def decode(mixer, x, prefill_lengths, mask=None):
    """Run ``x`` through ``mixer`` in pieces (the given prefills, then one token at a time)."""
    outs, state, pos = [], None, 0
    pieces = list(prefill_lengths) + [1] * (x.shape[1] - sum(prefill_lengths))
    for n in pieces:
        m = None if mask is None else mask[:, : pos + n]  # the whole mask so far, as generate() passes it
        out = mixer(x[:, pos: pos + n], attention_mask=m, state=state, use_cache=True)
        outs.append(out.o)
        state, pos = out.state, pos + n
    return torch.cat(outs, 1), state


def test_registry_names():
    assert set(MIXERS) == {"bayesian", "bayesian_noconv", "gated_deltanet", "gated_deltanet_noconv", "deltanet",
                           "deltanet_noconv", "linear_attention", "gla", "mamba2", "attention"}
    with pytest.raises(ValueError, match="unknown mixer 'gdn'.*known mixers"):
        build_mixer("gdn", HIDDEN)
    with pytest.raises(ValueError, match="unknown mixer"):
        build_mixer(None, HIDDEN)


@pytest.mark.parametrize("case", sorted(CONFIGS))
@pytest.mark.parametrize("prefill", [(5,), (3, 4), (1,)])
def test_prefill_then_decode_equals_full_forward(case, prefill):
    mixer = make(case)
    x = torch.randn(2, 13, HIDDEN, dtype=torch.float64)
    full = mixer(x, use_cache=True)
    assert isinstance(full, MixerOutput)
    pieces, state = decode(mixer, x, prefill)
    torch.testing.assert_close(pieces, full.o, rtol=1e-10, atol=1e-10)
    if "lowrank" in case:
        # the factor W of the low-rank precision is unique only up to W R (R orthogonal): compare the
        # covariance it stands for
        state, full_state = (dict(s, recurrent=(s["recurrent"][0], lowrank_covariance(s["recurrent"][1])))
                             for s in (state, full.state))
    else:
        full_state = full.state
    flat_a = [t for t in _tensors(state)]
    flat_b = [t for t in _tensors(full_state)]
    assert len(flat_a) == len(flat_b) > 0
    for a, b in zip(flat_a, flat_b, strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-10, atol=1e-10)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for key in sorted(value):
            yield from _tensors(value[key])
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_gradients_reach_every_parameter(case):
    mixer = make(case, dtype=torch.float32)
    x = torch.randn(2, 9, HIDDEN, requires_grad=True)
    out = mixer(x)
    (out.o.square().sum()).backward()
    for name, p in mixer.named_parameters():
        assert p.grad is not None, f"{case}: no gradient for {name}"
        assert torch.isfinite(p.grad).all(), f"{case}: non-finite gradient for {name}"
        assert p.grad.abs().sum() > 0, f"{case}: zero gradient for {name}"
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("case", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_shape_and_dtype(case, dtype):
    mixer = make(case, dtype=dtype)
    x = torch.randn(3, 7, HIDDEN).to(dtype)
    out = mixer(x)
    assert out.o.shape == (3, 7, HIDDEN) and out.o.dtype == dtype
    assert out.state is None and out.variance is None
    assert torch.isfinite(out.o.float()).all()
    ref = make(case, dtype=torch.float64)(x.double()).o
    # bf16 keeps ~3 significant digits in every projection; the filter itself runs in fp32
    tol = 8e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.o.double(), ref, rtol=0, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_left_padding_is_a_no_op(case):
    mixer = make(case)
    T, pads = 10, [0, 3, 6]
    real = torch.randn(len(pads), T, HIDDEN, dtype=torch.float64)
    # padded positions hold junk, not zeros: the mask alone must keep them out of the memory
    x = torch.randn(len(pads), T, HIDDEN, dtype=torch.float64) * 5
    mask = torch.ones(len(pads), T, dtype=torch.long)
    for b, p in enumerate(pads):
        x[b, p:] = real[b, : T - p]
        mask[b, :p] = 0
    out = mixer(x, attention_mask=mask, use_cache=True)
    nxt = torch.randn(len(pads), 1, HIDDEN, dtype=torch.float64)
    full_mask = torch.cat((mask, torch.ones(len(pads), 1, dtype=torch.long)), 1)
    step = mixer(nxt, attention_mask=full_mask, state=out.state, use_cache=True)
    for b, p in enumerate(pads):
        alone = mixer(real[b: b + 1, : T - p], use_cache=True)
        torch.testing.assert_close(out.o[b: b + 1, p:], alone.o, rtol=1e-10, atol=1e-10)
        assert out.o[b, :p].abs().max().item() == 0 if p else True
        alone_step = mixer(nxt[b: b + 1], state=alone.state, use_cache=True)
        torch.testing.assert_close(step.o[b: b + 1], alone_step.o, rtol=1e-10, atol=1e-10)
    # a mask of all ones is the same as no mask
    torch.testing.assert_close(mixer(real, attention_mask=torch.ones(3, T)).o, mixer(real).o, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["bayesian", "gated_deltanet", "mamba2", "attention"])
def test_left_padded_prefill_then_decode(case):
    mixer = make(case)
    x = torch.randn(2, 12, HIDDEN, dtype=torch.float64)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :4] = False
    full = mixer(x, attention_mask=mask)
    pieces, _ = decode(mixer, x, (6,), mask=mask)
    torch.testing.assert_close(pieces, full.o, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_state_size_per_head_matches_the_returned_state(case):
    mixer = make(case)
    B, T = 2, 5
    state = mixer(torch.randn(B, T, HIDDEN, dtype=torch.float64), use_cache=True).state
    H = mixer.num_heads
    if case == "attention":
        floats = state["k"].numel() + state["v"].numel()
        assert floats == B * H * T * mixer.state_size_per_head()
        return
    M, P = state["recurrent"]
    floats = M.numel() + (0 if P is None else P.numel())
    if case == "bayesian_diagcov":  # the diagonal ablation stores dense P with zero off-diagonals
        floats = M.numel() + torch.diagonal(P, dim1=-2, dim2=-1).numel()
    assert floats == B * H * mixer.state_size_per_head()


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_parameter_formula(case):
    mixer = make(case)
    assert sum(p.numel() for p in mixer.parameters()) == mixer.num_parameters_formula()


@pytest.mark.parametrize("name", sorted(MIXERS))
@pytest.mark.parametrize("kwargs", [dict(use_gate=False), dict(conv_bias=True), dict(expand_v=0.5)])
def test_parameter_formula_options(name, kwargs):
    import inspect

    params = inspect.signature(MIXERS[name].__init__).parameters
    if any(k not in params for k in kwargs) or (name == "gated_deltanet_noconv" and "conv_bias" in kwargs):
        pytest.skip(f"{name} has no {sorted(kwargs)}")
    extra = dict(state_size=4) if name == "mamba2" else {}
    mixer = build_mixer(name, HIDDEN, num_heads=2, head_dim=8, **extra, **kwargs)
    assert sum(p.numel() for p in mixer.parameters()) == mixer.num_parameters_formula()


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_bad_inputs_raise(case):
    mixer = make(case)
    x = torch.randn(2, 4, HIDDEN, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, hidden_size=16\], got \(2, 4, 15\)"):
        mixer(torch.randn(2, 4, HIDDEN - 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="hidden_states must be"):
        mixer(torch.randn(4, HIDDEN, dtype=torch.float64))
    with pytest.raises(ValueError, match="empty"):
        mixer(torch.randn(2, 0, HIDDEN, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating-point"):
        mixer(torch.ones(2, 4, HIDDEN, dtype=torch.long))
    with pytest.raises(TypeError, match="torch.Tensor"):
        mixer(x.tolist())
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, T\]"):
        mixer(x, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, T\]"):
        mixer(x, attention_mask=torch.ones(3, 4))
    with pytest.raises(ValueError, match="only 0"):
        mixer(x, attention_mask=torch.full((2, 4), 2))
    with pytest.raises(TypeError, match="state must be a dict"):
        mixer(x, state=(1, 2))
    with pytest.raises(ValueError, match="unknown entries"):
        mixer(x, state={"bogus": x})


@pytest.mark.parametrize("case", ["bayesian", "gated_deltanet", "deltanet", "mamba2"])
def test_bad_state_raises(case):
    mixer = make(case)
    x = torch.randn(2, 4, HIDDEN, dtype=torch.float64)
    state = mixer(x, use_cache=True).state
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(M\) must be"):
        mixer(x[:1], state={"recurrent": state["recurrent"]})  # a batch-2 memory fed a batch-1 input
    with pytest.raises(ValueError, match=r"conv cache must be \[B, C, W-1\] = \(1, "):
        mixer(x[:1], state=state)
    conv_key = next(iter(state["conv"]))
    bad_conv = {**state["conv"], conv_key: state["conv"][conv_key][..., :1]}
    with pytest.raises(ValueError, match=r"conv cache must be \[B, C, W-1\]"):
        mixer(x, state={**state, "conv": bad_conv})
    with pytest.raises(TypeError, match=r"state\['conv'\] must be a dict"):
        mixer(x, state={**state, "conv": [1]})


def test_attention_bad_cache_raises():
    mixer = make("attention")
    x = torch.randn(2, 4, HIDDEN, dtype=torch.float64)
    state = mixer(x, use_cache=True).state
    with pytest.raises(ValueError, match=r"state\['k'\] must be \[B, S, H, D\]"):
        mixer(x[:1], state=state)
    with pytest.raises(ValueError, match=r"state\['mask'\] must be \[B, S\]"):
        mixer(x, state={"k": state["k"], "v": state["v"]})


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_bad_config_raises(name):
    extra = dict(state_size=4) if name == "mamba2" else {}
    for bad, err, match in [
        (dict(num_heads=0), ValueError, "num_heads must be an integer >= 1, got 0"),
        (dict(head_dim=2.5), ValueError, "head_dim must be an integer, got float 2.5"),
        (dict(chunk_size=0) if name != "attention" else dict(rope_base=-1.0), ValueError, "must be"),
    ]:
        with pytest.raises(err, match=match):
            build_mixer(name, HIDDEN, **{**dict(num_heads=2, head_dim=8, **extra), **bad})
    with pytest.raises(ValueError, match="hidden_size must be an integer >= 1"):
        build_mixer(name, 0)
    with pytest.raises(TypeError):
        build_mixer(name, HIDDEN, not_an_argument=1)


@pytest.mark.parametrize("name", ["bayesian", "gated_deltanet", "deltanet", "linear_attention", "gla"])
def test_non_integer_value_dim_raises(name):
    with pytest.raises(ValueError, match=r"expand_v=0.3 gives a non-integer value head dim"):
        build_mixer(name, HIDDEN, num_heads=2, head_dim=8, expand_v=0.3)
    with pytest.raises(ValueError, match="expand_v must be finite and > 0"):
        build_mixer(name, HIDDEN, num_heads=2, head_dim=8, expand_v=0.0)


def test_mixer_specific_bad_configs():
    with pytest.raises(ValueError, match="num_heads=3 must be divisible by n_groups=2"):
        build_mixer("mamba2", HIDDEN, num_heads=3, head_dim=8, n_groups=2)
    with pytest.raises(ValueError, match="even head_dim"):
        build_mixer("attention", HIDDEN, num_heads=2, head_dim=7)
    with pytest.raises(ValueError, match="'gated_deltanet_noconv' fixes use_short_conv=False, got use_short_conv=True; "
                       "use gated_deltanet instead"):
        build_mixer("gated_deltanet_noconv", HIDDEN, num_heads=2, head_dim=8, use_short_conv=True)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_bf16_prefill_and_decode(case):
    """Mixed precision: bf16 weights and activations, the filter state stays in fp32."""
    mixer = make(case, dtype=torch.bfloat16)
    x = torch.randn(2, 9, HIDDEN).to(torch.bfloat16)
    pieces, state = decode(mixer, x, (5,))
    assert pieces.dtype == torch.bfloat16 and torch.isfinite(pieces.float()).all()
    ref = make(case, dtype=torch.float64)(x.double()).o
    assert (pieces.double() - ref).abs().max() <= 8e-2 * ref.abs().max()
    if "recurrent" in state:
        assert all(t.dtype == torch.float32 for t in _tensors(state["recurrent"]))


def test_every_registry_mixer_has_one_label():
    """Mixer labels live next to the registry: one per mixer, no more, all distinct."""
    assert list(MIXER_LABELS) == list(MIXERS)
    assert len(set(MIXER_LABELS.values())) == len(MIXER_LABELS)
    assert all(isinstance(label, str) and label for label in MIXER_LABELS.values())


def test_a_mixer_is_one_registration_and_the_views_are_read_only():
    from bayeslayer.layers import MIXER_REGISTRY, register_mixer

    saved = dict(MIXER_REGISTRY)
    try:
        cls = type("Renamed", (MIXERS["deltanet"],), {})
        assert register_mixer("renamed_deltanet", cls, label="R-DeltaNet") is cls
        assert MIXERS["renamed_deltanet"] is cls and MIXER_LABELS["renamed_deltanet"] == "R-DeltaNet"
        assert type(build_mixer("renamed_deltanet", 16, num_heads=2, head_dim=8)) is cls
        with pytest.raises(ValueError, match="mixer 'renamed_deltanet' is already registered"):
            register_mixer("renamed_deltanet", cls, label="other")
        with pytest.raises(ValueError, match="label 'BL' is already the label of mixer 'bayesian'"):
            register_mixer("other", cls, label="BL")
        with pytest.raises(ValueError, match="label must be a non-empty string"):
            register_mixer("other", cls, label=" ")
        with pytest.raises(ValueError, match="name must be a mixer name"):
            register_mixer("no spaces", cls, label="X")
        with pytest.raises(TypeError, match="cls must be a torch.nn.Module subclass"):
            register_mixer("other", object, label="X")
        with pytest.raises(TypeError):
            MIXERS["other"] = cls  # the views cannot be written around the registration
        with pytest.raises(ValueError, match="budget must be one of"):
            register_mixer("other", cls, label="X", budget="floats")
        with pytest.raises(ValueError, match="variants\\['other_v'\\] label 'R-DeltaNet' is already"):
            register_mixer("other", cls, label="X", variants={"other_v": ("R-DeltaNet", {})})
        assert "other" not in MIXERS  # a refused call registers nothing
        # a variant: the same class with fixed keywords, its own label, the base's budget rule
        register_mixer("plain", cls, label="P", budget="heads", variants={"plain_noconv": ("P (no conv)",
                                                                                           {"use_short_conv": False})})
        entry = MIXER_REGISTRY["plain_noconv"]
        assert (entry.cls, entry.label, dict(entry.defaults), entry.budget, entry.base) == (
            cls, "P (no conv)", {"use_short_conv": False}, "heads", "plain")
        assert not build_mixer("plain_noconv", 16, num_heads=2, head_dim=8).use_short_conv
        with pytest.raises(ValueError, match="fixes use_short_conv=False, got use_short_conv=True; use plain"):
            build_mixer("plain_noconv", 16, num_heads=2, head_dim=8, use_short_conv=True)
    finally:
        MIXER_REGISTRY.clear()
        MIXER_REGISTRY.update(saved)


def test_the_gla_layer_has_its_own_name_and_the_old_one_warns():
    import bayeslayer.layers as layers
    from bayeslayer.design import GLA

    assert MIXERS["gla"] is layers.GatedLinearAttention and MIXERS["gla"].design is GLA
    with pytest.warns(DeprecationWarning, match="GatedLinearAttention"):
        assert layers.GLA is layers.GatedLinearAttention


def test_the_conv_free_layers_are_registry_variants():
    """One mechanism for every conv-free layer: a variant of its mixer with use_short_conv=False."""
    for name, base, label in (("bayesian_noconv", "bayesian", "BL (no conv)"),
                              ("gated_deltanet_noconv", "gated_deltanet", "GDN (no conv)"),
                              ("deltanet_noconv", "deltanet", "DeltaNet (no conv)")):
        entry = MIXER_REGISTRY[name]
        assert (entry.base, entry.cls, entry.label, dict(entry.defaults)) == (
            base, MIXERS[base], label, {"use_short_conv": False})
        layer = build_mixer(name, HIDDEN, num_heads=2, head_dim=8)
        assert type(layer) is MIXERS[base] and not layer.use_short_conv
    assert {n: e.budget for n, e in MIXER_REGISTRY.items() if e.base is None} == {
        "bayesian": "heads", "gated_deltanet": "heads", "deltanet": "heads", "linear_attention": "heads",
        "gla": "heads", "mamba2": "ssd", "attention": None}
    from bayeslayer.layers import GatedDeltaNetNoConv

    with pytest.warns(DeprecationWarning, match="gated_deltanet_noconv"):
        assert not GatedDeltaNetNoConv(HIDDEN, num_heads=2, head_dim=8).use_short_conv
