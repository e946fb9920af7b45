"""The model's predictive variances: ``output_variances=True`` on forward and generate()."""

from __future__ import annotations

import pytest
import torch

from bayeslayer.models import BayesLayerGenerateBeamOutput, BayesLayerGenerateOutput
from bayeslayer.ops import bl_chunk
from tests.models.test_modeling import HEADS, HYBRID, random_ids, tiny_model

# two Bayesian Layers, so a stack of them (and the second one's input) is covered
MIXERS = ["bayesian", "gated_deltanet", "bayesian"]


def test_variances_equal_bl_chunk_on_each_bayesian_layers_inputs():
    model = tiny_model(mixers=MIXERS).double()
    ids = random_ids(2, 7)
    with torch.no_grad():
        out = model(ids, output_variances=True, output_hidden_states=True)
        assert torch.equal(out.logits, model(ids).logits)
        assert len(out.variances) == 3 and out.variances[1] is None
        for idx in (0, 2):
            block = model.model.layers[idx]
            x = block.attn_norm(out.hidden_states[idx])  # the mixer's input in that forward
            q, k, v, write, _, _ = block.attn.features(x, None, None)
            _, expected, _ = bl_chunk(q, k, v, p0=block.attn.filter_p0(), return_variance=True, **write)
            assert out.variances[idx].shape == (2, 7, HEADS, 1)
            torch.testing.assert_close(out.variances[idx], expected, rtol=1e-12, atol=1e-12)
            assert (out.variances[idx] >= 1).all()  # 1 + qᵀ P q with P positive semi-definite
    assert model(ids).variances is None


def test_decoding_through_the_cache_gives_the_prefills_variances():
    model = tiny_model(mixers=HYBRID).double()
    ids = random_ids(2, 9)
    with torch.no_grad():
        full = model(ids, output_variances=True).variances[0]
        out = model(ids[:, :4], use_cache=True, output_variances=True)
        pieces = [out.variances[0]]
        cache = out.cache
        for t in range(4, 9):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True, output_variances=True)
            cache = out.cache
            pieces.append(out.variances[0])
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)


def test_generate_returns_one_entry_per_new_token_equal_to_a_full_forward():
    model = tiny_model(mixers=HYBRID).double()
    ids = random_ids(2, 5)
    new = 4
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             pad_token_id=0, output_variances=True, return_dict_in_generate=True)
        assert isinstance(gen, BayesLayerGenerateOutput)
        assert gen.sequences.shape == (2, 5 + new) and len(gen.variances) == new
        assert gen.variances[0][0].shape == (2, 5, HEADS, 1)
        assert all(step[0].shape == (2, 1, HEADS, 1) and step[1] is None and step[2] is None
                   for step in gen.variances[1:])
        # the forward that produced the last token saw every token but it
        full = model(gen.sequences[:, :-1], output_variances=True).variances[0]
    torch.testing.assert_close(torch.cat([step[0] for step in gen.variances], 1), full, rtol=1e-10, atol=1e-10)
    # the plain call is unchanged
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                           pad_token_id=0)
    assert torch.equal(plain, gen.sequences)


def test_beam_search_returns_variances_per_step():
    model = tiny_model(mixers=HYBRID)
    ids = random_ids(1, 4)
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, num_beams=2,
                             do_sample=False, pad_token_id=0, output_variances=True, return_dict_in_generate=True)
    assert isinstance(gen, BayesLayerGenerateBeamOutput) and len(gen.variances) == 3
    assert gen.variances[0][0].shape == (2, 4, HEADS, 1)


def test_bad_flags_raise_clear_errors():
    model = tiny_model(mixers=HYBRID)
    ids = random_ids(1, 4)
    with pytest.raises(TypeError, match="output_variances must be True or False"):
        model(ids, output_variances="yes")
    with pytest.raises(TypeError, match="output_variances"):
        model(ids, output_variance=True)  # the mixer's spelling, named
    with pytest.raises(ValueError, match="return_dict_in_generate"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, pad_token_id=0,
                       output_variances=True)
    no_bayes = tiny_model(mixers=["gated_deltanet", "attention"])
    for call in (lambda: no_bayes(ids, output_variances=True),
                 lambda: no_bayes.model(ids, output_variances=True),
                 lambda: no_bayes.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                                           pad_token_id=0, output_variances=True, return_dict_in_generate=True)):
        with pytest.raises(ValueError, match="needs a layer with a covariance"):
            call()
    assert no_bayes(ids, output_variances=False).variances is None
