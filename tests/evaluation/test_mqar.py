"""MQAR query accuracy (bayeslayer.evaluation.mqar): per-slice counts add up to the whole."""

import torch

from bayeslayer.data.mqar import MQARTask
from bayeslayer.evaluation.mqar import query_counts


def test_query_counts_slices_add_up():
    data = MQARTask("update", 32, 4, 3).generate(10, vocab_size=32, seed=0)

    class Oracle(torch.nn.Module):  # predicts the label wherever there is one, token 0 elsewhere
        def forward(self, x):
            idx = data.inputs.eq(x[:1]).all(1).nonzero()[0, 0]
            lab = data.labels[idx : idx + x.shape[0]].clamp_min(0)
            return torch.nn.functional.one_hot(lab, 32).float()

    r = query_counts(Oracle(), data, 5, {"writes": data.query_writes})
    assert r["accuracy"] == 1.0 and r["queries"] == 40
    assert sum(s["queries"] for s in r["slices"]["writes"].values()) == 40
    assert 0 not in r["slices"]["writes"]  # only query positions are counted
