"""The language model under ``torch.compile(fullgraph=True)`` and ``torch.func.vmap``: the training forward
(loss, logits and the Bayesian Layers' predictive variances) and its backward.  The default run compiles a
two-layer model (Bayesian Layer, Gated DeltaNet) with ``aot_eager`` (``fullgraph=True`` fails at any graph break):
Dynamo's full graph plus AOTAutograd's backward graph, which is also the default suite's compile of the Bayesian
Layer with its variances (tests/layers/test_compile.py compiles none); the ``slow`` run traces a model with one
layer of every mixer with ``torch._dynamo.explain`` and compiles it with Inductor (a cold compile of it takes
minutes)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from .test_packed import VOCAB, hybrid, relative


def training_step(model):
    def run(ids):
        out = model(input_ids=ids, labels=ids, output_variances=True)
        return out.loss, out.logits, *(v for v in out.variances if v is not None)

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
    torch._dynamo.reset()
    for run in (step, torch.compile(step, fullgraph=True, backend=backend)):
        outs = run(ids)
        # the variances enter the objective too, so that their backward is in the compiled graph
        objective = outs[0] + sum((v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum() for v in outs[2:])
        grads = torch.autograd.grad(objective, params)
        if run is step:
            ref_outs, ref_grads = outs, grads
    assert len(outs) > 2  # loss, logits and the Bayesian Layer's variances
    for out, ref in zip(outs, ref_outs, strict=True):
        assert relative(out, ref) <= 1e-5
    for g, ref in zip(grads, ref_grads, strict=True):
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
