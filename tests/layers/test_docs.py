"""docs/layers.md stays true: its snippet runs and its size table is the benchmark script's output."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "layers.md"


def test_usage_snippet_runs(capsys):
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(code) == 1
    torch.manual_seed(0)
    exec(compile(code[0], str(DOC), "exec"), {"__name__": "docs_layers"})
    printed = capsys.readouterr().out
    assert "torch.Size([2, 50, 2, 1])" in printed and "['b_proj.weight']" in printed


def test_size_table_is_the_script_output():
    spec = importlib.util.spec_from_file_location("layer_sizes", ROOT / "benchmarks" / "layer_sizes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = module.table(512, 4, 128)
    text = DOC.read_text()
    for line in lines:
        assert line in text, f"docs/layers.md is out of date; rerun benchmarks/layer_sizes.py: {line}"
