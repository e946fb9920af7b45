"""Plain ``transformers`` loads a bayeslayer directory in an interpreter that never imported bayeslayer,
after the opt-in :func:`export_auto_map`, and gives the same logits; without it (or without
``trust_remote_code=True``) transformers refuses, and with bayeslayer imported the shim is ignored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bayeslayer.evaluation import AUTO_MAP, SHIM_FILE, export_auto_map
from bayeslayer.models import BayesLayerForCausalLM

from .conftest import OFFLINE

CHILD = r"""
import json, sys
from pathlib import Path
attempts, ids_file, out_dir = json.loads(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
assert "bayeslayer" not in sys.modules
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
results = []
for i, (model_dir, trust) in enumerate(attempts):
    before = "bayeslayer" in sys.modules
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust)
        model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=trust).eval()
    except Exception as err:  # what a user sees
        results.append({"bayeslayer_before": before, "error": f"{type(err).__name__}: {err}"})
        continue
    with torch.no_grad():
        logits = model(load_file(ids_file)["ids"]).logits
    save_file({"logits": logits.contiguous()}, out_dir / f"logits_{i}.safetensors")
    results.append({"bayeslayer_before": before, "model_type": config.model_type,
                    "config": type(config).__module__ + "." + type(config).__name__,
                    "model": type(model).__module__ + "." + type(model).__name__})
(out_dir / "results.json").write_text(json.dumps(results))
"""


def _run_child(tmp_path: Path, attempts: list[tuple[Path, bool]], ids: torch.Tensor) -> list[dict]:
    """Load each ``(directory, trust_remote_code)`` in order in one fresh interpreter."""
    save_file({"ids": ids}, tmp_path / "ids.safetensors")
    # PYTHONPATH makes this checkout the "installed" bayeslayer the shim imports (CI installs it
    # editable anyway); the child itself never imports it.
    env = {**os.environ, **OFFLINE, "HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps([(str(d), t) for d, t in attempts]),
                          str(tmp_path / "ids.safetensors"), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((tmp_path / "results.json").read_text())


def test_plain_transformers_loads_an_exported_directory_without_importing_bayeslayer(tmp_path, bl_dir,
                                                                                      retrofit_dir):
    from safetensors.torch import load_file

    model_dir = tmp_path / "model"
    model = BayesLayerForCausalLM.from_pretrained(retrofit_dir).eval()   # a retrofitted GDN: a BL + GDN hybrid
    model.save_pretrained(model_dir)
    shim = export_auto_map(model_dir)
    assert shim.name == SHIM_FILE and json.loads((model_dir / "config.json").read_text())["auto_map"] == AUTO_MAP
    assert export_auto_map(model_dir) == shim  # idempotent
    ids = torch.randint(0, model.config.vocab_size, (2, 37))
    with torch.no_grad():
        expected = model(ids).logits

    not_exported, not_trusted, loaded = _run_child(tmp_path, [(bl_dir, True), (model_dir, False), (model_dir, True)],
                                                   ids)
    assert "bayeslayer" in not_exported["error"], not_exported   # transformers does not know the model type
    assert "trust_remote_code" in not_trusted["error"], not_trusted  # the shim runs only when asked to
    assert not loaded["bayeslayer_before"], "bayeslayer was imported before from_pretrained"
    assert loaded["model_type"] == "bayeslayer", loaded
    assert loaded["model"].endswith("BayesLayerForCausalLM") and loaded["config"].endswith("BayesLayerConfig")
    torch.testing.assert_close(load_file(tmp_path / "logits_2.safetensors")["logits"], expected, rtol=0, atol=0)

    # With bayeslayer imported (the registered classes) the directory loads without trusting its code.
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert type(again) is BayesLayerForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, expected, rtol=0, atol=0)


def test_bad_export_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        export_auto_map(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gated_deltanet"}))
    with pytest.raises(ValueError, match="gated_deltanet"):
        export_auto_map(tmp_path)
