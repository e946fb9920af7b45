"""Loading a flash-linear-attention Gated DeltaNet checkpoint (HF format) into our model.

The checkpoint is made by flash-linear-attention itself (construction and ``save_pretrained``
work on a CPU; its Triton kernels do not run here, so the reference forward below is written
from its pure-PyTorch ``naive_recurrent_gated_delta_rule`` and the checkpoint's own weights).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from bayeslayer.models import BayesLayerForCausalLM, gdn_config_to_bayeslayer, load_gdn_checkpoint

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Triton is not supported on current platform"
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

V, D_MODEL, HEADS, HEAD_DIM, LAYERS = 80, 32, 2, 8, 2


def fla_model(seed: int = 0, **overrides) -> GatedDeltaNetForCausalLM:
    kwargs = dict(vocab_size=V, hidden_size=D_MODEL, num_hidden_layers=LAYERS, num_heads=HEADS,
                  head_dim=HEAD_DIM, expand_v=2, hidden_ratio=2, fuse_norm=False, fuse_swiglu=False,
                  fuse_cross_entropy=False)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = GatedDeltaNetForCausalLM(GatedDeltaNetConfig(**kwargs))
    with torch.no_grad():  # fla initialises norm weights to 1; perturb them so a skipped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gdn")
    model = fla_model()
    model.save_pretrained(directory)
    return directory, model


# -- an independent reference forward from the fla checkpoint's weights -------------------------------
def causal_silu_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv ``[B, T, C]`` with ``weight [C, 1, W]``, then SiLU."""
    W = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), weight, groups=x.shape[-1])
    return F.silu(y.transpose(1, 2))


def reference_gdn_layer(attn, x: torch.Tensor) -> torch.Tensor:
    """fla's GatedDeltaNet forward (chunk kernel replaced by the naive recurrence), from its weights."""
    B, T, _ = x.shape
    if attn.use_short_conv:
        q = causal_silu_conv(attn.q_proj(x), attn.q_conv1d.weight)
        k = causal_silu_conv(attn.k_proj(x), attn.k_conv1d.weight)
        v = causal_silu_conv(attn.v_proj(x), attn.v_conv1d.weight)
    else:
        q, k, v = F.silu(attn.q_proj(x)), F.silu(attn.k_proj(x)), F.silu(attn.v_proj(x))
    q, k, v = q.view(B, T, HEADS, HEAD_DIM), k.view(B, T, HEADS, HEAD_DIM), v.view(B, T, HEADS, -1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)  # use_qk_l2norm_in_kernel
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(attn.b_proj(x)) * (2 if attn.allow_neg_eigval else 1)
    g = -attn.A_log.float().exp() * F.softplus(attn.a_proj(x).float() + attn.dt_bias)
    o, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=HEAD_DIM ** -0.5)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + attn.o_norm.eps) * attn.o_norm.weight
    if attn.use_gate:
        o = o * F.silu(attn.g_proj(x).view(B, T, HEADS, -1))
    return attn.o_proj(o.reshape(B, T, -1))


def reference_lm_logits(model: GatedDeltaNetForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    h = model.model.embeddings(ids)
    for block in model.model.layers:
        h = h + reference_gdn_layer(block.attn, block.attn_norm(h))
        mlp = block.mlp
        n = block.mlp_norm(h)
        h = h + mlp.down_proj(F.silu(mlp.gate_proj(n)) * mlp.up_proj(n))
    return model.lm_head(model.model.norm(h))


# -- tests --------------------------------------------------------------------------------------------
def test_every_checkpoint_tensor_is_consumed(checkpoint):
    directory, fla = checkpoint
    ours = load_gdn_checkpoint(directory)
    assert isinstance(ours, BayesLayerForCausalLM)
    assert ours.config.layer_mixers == ["gated_deltanet"] * LAYERS
    saved = load_file(str(directory / "model.safetensors"))
    state = ours.state_dict()
    assert set(saved) == set(state), (set(saved) ^ set(state))
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.filterwarnings("ignore:ShortConvolution is crucial")
@pytest.mark.parametrize("variant", ["default", "allow_neg_eigval", "no_gate", "no_conv"])
def test_one_layer_matches_a_naive_gated_delta_rule_forward(checkpoint, tmp_path, variant):
    directory, fla = checkpoint
    if variant != "default":
        option = {"allow_neg_eigval": {"allow_neg_eigval": True}, "no_gate": {"use_gate": False},
                  "no_conv": {"use_short_conv": False}}[variant]
        fla = fla_model(seed=1, **option)
        fla.save_pretrained(tmp_path)
        directory = tmp_path
    ours = load_gdn_checkpoint(directory)
    x = torch.randn(2, 13, D_MODEL, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = ours.model.layers[1].attn(x).o
        want = reference_gdn_layer(fla.model.layers[1].attn, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_whole_model_logits_and_decoding_match_the_reference(checkpoint):
    directory, fla = checkpoint
    ours = load_gdn_checkpoint(directory)
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, reference_lm_logits(fla, ids), rtol=1e-4, atol=1e-5)
        # decoding runs on the recurrent cache (prefill, then one token per step); the logits of every
        # step must be the reference's full forward over the same tokens
        # (an explicit mask: generate() would otherwise take a prompt token 0 = pad_token_id for padding)
        res = ours.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ref = reference_lm_logits(fla, res.sequences)
    steps = torch.stack(res.logits, dim=1)  # [B, 4, V]: predictions from positions 9, 10, 11, 12
    torch.testing.assert_close(steps, ref[:, 9:13], rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:ShortConvolution is crucial")
def test_tied_and_no_conv_checkpoints_load(tmp_path):
    fla = fla_model(tie_word_embeddings=True, use_short_conv=False)
    fla.save_pretrained(tmp_path)
    ours = load_gdn_checkpoint(tmp_path)
    assert ours.config.layer_mixers == ["gated_deltanet_noconv"] * LAYERS
    assert ours.lm_head.weight is ours.model.embeddings.weight
    assert torch.equal(ours.model.embeddings.weight, fla.model.embeddings.weight)


def test_a_pytorch_bin_checkpoint_is_refused_before_torch_reads_it(checkpoint, tmp_path, monkeypatch):
    """A pickle can run code when unpickled (weights_only=True narrows it, but still unpickles): only
    safetensors weights are read."""
    directory, fla = checkpoint
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    torch.save(fla.state_dict(), tmp_path / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load read the pickle"))
    with pytest.raises(ValueError, match=r"pytorch_model\.bin, a pickle"):
        load_gdn_checkpoint(tmp_path)


def test_a_sharded_safetensors_checkpoint_loads(checkpoint, tmp_path):
    _, fla = checkpoint
    fla.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours = load_gdn_checkpoint(tmp_path)
    state = ours.state_dict()
    assert all(torch.equal(state[k], v) for k, v in fla.state_dict().items())


def _copy_with_weights(directory, target, weights):
    (target / "config.json").write_text((directory / "config.json").read_text())
    save_file(weights, str(target / "model.safetensors"))


def test_unmatched_tensors_raise_an_error_that_lists_them(checkpoint, tmp_path):
    directory, _ = checkpoint
    weights = load_file(str(directory / "model.safetensors"))
    extra = dict(weights, **{"model.layers.0.attn.mystery.weight": torch.zeros(3)})
    (tmp_path / "extra").mkdir()
    _copy_with_weights(directory, tmp_path / "extra", extra)
    with pytest.raises(ValueError, match="no place in the model.*mystery"):
        load_gdn_checkpoint(tmp_path / "extra")

    missing = {k: v for k, v in weights.items() if k != "model.layers.1.attn.b_proj.weight"}
    (tmp_path / "missing").mkdir()
    _copy_with_weights(directory, tmp_path / "missing", missing)
    with pytest.raises(ValueError, match=r"missing from the checkpoint.*layers\.1\.attn\.b_proj"):
        load_gdn_checkpoint(tmp_path / "missing")

    wrong = dict(weights, **{"model.norm.weight": torch.ones(D_MODEL + 1)})
    (tmp_path / "shape").mkdir()
    _copy_with_weights(directory, tmp_path / "shape", wrong)
    with pytest.raises(ValueError, match=r"shapes differ.*model\.norm\.weight"):
        load_gdn_checkpoint(tmp_path / "shape")


def test_bad_checkpoints_and_configs_raise(checkpoint, tmp_path):
    directory, _ = checkpoint
    config = json.loads((directory / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type 'gated_deltanet'"):
        gdn_config_to_bayeslayer(dict(config, model_type="llama"))
    with pytest.raises(ValueError, match="output_gate_activation"):
        gdn_config_to_bayeslayer(dict(config, output_gate_activation="sigmoid"))
    with pytest.raises(ValueError, match="attnres_block_size"):
        gdn_config_to_bayeslayer(dict(config, attnres_block_size=2))
    with pytest.raises(ValueError, match="hybrid softmax-attention"):
        gdn_config_to_bayeslayer(dict(config, attn={"layers": [0], "num_heads": 2}))
    with pytest.raises(ValueError, match="num_v_heads"):
        gdn_config_to_bayeslayer(dict(config, num_v_heads=4))
    with pytest.raises(TypeError, match="dict"):
        gdn_config_to_bayeslayer("config.json")
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        load_gdn_checkpoint(tmp_path / "does-not-exist")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_gdn_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_gdn_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="is a file"):
        load_gdn_checkpoint(tmp_path / "config.json")
    with pytest.raises(TypeError, match="dtype"):
        load_gdn_checkpoint(directory, dtype=torch.int64)


def test_dtype_and_mixer_kwargs_follow_the_checkpoint(checkpoint):
    directory, fla = checkpoint
    ours = load_gdn_checkpoint(directory, dtype=torch.float64)
    assert ours.lm_head.weight.dtype == torch.float64
    attn = ours.model.layers[0].attn
    assert attn.head_v_dim == 2 * HEAD_DIM and attn.conv_size == fla.config.conv_size
    assert attn.o_norm.eps == fla.model.layers[0].attn.o_norm.eps
