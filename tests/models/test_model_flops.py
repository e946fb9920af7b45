"""The whole models' FLOP counts (``flops(batch_size, seq_len)``) against ``FlopCounterMode``: the language
model and the MQAR model in both layouts, within 10%, forward and backward."""

from __future__ import annotations

import pytest
import torch

from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM
from bayeslayer.models.mqar_model import MQARModel, MQARModelConfig
from bayeslayer.training.flop_counter import measure_training_flops

pytestmark = pytest.mark.usefixtures("no_opt_einsum")


def within(count, meas, rel=0.10):
    return all(abs(getattr(count, p) - getattr(meas.flops, p)) <= rel * getattr(meas.flops, p)
               for p in ("forward", "backward"))


@pytest.mark.parametrize("mixer, kwargs", [("bayesian", None), ("gated_deltanet", {"expand_v": 3.0}),
                                           ("mamba2", None), ("attention", None)])
def test_language_model_step(mixer, kwargs):
    torch.manual_seed(0)
    config = BayesLayerConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8,
                              mixer=mixer, mixer_kwargs={mixer: kwargs} if kwargs else None, use_cache=False)
    model = BayesLayerForCausalLM(config)
    ids = torch.randint(0, 200, (2, 48))
    meas = measure_training_flops(lambda: model(input_ids=ids, labels=ids).loss)
    assert within(model.flops(2, 48), meas), (model.flops(2, 48), meas.flops, meas.by_op)


@pytest.mark.parametrize("layout", ["stacked", "hybrid"])
@pytest.mark.parametrize("mixer, kwargs", [("bayesian", {"use_gate": False}),
                                           ("gated_deltanet", {"use_short_conv": False}),
                                           ("mamba2", {"state_size": 4})])
def test_mqar_model_step(layout, mixer, kwargs):
    torch.manual_seed(0)
    cfg = MQARModelConfig(mixer, vocab_size=24, width=16, num_layers=2, mlp_mult=2 if layout == "stacked" else 0,
                          mixer_kwargs={"num_heads": 2, "head_dim": 8, "chunk_size": 16, **kwargs}, layout=layout)
    model = MQARModel(cfg)
    ids = torch.randint(0, 24, (3, 40))
    labels = torch.randint(0, 24, (3, 40))
    meas = measure_training_flops(
        lambda: torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten()))
    assert within(model.flops(3, 40), meas), (model.flops(3, 40), meas.flops, meas.by_op)


def test_bad_sizes_are_named():
    model = BayesLayerForCausalLM(BayesLayerConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_heads=2,
                                                   head_dim=8, use_cache=False))
    with pytest.raises(ValueError, match="seq_len"):
        model.flops(1, 0)
    mqar = MQARModel(MQARModelConfig("gated_deltanet", 16, 16, mixer_kwargs={"num_heads": 2, "head_dim": 8}))
    with pytest.raises(ValueError, match="batch_size"):
        mqar.flops(-1, 8)
