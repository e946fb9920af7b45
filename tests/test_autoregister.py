"""``import bayeslayer`` alone registers the model with ``transformers``' Auto classes, without importing
``transformers`` itself (``bayeslayer/autoregister.py``), and the ops and layers run without ``transformers``.
Each case runs in a fresh interpreter, so that no import of an earlier test can hide a missing registration;
the default one checks both in one interpreter, in the order a user without and then with ``transformers`` meets
them: ``import bayeslayer`` (nothing of ``transformers`` or of ``bayeslayer.models`` imported), a layer built and
run while any import of ``transformers`` fails, then ``transformers`` imported and the Auto classes used."""

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
if order == "bayeslayer alone":  # the ops and layers import and run while any import of transformers fails
    sys.modules["transformers"] = None
    from bayeslayer.layers import build_mixer
    report["mixer_without_transformers"] = list(build_mixer("bayesian", 16, num_heads=2, head_dim=8)(
        torch.randn(1, 3, 16)).o.shape)
    report["transformers_after_mixer"] = sys.modules.pop("transformers") is not None
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


def child_report(folder: Path, order: str) -> tuple[dict, torch.nn.Module]:
    """What :data:`CHILD` saw in its fresh interpreter, and the tiny model it loaded from ``folder``."""
    model = tiny_model()
    model.save_pretrained(folder)
    run = run_child(CHILD, order, str(folder))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), model


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The default child: ``import bayeslayer``, a layer without transformers, then the Auto classes."""
    return child_report(tmp_path_factory.mktemp("alone"), "bayeslayer alone")


@pytest.mark.parametrize("order", ["bayeslayer alone", pytest.param("transformers first", marks=pytest.mark.slow)])
def test_import_bayeslayer_then_auto_model_from_pretrained(tmp_path, order, request):
    report, model = request.getfixturevalue("alone") if order == "bayeslayer alone" else child_report(tmp_path, order)
    assert report["config"] == "bayeslayer.models.configuration.BayesLayerConfig"
    assert report["model"] == "bayeslayer.models.modeling.BayesLayerForCausalLM"
    if order == "bayeslayer alone":  # registration waited for transformers' Auto classes
        assert not report["transformers_after_import"] and not report["models_after_import"]
    with torch.no_grad():
        expected = model(torch.arange(6)[None]).logits[0, -1, :4]
    torch.testing.assert_close(torch.tensor(report["logits"]), expected, rtol=1e-6, atol=1e-6)


def test_import_bayeslayer_without_transformers(alone):
    """transformers is an optional dependency: bayeslayer imports without importing it, and the ops, designs and
    layers import and run while any import of it fails (the default child, before it imports transformers)."""
    report = alone[0]
    assert not report["transformers_after_import"]
    assert report["mixer_without_transformers"] == [1, 3, 16] and not report["transformers_after_mixer"]
