"""The Hugging Face language model: save/load, Auto classes, generate() with the recurrent cache,
hybrid training, gradients, parameter counts and input validation."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bayeslayer.layers import MIXERS
from bayeslayer.models import (
    BayesLayerCache,
    BayesLayerConfig,
    BayesLayerForCausalLM,
    BayesLayerModel,
    count_parameters,
)

HYBRID = ["bayesian", "gated_deltanet", "attention"]
# every other registered mixer, stacked in one model
OTHERS = sorted(set(MIXERS) - set(HYBRID))
V, D_MODEL, HEADS, HEAD_DIM = 64, 32, 2, 8


def tiny_config(mixers=None, **overrides) -> BayesLayerConfig:
    kwargs = dict(vocab_size=V, hidden_size=D_MODEL, num_hidden_layers=3, num_heads=HEADS, head_dim=HEAD_DIM,
                  mixers=list(HYBRID) if mixers is None else mixers, bos_token_id=None, eos_token_id=None)
    kwargs.update(overrides)
    if kwargs["mixers"] is not None:
        kwargs["num_hidden_layers"] = len(kwargs["mixers"])
    return BayesLayerConfig(**kwargs)


def tiny_model(seed: int = 0, **overrides) -> BayesLayerForCausalLM:
    torch.manual_seed(seed)
    return BayesLayerForCausalLM(tiny_config(**overrides)).eval()


def random_ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# -- save / load --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied, mixers", [(False, HYBRID), (True, HYBRID), (False, OTHERS)],
                         ids=["hybrid-untied", "hybrid-tied", "others"])
def test_save_pretrained_round_trips_outputs_exactly(tmp_path, tied, mixers):
    # from_pretrained builds the model on the meta device and fills it from the file, so a mixer
    # whose state is not all in its state_dict (e.g. a non-persistent buffer) would show up here
    model = tiny_model(tie_word_embeddings=tied, mixers=mixers)
    ids = random_ids(2, 11)
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not list(tmp_path.glob("*.bin")), "weights must be stored as safetensors, not pickles"
    loaded = BayesLayerForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.layer_mixers == mixers
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (loaded.lm_head.weight is loaded.model.embeddings.weight) == tied


def test_auto_classes_load_the_model(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, BayesLayerConfig) and config.model_type == "bayeslayer"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is BayesLayerForCausalLM
    ids = random_ids(1, 6)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert type(AutoModelForCausalLM.from_config(tiny_config())) is BayesLayerForCausalLM


def test_config_json_round_trip_keeps_per_layer_choices(tmp_path):
    config = tiny_config(mixers=None, mixer="gated_deltanet", num_hidden_layers=3,
                         mixer_overrides={0: "bayesian", 2: "attention"},
                         mixer_kwargs={"gated_deltanet": {"expand_v": 1.0}},
                         layer_mixer_kwargs={0: {"p0": 2.0}}, mlp_dropout=0.25)
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["mixer_overrides"] == {"0": "bayesian", "2": "attention"}  # JSON makes int keys strings
    back = BayesLayerConfig.from_pretrained(tmp_path)
    assert back.layer_mixers == ["bayesian", "gated_deltanet", "attention"]
    assert back.mixer_arguments(0) == ("bayesian", {"num_heads": HEADS, "head_dim": HEAD_DIM, "p0": 2.0})
    assert back.mixer_arguments(1)[1]["expand_v"] == 1.0
    assert back.mlp_dropout == 0.25


# -- generation and the cache -------------------------------------------------------------------------
@pytest.mark.parametrize("mixers", [HYBRID, OTHERS], ids=["hybrid", "others"])
def test_prefill_then_single_steps_equals_one_full_forward(mixers):
    model = tiny_model(mixers=mixers)
    ids = random_ids(2, 12)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :7], use_cache=True)
        assert isinstance(out.cache, BayesLayerCache) and out.cache.get_seq_length() == 7
        pieces = [out.logits]
        cache = out.cache
        for t in range(7, 12):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = out.cache
            pieces.append(out.logits)
    assert cache.get_seq_length() == 12
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)


def test_generate_uses_the_cache_and_greedy_equals_stepwise_argmax():
    model = tiny_model().to(torch.float64)  # fp64: no argmax near-tie may flip on fp32 rounding
    prompt = random_ids(2, 6)
    seen_lengths = []
    hook = model.model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen_lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                             do_sample=False, pad_token_id=0)
    finally:
        hook.remove()
    # one prefill of the prompt, then one token per step: the recurrent cache is used
    assert seen_lengths == [6, 1, 1, 1, 1, 1]
    again = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                           do_sample=False, pad_token_id=0)
    assert torch.equal(out, again)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_generate_returns_a_reusable_cache_and_beam_search_runs():
    model = tiny_model(mixers=["bayesian", "gated_deltanet"])
    prompt = random_ids(1, 5)
    mask = torch.ones_like(prompt)
    res = model.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0)
    assert isinstance(res.cache, BayesLayerCache)
    assert res.cache.get_seq_length() == 5 + 3 - 1  # the last token is produced but not yet read
    beams = model.generate(prompt, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False,
                           pad_token_id=0)
    assert beams.shape == (1, 9)


@pytest.mark.parametrize("mixers", [HYBRID, OTHERS], ids=["hybrid", "others"])
def test_left_padding_changes_nothing(mixers):
    """A left-padded prompt in a batch gives the logits and greedy continuation it gives alone."""
    model = tiny_model(mixers=mixers).to(torch.float64)
    short = random_ids(1, 5, seed=3)
    long = random_ids(1, 8, seed=4)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)
    batch = torch.cat([padded, long])
    mask = torch.cat([torch.cat([torch.zeros(1, 3), torch.ones(1, 5)], 1), torch.ones(1, 8)]).long()
    with torch.no_grad():
        alone = model(short).logits[:, -1]
        together = model(batch, attention_mask=mask).logits[0, -1]
    torch.testing.assert_close(together, alone[0], rtol=1e-4, atol=1e-5)
    gen_alone = model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=4,
                               do_sample=False, pad_token_id=0)
    gen_batch = model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(gen_batch[0, 3:], gen_alone[0])


def test_inputs_embeds_matches_input_ids():
    model = tiny_model()
    ids = random_ids(2, 7)
    with torch.no_grad():
        a = model(ids).logits
        b = model(inputs_embeds=model.get_input_embeddings()(ids)).logits
    assert torch.equal(a, b)


# -- training -----------------------------------------------------------------------------------------
def test_hybrid_trains_with_falling_loss_on_a_synthetic_task():
    """Arithmetic sequences ``x_t = (x_0 + s·t) mod V`` with a random start and a random stride
    ``s ∈ {1, 2, 3}``: the next token needs the stride, i.e. the previous tokens (token mixing)."""
    torch.manual_seed(0)
    model = BayesLayerForCausalLM(tiny_config()).train()
    assert [type(layer.attn) for layer in model.model.layers] == [MIXERS[name] for name in HYBRID]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        start = torch.randint(0, V, (16, 1), generator=gen)
        stride = torch.randint(1, 4, (16, 1), generator=gen)
        ids = (start + stride * torch.arange(12)) % V
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)


def test_gradients_reach_every_parameter():
    model = tiny_model(tie_word_embeddings=False).train()
    ids = random_ids(2, 9)
    model(ids, labels=ids).loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not no_grad
    zero = [n for n, p in model.named_parameters()
            if n != "model.embeddings.weight" and p.grad.abs().sum() == 0]
    assert not zero, zero
    emb = model.model.embeddings.weight.grad
    used = ids[:, :-1].unique()  # the last position predicts nothing, so its token gets no gradient
    assert (emb[used].abs().sum(-1) > 0).all()


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = random_ids(2, 9)
    grads = []
    for checkpointing in (False, True):
        model = tiny_model().train()
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="checkpointing"):
        model(ids, use_cache=True)


def test_num_items_in_batch_sums_the_loss():
    model = tiny_model()
    ids = random_ids(2, 8)
    mean = model(ids, labels=ids).loss
    summed = model(ids, labels=ids, num_items_in_batch=7).loss
    torch.testing.assert_close(summed, mean * (2 * 7) / 7)


def test_dropout_is_active_in_training_and_off_in_eval():
    model = tiny_model(mlp_dropout=0.5, mixer_dropout=0.1, embedding_dropout=0.1, mlp_hidden_dropout=0.1)
    ids = random_ids(2, 6)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)
        model.train()
        assert not torch.equal(model(ids).logits, model(ids).logits)


def test_loss_is_shifted_next_token_cross_entropy():
    model = tiny_model()
    ids = random_ids(2, 8)
    out = model(ids, labels=ids)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ref)
    assert model(ids, logits_to_keep=1).logits.shape == (2, 1, V)


# -- parameter counting -------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count(tied):
    model = tiny_model(tie_word_embeddings=tied)
    count = count_parameters(model)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert count.total == sum(unique.values())
    assert count.embedding == V * D_MODEL * (1 if tied else 2)
    assert count.non_embedding == count.total - count.embedding
    # from formulas: the mixers' docstring formulas + 2 norms and a SwiGLU per block + the final norm
    inter = model.config.mlp_intermediate_size
    assert inter == 256  # 2/3 · 4 · 32 rounded up to a multiple of 256, as flash-linear-attention
    mixers = sum(layer.attn.num_parameters_formula() for layer in model.model.layers)
    assert count.non_embedding == mixers + 3 * (2 * D_MODEL + 3 * D_MODEL * inter) + D_MODEL
    assert count_parameters(model.model).non_embedding == count.non_embedding
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    frozen = count_parameters(model, trainable_only=True)
    assert frozen.total == count.total - sum(p.numel() for p in model.model.layers[0].parameters())


def test_parameter_count_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        count_parameters("model")


# -- bad configs and inputs ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(mixer="transformer", mixers=None), ValueError, "unknown mixer 'transformer'.*bayesian"),
        (dict(mixers=["bayesian", "nope", "attention"]), ValueError, r"mixers\[1\].*'nope'"),
        (dict(mixers=["bayesian", "attention"], num_hidden_layers=3), ValueError, "num_hidden_layers=3"),
        (dict(mixer_overrides={7: "bayesian"}), ValueError, "layer index 7"),
        (dict(mixer_overrides={"x": "bayesian"}), ValueError, "layer indices"),
        (dict(mixer_kwargs={"bayesian": {"layer_idx": 3}}), ValueError, "layer_idx"),
        (dict(mixer_kwargs={"bayesian": 3}), TypeError, "mixer_kwargs"),
        (dict(hidden_size=0), ValueError, "hidden_size"),
        (dict(head_dim=2.5), ValueError, "head_dim"),
        (dict(hidden_act="gelu"), ValueError, "hidden_act"),
        (dict(mlp_dropout=1.0), ValueError, "mlp_dropout"),
        (dict(norm_eps=-1.0), ValueError, "norm_eps"),
    ],
)
def test_bad_configs_raise_clear_errors(kwargs, error, match):
    base = dict(vocab_size=V, hidden_size=D_MODEL, num_hidden_layers=3, num_heads=HEADS, head_dim=HEAD_DIM,
                mixers=list(HYBRID))
    base.update(kwargs)
    with pytest.raises(error, match=match):
        BayesLayerConfig(**base)


@pytest.mark.parametrize(
    "overrides, match",
    [
        # expand_v = 1.3 with head_dim 8: a non-integer value head dim
        (dict(mixer_kwargs={"gated_deltanet": {"expand_v": 1.3}}), "expand_v"),
        # rotations pair up key channels: an odd head_dim cannot rotate
        (dict(head_dim=7, mixers=["bayesian"], mixer_kwargs={"bayesian": {"dynamics": "rotation"}}), "even head_dim"),
        # 3 noise groups cannot split m = 8 · 2 = 16 value columns
        (dict(mixer_kwargs={"bayesian": {"groups": 3}}), "groups=3"),
        (dict(layer_mixer_kwargs={0: {"no_such_option": 1}}), "no_such_option"),
    ],
)
def test_bad_mixer_arguments_fail_when_the_model_is_built(overrides, match):
    config = tiny_config(**overrides)
    with pytest.raises((ValueError, TypeError), match=match):
        BayesLayerForCausalLM(config)


def test_bad_inputs_raise_clear_errors():
    model = tiny_model()
    ids = random_ids(2, 5)
    with pytest.raises(TypeError, match="input_ids"):
        model(ids.float())
    with pytest.raises(ValueError, match="vocab_size"):
        model(ids + V)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(ids[0])
    with pytest.raises(ValueError, match="exactly one"):
        model(ids, inputs_embeds=torch.zeros(2, 5, D_MODEL))
    with pytest.raises(ValueError, match="exactly one"):
        model()
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(2, 5, D_MODEL + 1))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="only 0 and 1"):
        model(ids, attention_mask=torch.full((2, 5), 2))
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=ids[:, :3])
    with pytest.raises(TypeError, match="BayesLayerCache"):
        model(ids, cache=[None, None, None], use_cache=True)
    with pytest.raises(ValueError, match="layers"):
        model(ids, cache=BayesLayerCache(5), use_cache=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        model(ids, temperature=0.5)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=-1)
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="num_layers"):
        BayesLayerCache(0)


def test_base_model_returns_hidden_states():
    torch.manual_seed(0)
    base = BayesLayerModel(tiny_config()).eval()
    out = base(random_ids(2, 4), output_hidden_states=True)
    assert out.last_hidden_state.shape == (2, 4, D_MODEL)
    assert len(out.hidden_states) == 3 + 1
