"""``import bayeslayer`` alone registers the model with ``transformers``' Auto classes, without importing
``transformers`` itself (``bayeslayer/autoregister.py``).  Each case runs in a fresh interpreter, so that no
import of an earlier test can hide a missing registration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .model_folders import tiny_model

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
order, model_dir = sys.argv[1], sys.argv[2]
report = {}
if order == "transformers first":
    from transformers import AutoModelForCausalLM
import bayeslayer
report["transformers_after_import"] = "transformers" in sys.modules
report["models_after_import"] = "bayeslayer.models" in sys.modules
import torch
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
report["config"] = type(config).__module__ + "." + type(config).__name__
report["model"] = type(model).__module__ + "." + type(model).__name__
with torch.no_grad():
    report["logits"] = model(torch.arange(6)[None]).logits[0, -1, :4].tolist()
print(json.dumps(report))
"""


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("order", ["bayeslayer alone", pytest.param("transformers first", marks=pytest.mark.slow)])
def test_import_bayeslayer_then_auto_model_from_pretrained(tmp_path, order):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    run = run_child(CHILD, order, str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["config"] == "bayeslayer.models.configuration.BayesLayerConfig"
    assert report["model"] == "bayeslayer.models.modeling.BayesLayerForCausalLM"
    if order == "bayeslayer alone":  # registration waited for transformers' Auto classes
        assert not report["transformers_after_import"] and not report["models_after_import"]
    with torch.no_grad():
        expected = model(torch.arange(6)[None]).logits[0, -1, :4]
    torch.testing.assert_close(torch.tensor(report["logits"]), expected, rtol=1e-6, atol=1e-6)


def test_import_bayeslayer_without_transformers():
    """transformers is an optional dependency: the ops, designs and layers import and run without it."""
    code = ("import sys; sys.modules['transformers'] = None\n"  # any import of it now fails
            "import torch, bayeslayer\nfrom bayeslayer.layers import build_mixer\n"
            "print(tuple(build_mixer('bayesian', 16, num_heads=2, head_dim=8)(torch.randn(1, 3, 16)).o.shape))")
    run = run_child(code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "(1, 3, 16)"
