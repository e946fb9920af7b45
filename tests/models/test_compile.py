"""The language model under ``torch.compile(fullgraph=True)`` and ``torch.func.vmap``: the training forward
(loss and logits) and its backward.  The default run compiles a two-layer model (Bayesian Layer, Gated
DeltaNet) with ``aot_eager`` (``fullgraph=True`` fails at any graph break); the ``slow`` run traces a model with
one layer of every mixer with ``torch._dynamo.explain`` and compiles it with Inductor (a cold compile of it
takes minutes)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from .test_packed import VOCAB, hybrid, relative


def training_step(model):
    def run(ids):
        out = model(input_ids=ids, labels=ids)
        return out.loss, out.logits

    return run


SMALL = ("bayesian", "gated_deltanet")


@pytest.mark.slow
def test_model_with_every_mixer_has_no_graph_break():
    model = hybrid(torch.float32).train()
    torch._dynamo.reset()
    report = torch._dynamo.explain(training_step(model))(torch.randint(0, VOCAB, (2, 10)))
    assert report.graph_break_count == 0, [str(b.reason)[:300] for b in report.break_reasons]
    assert report.graph_count == 1


@pytest.mark.parametrize("names, backend", [(SMALL, "aot_eager"),
                                            pytest.param(None, "inductor", marks=pytest.mark.slow)])
def test_compiled_model_equals_eager(names, backend):
    model = hybrid(torch.float32, names=names).train()
    ids = torch.randint(0, VOCAB, (2, 10))
    params = list(model.parameters())
    step = training_step(model)
    loss, logits = step(ids)
    grads = torch.autograd.grad(loss, params)
    torch._dynamo.reset()
    c_loss, c_logits = torch.compile(step, fullgraph=True, backend=backend)(ids)
    c_grads = torch.autograd.grad(c_loss, params)
    assert relative(c_loss, loss) <= 1e-5 and relative(c_logits, logits) <= 1e-5
    for g, ref in zip(c_grads, grads, strict=True):
        assert relative(g, ref) <= 1e-5


def test_vmap_over_the_batch_and_per_example_gradients():
    model = hybrid().eval()  # every mixer
    ids = torch.randint(0, VOCAB, (3, 9))
    logits = torch.func.vmap(lambda i: model(input_ids=i[None], use_cache=False).logits[0])(ids)
    assert relative(logits, model(input_ids=ids, use_cache=False).logits) <= 1e-12
    params = dict(model.named_parameters())

    def loss(p, i):
        return torch.func.functional_call(model, p, (i[None],), {"labels": i[None], "use_cache": False}).loss

    per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, ids)
    for b in range(ids.shape[0]):
        ref = torch.autograd.grad(loss(params, ids[b]), list(params.values()))
        for name, g in zip(params, ref, strict=True):
            assert relative(per_example[name][b], g) <= 1e-12


def test_position_ids_need_host_reads_so_compiled_code_is_told_to_pass_cu_seqlens(monkeypatch):
    """Finding documents in ``position_ids`` reads them; where values cannot be read (torch.compile, vmap) a
    ``position_ids`` of more than one token is refused with what to pass instead."""
    from bayeslayer.models import packing

    model = hybrid().eval()
    monkeypatch.setattr(packing, "can_read_values", lambda: False)
    with pytest.raises(ValueError, match="pass cu_seqlens"):
        model(input_ids=torch.randint(0, VOCAB, (1, 6)), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    # one token (a decoding step) reads nothing
    model(input_ids=torch.randint(0, VOCAB, (1, 1)), position_ids=torch.tensor([[4]]))
