"""``benchmarks/gpu.py --scan`` pieces that run without a GPU: fla's Hopper guard handling (the library's
``fla_hopper_guard`` and the script's recognition of the guard's refusal), the backward value check
on fla's naive references, argument validation.

The whole device check is dry-run by hand (``TRITON_INTERPRET=1 python benchmarks/gpu.py --scan --dry-run``, about
a minute); these tests keep the parts a GPU run depends on from breaking silently in between.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from bayeslayer.ops.bayesian_layer.mean_pass_fla import fla_hopper_guard

from .benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def gpu():
    return load_benchmark("gpu")


def _simulate(monkeypatch, hopper: bool, above_340: bool, above_371: bool):
    chunk_o = pytest.importorskip("fla.ops.common.chunk_o")
    monkeypatch.setattr(chunk_o, "IS_NVIDIA_HOPPER", hopper)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_4_0", above_340)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", above_371)  # restored after the test, bypass or not
    return chunk_o


def _gated_dqkwg(chunk_o):
    """fla's gated ``chunk_bwd_dqkwg`` on dummy inputs: its guard is the first thing it checks."""
    x = torch.zeros(1, 64, 1, 16)
    h = torch.zeros(1, 1, 1, 16, 16)
    return chunk_o.chunk_bwd_dqkwg(x, x, x, x, h, h, g=torch.zeros(1, 64, 1))


def test_hopper_guard_detected_hit_and_bypassed(gpu, monkeypatch):
    """Hopper with Triton 3.4 <= v < 3.7.1: the guard is active, fla's refusal is recognised as the guard's, and
    the bypass lets the call past the guard."""
    chunk_o = _simulate(monkeypatch, hopper=True, above_340=True, above_371=False)
    state = fla_hopper_guard(bypass=False)
    assert state["active"] is True and state["bypassed"] is False
    assert state["triton"] and state["fla"]
    with pytest.raises(RuntimeError, match="#640") as err:
        _gated_dqkwg(chunk_o)
    assert gpu._guard_hit(err.value)
    assert not gpu._guard_hit(RuntimeError("CUDA out of memory")) and not gpu._guard_hit(ValueError("#640"))
    state = fla_hopper_guard(bypass=True)
    assert state["active"] is True and state["bypassed"] is True and chunk_o.TRITON_ABOVE_3_7_1 is True
    with pytest.raises(Exception) as err:  # past the guard: fails later (no GPU), not with the guard's refusal
        _gated_dqkwg(chunk_o)
    assert not gpu._guard_hit(err.value)


@pytest.mark.parametrize(("hopper", "above_340", "above_371"), [(False, True, False), (True, True, True),
                                                                (True, False, False)])
def test_hopper_guard_inactive_is_left_alone(gpu, monkeypatch, hopper, above_340, above_371):
    chunk_o = _simulate(monkeypatch, hopper, above_340, above_371)
    state = fla_hopper_guard(bypass=True)
    assert state["active"] is False and state["bypassed"] is False
    assert chunk_o.TRITON_ABOVE_3_7_1 is above_371


def test_gdn_backward_check_on_fla_references(gpu):
    """The dry run's GDN check: fla's naive chunk reference against its naive recurrent one, fp32, packed."""
    pytest.importorskip("fla")
    out = gpu._check_gdn_backward("cpu", dry_run=True)
    assert "gdn_bwd_error" not in out, out.get("gdn_bwd_error")
    assert set(out["gdn_bwd_rel_err"]) == {"o", *gpu.GDN_LEAVES}
    assert out["gdn_bwd_max_rel_err"] <= 1e-5 and out["gdn_bwd_guard_hit"] is False


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="needs TRITON_INTERPRET=1 (CPU)")
def test_bl_backward_check_interpreted(gpu):
    """The dry run's BL check: the covariance chain's and the segment scan's backward against the PyTorch chunk
    path, float64 and fp32 (a few s)."""
    pytest.importorskip("fla")
    out = gpu._check_bl_backward("cpu", dry_run=True)
    for path in ("chain", "scan"):
        assert set(out[f"bl_{path}_bwd_fp64_rel_err"]) == set(gpu.BL_LEAVES)
        assert out[f"bl_{path}_bwd_fp64_max_rel_err"] <= 1e-10
        assert out[f"bl_{path}_bwd_fp32_max_rel_err"] <= 1e-5


def test_bad_input(gpu):
    with pytest.raises(TypeError, match="bypass"):
        fla_hopper_guard(bypass="yes")
    with pytest.raises(ValueError, match="device"):
        gpu.scan_check(argparse.Namespace(no_bwd=True, dry_run=True), "tpu")
    with pytest.raises(TypeError, match="guard"):
        gpu.scan_check(argparse.Namespace(no_bwd=True, dry_run=True), "cpu", guard="off")
    with pytest.raises(TypeError, match="save"):
        gpu.run_scan(argparse.Namespace(), save=None)
    with pytest.raises(ValueError, match="fla_autotune"):
        gpu.run_scan(argparse.Namespace(fla_autotune="tuned"), save=lambda rows: None)
    with pytest.raises(ValueError, match="path"):
        gpu._bl_fwdbwd({"q": torch.zeros(1)}, 16, "fused", None)
    for argv in (["--scan", "--bwd-reps", "0"], ["--scan", "--reps", "0"], ["--scan", "--blockwise-max-T", "-1"],
                 ["--scan", "--fla-autotune", "tuned"]):
        with pytest.raises(SystemExit) as err:
            gpu.main(argv)
        assert err.value.code == 2


SASS = """
        code for sm_90
                Function : bl_chunk_cov_kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.1688.F32.TF32 R4, R8, R12, R4 ;
        /*0020*/              @!P0 HMMA.1688.F32.TF32 R4, R8, R12, R4 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0040*/                   DMMA.8x8x4 R0, R2, R4, R0 ;
        /*0050*/               @P1 FFMA R0, R1, R2, R0 ;
        /*0060*/                   FFMA R0, R1, R2, R0 ;
        /*0070*/                   DFMA R0, R2, R4, R0 ;
        /*0080*/                   FMUL R0, R1, R2 ;
        /*0090*/                   DADD R0, R2, R4 ;
        /*00a0*/                   EXIT ;
"""


def test_sass_census(gpu):
    """Static opcode counts by family (predicated instructions too), registers and spills from -res-usage."""
    out = gpu.sass_census(SASS, "REG:222 STACK:40 SHARED:1024 LOCAL:0")
    assert out["sass_tensor_core"] == 4 and out["sass_tensor_core_ops"] == {"HMMA": 2, "HGMMA": 1, "DMMA": 1}
    assert (out["sass_FFMA"], out["sass_DFMA"], out["sass_FMUL_FADD"], out["sass_DMUL_DADD"]) == (2, 1, 1, 1)
    assert out["sass_total"] == 11 and out["registers"] == 222 and out["spill_bytes"] == 40
    empty = gpu.sass_census("", "")
    assert empty["sass_total"] == 0 and empty["registers"] is None
    with pytest.raises(TypeError, match="sass"):
        gpu.sass_census(None)


def test_fp32_dot_precision_pinned_on_a_gpu_only():
    """On a GPU the tests pin fla's fp32 tl.dot to IEEE (its default there is TF32), in a Triton cache of their own;
    the caller's choices stand; on the CPU nothing changes."""
    from tests.conftest import pin_fp32_dot_precision

    env: dict = {}
    assert pin_fp32_dot_precision(env, cuda=False) is None and env == {}
    assert pin_fp32_dot_precision(env, cuda=True) == "ieee"
    assert env["TRITON_F32_DEFAULT"] == "ieee" and env["TRITON_CACHE_DIR"].endswith("cache-f32-ieee")
    env = {"TRITON_F32_DEFAULT": "tf32x3", "TRITON_CACHE_DIR": "/x"}
    assert pin_fp32_dot_precision(env, cuda=True) == "tf32x3" and env["TRITON_CACHE_DIR"] == "/x"


def test_hopper_guard_bypass_for_tests(monkeypatch):
    """BL_TEST_BYPASS_FLA_HOPPER_GUARD=1 (the device check's test phase) switches fla's guard off; unset: untouched."""
    from tests.conftest import bypass_fla_hopper_guard

    chunk_o = _simulate(monkeypatch, hopper=True, above_340=True, above_371=False)
    assert bypass_fla_hopper_guard({}) is None and chunk_o.TRITON_ABOVE_3_7_1 is False
    state = bypass_fla_hopper_guard({"BL_TEST_BYPASS_FLA_HOPPER_GUARD": "1"})
    assert state["active"] is True and state["bypassed"] is True and chunk_o.TRITON_ABOVE_3_7_1 is True
