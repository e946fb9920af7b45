"""benchmarks/mqar_diagnostics.py: parameter groups, and one tiny run whose record holds sane statistics."""

from __future__ import annotations

import json

import pytest

from .benchmark_scripts import loaded_benchmark


@pytest.fixture(scope="module")
def diag():
    yield from loaded_benchmark("mqar_diagnostics")


def test_group_of_names_every_parameter(diag):
    from dataclasses import replace

    from bayeslayer.experiments.mqar import PRESETS, MQARModel, model_config

    for mixer in ("bayesian", "gated_deltanet"):
        cfg, _ = model_config(mixer, replace(PRESETS["tiny"]), 16)
        groups = {diag.group_of(n) for n, _ in MQARModel(cfg).named_parameters()}
        assert not any(g.endswith(".other") for g in groups), groups
        assert {"embed", "head", "norms", "L0.k_proj", "L1.o_proj"} <= groups
        assert ("L0.noise" in groups) == (mixer == "bayesian") and ("L0.beta" in groups) == (mixer != "bayesian")


def test_parse_set_rejects_bad_items(diag):
    assert diag.parse_set(["r2_init=0.5", "use_gate=False"]) == {"r2_init": 0.5, "use_gate": False}
    with pytest.raises(SystemExit, match="name=value"):
        diag.parse_set(["r2_init"])
    with pytest.raises(SystemExit, match="not a Python literal"):
        diag.parse_set(["r2_init=abc"])


def test_tiny_run_writes_a_record_with_gains_in_range(diag, tmp_path):
    import torch

    threads = torch.get_num_threads()  # the script pins its threads (--threads, default 1)
    out = tmp_path / "d.json"
    try:
        code = diag.main(["--preset", "tiny", "--mixer", "bayesian", "--max-steps", "2", "--every", "1",
                          "--probe", "2", "--init-alpha", "0.9", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    rec = json.loads(out.read_text())
    assert rec["provenance"] and rec["steps"] == 2 and len(rec["log"]["loss"]) == 2
    assert rec["overrides"] == {"init_alpha": 0.9}
    first = rec["probes"][0]["layers"][0]
    assert 0.89 < first["alpha"]["p50"] < 0.91  # the input-dependent part of the decay starts small
    for layer in rec["probes"][-1]["layers"]:
        assert 0 < layer["gain"]["min"] <= layer["gain"]["max"] < 1
        assert layer["trace_P_over_D"]["min"] > 0 and layer["r2"]["min"] > 0 and layer["ell2"]["min"] > 0
    png = tmp_path / "loss.png"
    assert diag.main(["--plot", str(png), str(out)]) == 0 and png.stat().st_size > 0
