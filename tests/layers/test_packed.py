"""Packed sequences (``cu_seqlens``, as flash-linear-attention's layers take them) equal the sequences run one
by one, for every mixer configuration: outputs, variances, gradients, and the per-sequence caches that
decoding continues from."""

from __future__ import annotations

import pytest
import torch

from bayeslayer.layers import build_mixer

from .test_mixers import CONFIGS, HIDDEN, make

# a chunk size of 4 puts chunk boundaries inside and across every sequence
LENGTHS = (5, 1, 9, 3)
TOLERANCES = {torch.float64: 1e-12, torch.float32: 1e-5}


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def build(case: str, dtype):
    extra = {} if CONFIGS[case][0] == "attention" else {"chunk_size": 4}
    return make(case, dtype=dtype, **extra)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_packed_and_separate(mixer, x, lengths, *, state=None, variance=False):
    """The packed forward and the sequences one by one: outputs, states, and the gradients of one loss."""
    cu = offsets(lengths)
    weight = torch.randn_like(x)
    params = [p for p in mixer.parameters()]
    packed = mixer(x, cu_seqlens=cu, use_cache=True, output_variance=variance, state=state)
    loss = (packed.o * weight).sum() + (packed.variance.sum() if variance else 0)
    grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
    outs, variances, states, loss_ref = [], [], [], 0
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        row = None if state is None else row_of(state, n)
        out = mixer(x[:, a:b], use_cache=True, output_variance=variance, state=row)
        outs.append(out.o)
        variances.append(out.variance)
        states.append(out.state)
        loss_ref = loss_ref + (out.o * weight[:, a:b]).sum() + (out.variance.sum() if variance else 0)
    grads_ref = torch.autograd.grad(loss_ref, [x, *params], allow_unused=True)
    return packed, grads, torch.cat(outs, 1), (torch.cat(variances, 1) if variance else None), states, grads_ref


def row_of(state, n: int):
    """Row ``n`` of a state nest (every tensor's dim 0)."""
    if isinstance(state, torch.Tensor):
        return state[n:n + 1]
    if isinstance(state, dict):
        return {key: row_of(val, n) for key, val in state.items()}
    if isinstance(state, (tuple, list)):
        return type(state)(row_of(val, n) for val in state)
    return state


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_packed_equals_one_by_one(case, dtype):
    tol = TOLERANCES[dtype]
    mixer = build(case, dtype)
    torch.manual_seed(1)
    x = torch.randn(1, sum(LENGTHS), HIDDEN, dtype=dtype, requires_grad=True)
    variance = case.startswith("bayesian")
    packed, grads, o_ref, var_ref, states, grads_ref = run_packed_and_separate(mixer, x, LENGTHS, variance=variance)
    assert relative(packed.o, o_ref) <= tol
    if variance:
        assert relative(packed.variance, var_ref) <= tol
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert (g is None) == (g_ref is None)
        if g is not None:
            assert relative(g, g_ref) <= tol
    # the packed cache holds one row per sequence: one more token decoded from it, as a batch of N,
    # equals each sequence decoding on from its own cache
    nxt = torch.randn(len(LENGTHS), 1, HIDDEN, dtype=dtype)
    with torch.no_grad():
        step = mixer(nxt, state=packed.state, use_cache=True)
        for n, own in enumerate(states):
            assert relative(step.o[n:n + 1], mixer(nxt[n:n + 1], state=own).o) <= tol


@pytest.mark.parametrize("case", ["bayesian", "gated_deltanet", "mamba2", "attention"])
def test_packed_continues_per_sequence_caches(case):
    """A packed prefill that starts from a state (one row per sequence) continues each sequence's cache."""
    mixer = build(case, torch.float64)
    torch.manual_seed(2)
    first = torch.randn(len(LENGTHS), 2, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        state = mixer(first, use_cache=True).state
    x = torch.randn(1, sum(LENGTHS), HIDDEN, dtype=torch.float64, requires_grad=True)
    packed, grads, o_ref, _, _, grads_ref = run_packed_and_separate(mixer, x, LENGTHS, state=state)
    assert relative(packed.o, o_ref) <= 1e-12
    for g, g_ref in zip(grads, grads_ref, strict=True):
        if g is not None:
            assert relative(g, g_ref) <= 1e-12


def test_packed_short_convolution_restarts_at_every_sequence():
    """With cu_seqlens the first tokens of a sequence see zeros (or their own cache), never the previous
    sequence's inputs, including sequences shorter than the window and empty ones."""
    from bayeslayer.layers import ShortConvolution

    torch.manual_seed(3)
    for width in (1, 2, 4):
        conv = ShortConvolution(6, width, bias=True).double()
        lengths = (3, 1, 0, 5, 2)
        cu = offsets(lengths)
        x = torch.randn(1, sum(lengths), 6, dtype=torch.float64)
        for cache in (None, torch.randn(len(lengths), 6, width - 1, dtype=torch.float64)):
            y, new = conv(x, cache, output_final_state=True, cu_seqlens=cu)
            for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
                own = torch.zeros(1, 6, width - 1, dtype=torch.float64) if cache is None else cache[n:n + 1]
                if a == b:  # an empty sequence: its cache passes through
                    torch.testing.assert_close(new[n:n + 1], own, rtol=0, atol=0)
                    continue
                y_n, new_n = conv(x[:, a:b], own, output_final_state=True)
                torch.testing.assert_close(y[:, a:b], y_n, rtol=1e-14, atol=1e-14)
                torch.testing.assert_close(new[n:n + 1], new_n, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["bayesian", "attention"])
def test_packed_inputs_are_refused_by_name(name):
    mixer = build_mixer(name, HIDDEN, num_heads=2, head_dim=8)
    x = torch.randn(1, 6, HIDDEN)
    with pytest.raises(ValueError, match="attention_mask or cu_seqlens, not both"):
        mixer(x, cu_seqlens=offsets((2, 4)), attention_mask=torch.ones(1, 6))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at T=6"):
        mixer(x, cu_seqlens=offsets((2, 3)))
    with pytest.raises(ValueError, match="batch size must be 1"):
        mixer(torch.randn(2, 6, HIDDEN), cu_seqlens=offsets((2, 4)))
    with pytest.raises(TypeError, match="cu_seqlens must have dtype int32 or int64"):
        mixer(x, cu_seqlens=offsets((2, 4)).float())
    state = mixer(torch.randn(3, 2, HIDDEN), use_cache=True).state
    with pytest.raises(ValueError, match="one row per sequence|N=2|B=2"):
        mixer(x, cu_seqlens=offsets((2, 4)), state=state)
