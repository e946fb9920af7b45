"""``benchmarks/cost_model.py``: its counts at small shapes checked by hand, the time formula on hand-made launches,
the calibration reproducing the measurements it was fitted on, and argument validation."""

from __future__ import annotations

import math
import sys

import pytest

from .benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def cm():
    module = load_benchmark("cost_model")
    yield module
    sys.modules.pop(module.__name__, None)


def test_step_counts_by_hand(cm):
    # D = 16, C = 16: Y = K̃P 2·16·16² = 8192, S = YK̃ᵀ 2·16²·16 = 8192, LDLᵀ + L⁻¹ 2·16³/3, L⁻¹Y 8192, P update 8192
    assert cm.cov_step_flops(16, 16) == pytest.approx(4 * 8192 + 2 * 4096 / 3)
    assert cm.track_step_flops(16, 16) == 6 * 16 * 256
    assert cm.segment_step_flops(16) == pytest.approx(2 * 4096 / 3 + 8 * 4096)
    # segments as the forward chooses them: one up to T = 4096; 264 / 32 chains -> 8; after the cuts one wave
    assert cm.segments(1, 128, 16) == 1 and cm.segments(32, 8192, 64) == 8
    assert cm.cut_segments(32, 8192, 64) == 4 and cm.cut_segments(128, 8192, 64) == 1
    assert cm.cut_segments(1, 128, 64) == 0 + 1  # 2 chunks: none shorter than 4 chunks


def test_forward_launches_by_hand(cm):
    B, H, T, D, C = 1, 1, 128, 16, 16  # one chain, 8 chunks, one segment: no Phase A or B
    tok, F = 128, cm.cov_step_flops(16, 16)
    built = {x.name: x for x in cm.bl_forward(B, H, T, D, C, "built")}
    assert not any("Phase A" in n or n == "phase_b" for n in built)
    cov = built["cov (Phase C)"]
    assert cov.flops == {"ffma_fp32": pytest.approx(tok / C * F)}
    assert (cov.programs, cov.steps, cov.kind) == (1, 8, "cov")
    assert cov.bytes == tok * (8 * D + 4 * C + 16 + 4 * D + 4 * C)  # q, k, prep in; W, L⁻¹ out (fp32)
    cuts = {x.name: x for x in cm.bl_forward(B, H, T, D, C, "cuts")}
    assert cuts["cov (Phase C)"].flops == {"tc_tf32": pytest.approx(3 * tok / C * F)}  # three TF32 passes
    assert cuts["cov (Phase C)"].bytes == tok * (8 * D + 4 * C + 16 + 2 * D + 4 * C)  # W in bf16
    assert not any(n.startswith("casts to bf16") for n in cuts)
    gdn = {x.name: x for x in cm.gdn_forward(B, H, T, D, C)}
    assert gdn["fwd_h"].flops == {"tc_bf16": tok * 4 * D * D} and gdn["fwd_h"].steps == 8
    assert gdn["fwd_h"].programs == 1  # D = 16 < one value tile


def test_phase_a_covers_all_but_the_last_segment(cm):
    B, H, T, D, C = 2, 16, 8192, 64, 64  # 32 chains, 128 chunks, 8 segments of 16 chunks
    launches = {x.name: x for x in cm.bl_forward(B, H, T, D, C, "built")}
    a = launches["cov (Phase A, float64)"]
    tok = B * H * T
    assert a.flops == {"tc_fp64": pytest.approx(tok * 7 / 8 / C * cm.cov_step_flops(D, C))}
    assert (a.programs, a.steps) == (32 * 7, 16)
    assert launches["phase_b"].steps == 8 and launches["phase_b"].programs == 32
    assert launches["cov (Phase C)"].programs == 256 and launches["cov (Phase C)"].steps == 16
    bwd = {x.name: x for x in cm.bl_backward(B, H, T, D, C, "built")}
    b2 = bwd["B2 segment adjoint (replay)"]
    assert b2.flops == {"ffma_fp32": pytest.approx(3 * tok / C * cm.cov_step_flops(D, C))}
    assert all(x.backward for x in bwd.values())


def test_launch_time_formula(cm):
    cal = cm.Calibration(t0={"cov": 1e-5}, eff_serial=0.1, host_per_op=0.0)
    hw = cm.H200
    # compute-bound, full machine: FLOPs / (peak · eff_par)
    x = cm.Launch("mm", "p", {"tc_bf16": hw["tc_bf16"] * cm.ASSUMED["eff_par"] * 1e-3}, programs=132)
    assert cm.launch_time(x, cal) == pytest.approx(cm.ASSUMED["launch_s"] + 1e-3)
    # the same on a quarter of the SMs takes four times as long
    x.programs = 33
    assert cm.launch_time(x, cal) == pytest.approx(cm.ASSUMED["launch_s"] + 4e-3)
    # serial: 10 steps of (t0 + step FLOPs / (per-SM peak · eff_serial)) = 10 · (1e-5 + 1e-5)
    per_sm = hw["ffma_fp32"] / hw["sms"] * 0.1
    y = cm.Launch("chain", "p", programs=1, steps=10, step_flops={"ffma_fp32": per_sm * 1e-5}, kind="cov")
    assert cm.launch_time(y, cal) == pytest.approx(cm.ASSUMED["launch_s"] + 2e-4)
    y.programs = 133  # two waves
    assert cm.launch_time(y, cal) == pytest.approx(cm.ASSUMED["launch_s"] + 4e-4)
    # a call: max(device, host)
    slow_host = cm.Calibration(t0={"cov": 1e-5}, eff_serial=0.1, host_per_op=1.0)
    assert cm.call_time([y], slow_host)[0] == 1.0


def test_calibration_reproduces_its_measurements(cm):
    cal = cm.calibrate()
    assert cal.t0["cov"] > 0 and 0 < cal.eff_serial < 1 and cal.host_per_op > 0 and cal.host_per_op_bwd > 0
    gdn = cm.call_time(cm.gdn_forward(2, 16, 32768, 64), cal)[0]
    assert gdn == pytest.approx(cm.GDN_D64_S["fwd"][32768], rel=0.01)
    assert cm.call_time(cm.gdn_forward(2, 16, 8192, 64), cal)[0] == pytest.approx(cm.GDN_D64_S["fwd"][8192], rel=0.01)
    for D, per_chunk in cm.V1_PER_CHUNK_S.items():  # the v1 fit: within 20% per head dim
        t = cm.call_time(cm.bl_forward(2, 16, 32768, D, 64, "v1"), cal)[0]
        assert t == pytest.approx(per_chunk * 512, rel=0.2), D


def test_chain_speedup(cm):
    cal = cm.calibrate()
    assert cm.chain_speedup_for(2, 16, 2048, 64, cal, target=100.0, fwdbwd=False) == 1.0
    assert cm.chain_speedup_for(2, 16, 2048, 64, cal, target=0.01, fwdbwd=False) is None
    x = cm.chain_speedup_for(2, 16, 32768, 64, cal, target=2.5, fwdbwd=True, variant="cuts_bf16x3")
    assert x is not None and x > 1
    fast = cm.Calibration(dict(cal.t0), cal.eff_serial, cal.host_per_op, cal.host_per_op_bwd, chain_speedup=x)
    bl = cm.bl_forward(2, 16, 32768, 64, 64, "cuts_bf16x3") + cm.bl_backward(2, 16, 32768, 64, 64, "cuts_bf16x3")
    gdn = cm.gdn_forward(2, 16, 32768, 64) + cm.gdn_backward(2, 16, 32768, 64)
    assert cm.call_time(bl, fast)[0] / cm.call_time(gdn, fast)[0] == pytest.approx(2.5, rel=1e-3)


def test_measured_rows_beside_predictions(cm, tmp_path, capsys):
    row = {"kind": "latency", "B": 2, "H": 16, "T": 8192, "D": 64, "gdn_fwd_s": 0.001, "bl_fwd_s": 0.004,
           "bl_phases_s": {"phase_c": 0.002}}
    path = tmp_path / "scan.json"
    path.write_text(__import__("json").dumps({"meta": {}, "rows": [{"kind": "check"}, row]}))
    assert cm.main(["--measured", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(1.00)" in out and "(4.00)" in out and "refit on the device check" in out
    cal = cm.calibrate([row])  # Phase C: 256 programs (2 waves) of 16 steps in 2 ms
    per_sm = cm.H200["ffma_fp32"] / cm.H200["sms"]
    step = cal.t0["cov"] + cm.cov_step_flops(64, 64) / (per_sm * cal.eff_serial)
    assert step * 16 * 2 == pytest.approx(0.002)


def test_bad_input(cm):
    with pytest.raises(ValueError, match="T must be"):
        cm.bl_forward(1, 1, 0, 16)
    with pytest.raises(ValueError, match="variant"):
        cm.bl_forward(1, 1, 64, 16, 16, "fast")
    with pytest.raises(ValueError, match="variant"):
        cm.bl_backward(1, 1, 64, 16, 16, "v1")
    with pytest.raises(ValueError, match="unit"):
        cm._add({}, "tensor", 1.0)
    with pytest.raises(ValueError, match="target"):
        cm.chain_speedup_for(1, 1, 64, 16, cm.calibrate(), target=0, fwdbwd=False)
    with pytest.raises(SystemExit) as err:
        cm.main(["--measured", "/nonexistent.json"])
    assert err.value.code == 2
    assert math.isfinite(cm.calibrate().t0["cov"])
