"""BayesLayerConfig(backend=...): saved in config.json; a forced-Triton language model runs the
chunk kernel for every Bayesian Layer's prefill and the fused step kernel for every cached decoding
step of ``generate`` (never PyTorch), with the PyTorch model's logits and tokens.
Kernels run in Triton's interpreter (tests/conftest.py); tiny shapes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM
from bayeslayer.ops import BackendError
from bayeslayer.ops.bayesian_layer import triton_support as support

from ..triton_spy import triton_only

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not support.triton_installed(),
    reason="the kernels run here only in Triton's interpreter (TRITON_INTERPRET=1, Triton installed)",
)
V = 48


def config(mixers, **overrides) -> BayesLayerConfig:
    kw = dict(vocab_size=V, hidden_size=16, num_hidden_layers=len(mixers), num_heads=2, head_dim=8,
              mixers=list(mixers), mixer_kwargs={"bayesian": {"chunk_size": 16}}, bos_token_id=None,
              eos_token_id=None)
    kw.update(overrides)
    return BayesLayerConfig(**kw)


def pair(mixers):
    torch.manual_seed(0)
    tri = BayesLayerForCausalLM(config(mixers, backend="triton")).double().eval()
    ref = BayesLayerForCausalLM(config(mixers, backend="torch")).double().eval()
    ref.load_state_dict(tri.state_dict())
    return tri, ref


def test_backend_is_a_config_field_saved_in_config_json(tmp_path):
    assert config(["bayesian"]).backend == "auto"
    cfg = config(["bayesian"], backend="triton")
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["backend"] == "triton"
    assert BayesLayerConfig.from_pretrained(tmp_path).backend == "triton"
    # a config.json written before the field existed loads as "auto"
    data = json.loads((tmp_path / "config.json").read_text())
    del data["backend"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert BayesLayerConfig.from_pretrained(tmp_path).backend == "auto"
    with pytest.raises(ValueError, match="backend must be one of"):
        config(["bayesian"], backend="cuda")


def test_model_passes_the_backend_to_the_mixers_with_a_kernel():
    model = BayesLayerForCausalLM(config(["bayesian", "gated_deltanet", "attention"], backend="torch"))
    assert [getattr(layer.attn, "backend", None) for layer in model.model.layers] == ["torch", "auto", None]
    # the config's backend is the one place: a second one in the mixer kwargs is refused, naming both
    with pytest.raises(ValueError, match=r"mixer_kwargs\['bayesian'\] may not set 'backend'.*backend='torch'"):
        config(["bayesian"], backend="torch", mixer_kwargs={"bayesian": {"chunk_size": 16, "backend": "auto"}})
    with pytest.raises(ValueError, match=r"layer_mixer_kwargs\[0\] may not set 'backend'"):
        config(["bayesian"], layer_mixer_kwargs={0: {"backend": "triton"}})


def test_forced_triton_model_without_a_kernel_is_refused():
    with pytest.raises(BackendError, match=r"none of the model's mixers \['attention', 'gated_deltanet'\]"):
        BayesLayerForCausalLM(config(["gated_deltanet", "attention"], backend="triton"))
    with pytest.raises(BackendError, match="rotation dynamics"):
        BayesLayerForCausalLM(config(["bayesian"], backend="triton",
                                     mixer_kwargs={"bayesian": {"chunk_size": 16, "dynamics": "rotation"}}))


@interpreter
def test_forced_triton_prefill_and_generate_run_the_kernels_and_equal_torch():
    mixers = ["bayesian", "attention", "bayesian"]
    tri, ref = pair(mixers)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), triton_only() as calls:
        out = tri(ids, use_cache=True, output_variances=True)
    assert calls == {"chunk": 2}, f"prefill: Triton entry points called {dict(calls)}"
    with torch.no_grad():
        exp = ref(ids, use_cache=True, output_variances=True)
    torch.testing.assert_close(out.logits, exp.logits, rtol=1e-9, atol=1e-9)
    for a, b in zip(out.variances, exp.variances, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for idx in (0, 2):
        for a, b in zip(out.cache[idx]["recurrent"], exp.cache[idx]["recurrent"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)

    new = 3
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
               return_dict_in_generate=True, output_scores=True, pad_token_id=0)
    with triton_only() as calls:
        res = tri.generate(ids, **gen)
    # the prompt is one chunked prefill per Bayesian Layer, every further token one fused step each
    assert calls == {"chunk": 2, "step": 2 * (new - 1)}, f"generate: Triton entry points called {dict(calls)}"
    res_ref = ref.generate(ids, **gen)
    assert torch.equal(res.sequences, res_ref.sequences)
    for a, b in zip(res.scores, res_ref.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
