"""replace_layers: GDN layers → Bayesian Layers initialised from the teacher (docs/theory.md §8.6)."""

from __future__ import annotations

import pytest
import torch

from bayeslayer.layers import MIXERS
from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM, replace_layers
from bayeslayer.models.retrofit import SHARED_PREFIXES

V, D_MODEL, HEADS, HEAD_DIM, LAYERS = 64, 32, 2, 8, 4


def gdn_teacher(seed: int = 0, mixer: str = "gated_deltanet") -> BayesLayerForCausalLM:
    torch.manual_seed(seed)
    config = BayesLayerConfig(vocab_size=V, hidden_size=D_MODEL, num_hidden_layers=LAYERS, num_heads=HEADS,
                              head_dim=HEAD_DIM, mixer=mixer,
                              mixer_kwargs={mixer: {"expand_v": 2.0, "norm_eps": 1e-6}},
                              bos_token_id=None, eos_token_id=None)
    model = BayesLayerForCausalLM(config).eval()
    with torch.no_grad():  # move every parameter off its default so a copy is observable
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_shared_weights_are_copied_and_other_layers_untouched():
    model = gdn_teacher()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copied = replace_layers(model, [1, 3])
    assert set(copied) == {1, 3}
    for i in (1, 3):
        new = model.model.layers[i].attn
        assert type(new) is MIXERS["bayesian"]
        names = {n for n, _ in new.named_parameters()}
        shared = sorted(n for n in names if n.startswith(SHARED_PREFIXES))
        assert sorted(copied[i]) == shared
        # everything q, k, v, gate, output, decay, convs and norm has in common with GDN
        for expected in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "a_proj.weight", "A_log",
                         "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "g_proj.weight",
                         "o_norm.weight", "o_proj.weight"):
            assert expected in copied[i]
            assert torch.equal(new.get_parameter(expected), before[f"model.layers.{i}.attn.{expected}"])
        assert new.o_norm.eps == 1e-6
        assert "r2_proj.weight" in names and "r2_proj.weight" not in copied[i]  # BL's own noise maps
        assert not any(n.startswith("b_proj") for n in names)  # GDN's β is gone
    after = model.state_dict()
    for key, value in before.items():
        if key.startswith(("model.layers.1.attn.", "model.layers.3.attn.")):
            continue
        assert torch.equal(after[key], value), key
    assert model.config.layer_mixers == ["gated_deltanet", "bayesian", "gated_deltanet", "bayesian"]


def test_swapped_model_runs_decodes_consistently_and_round_trips(tmp_path):
    model = gdn_teacher()
    replace_layers(model, 2)
    model = model.to(torch.float64)  # fp64: greedy argmax must not hinge on fp32 rounding of near-ties
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))
    # an explicit mask: otherwise generate() would take the prompt's token 0 (= pad_token_id) for padding
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                         pad_token_id=0)
    seq = ids
    with torch.no_grad():
        for _ in range(5):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
        logits = model(ids).logits
    assert torch.equal(out, seq)
    model.save_pretrained(tmp_path)
    loaded = BayesLayerForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert loaded.config.layer_mixers == model.config.layer_mixers
    assert type(loaded.model.layers[2].attn) is MIXERS["bayesian"]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)


def test_swapped_layer_trains():
    model = gdn_teacher().train()
    replace_layers(model, [0])
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.model.layers[0].attn.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())


def test_scratch_init_copies_nothing_and_mixer_kwargs_pass_through():
    model = gdn_teacher()
    before = model.model.layers[0].attn.q_proj.weight.clone()
    copied = replace_layers(model, [0], init_from="scratch", p0=2.0)
    assert copied == {0: []}
    new = model.model.layers[0].attn
    assert not torch.equal(new.q_proj.weight, before)
    assert torch.allclose(new.p0, torch.full_like(new.p0, 2.0))
    assert model.config.mixer_arguments(0)[1]["p0"] == 2.0


@pytest.mark.filterwarnings("ignore:ShortConvolution is crucial")
def test_conv_free_teacher_gives_a_conv_free_bayesian_layer():
    model = gdn_teacher(mixer="gated_deltanet_noconv")
    copied = replace_layers(model, [1])
    new = model.model.layers[1].attn
    assert not new.use_short_conv and not any("conv1d" in n for n in copied[1])
    model(torch.randint(0, V, (1, 4)))


def test_bad_arguments_raise_clear_errors():
    model = gdn_teacher()
    with pytest.raises(ValueError, match=r"out of range.*4 layers"):
        replace_layers(model, [4])
    with pytest.raises(ValueError, match="out of range"):
        replace_layers(model, [-1])
    with pytest.raises(ValueError, match="duplicates"):
        replace_layers(model, [1, 1])
    with pytest.raises(ValueError, match="empty"):
        replace_layers(model, [])
    with pytest.raises(TypeError, match="ints"):
        replace_layers(model, [1.0])
    with pytest.raises(TypeError, match="list of ints"):
        replace_layers(model, "1")
    with pytest.raises(ValueError, match="unknown mixer 'kalman'"):
        replace_layers(model, [1], mixer="kalman")
    with pytest.raises(ValueError, match="init_from"):
        replace_layers(model, [1], init_from="student")
    with pytest.raises(ValueError, match="layer_idx"):
        replace_layers(model, [1], layer_idx=3)
    with pytest.raises(TypeError, match="BayesLayerForCausalLM"):
        replace_layers(model.model, [1])
    replace_layers(model, [1])
    with pytest.raises(ValueError, match="not"):
        replace_layers(model, [1])  # layer 1 is no longer a Gated DeltaNet teacher
    # a new mixer that cannot take the teacher's shapes is refused, not silently half-copied
    with pytest.raises(ValueError, match="shape mismatches"):
        replace_layers(model, [2], expand_v=1.0)
    assert model.config.layer_mixers[2] == "gated_deltanet"
