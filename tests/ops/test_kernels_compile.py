"""The Triton kernels compile for a GPU (sm_90) on this CPU-only machine.

``benchmarks/gpu.py --compile-only`` builds every kernel variant with ``triton.compile`` and
reads its register / spill budget with the ``cuobjdump`` bundled in Triton's wheel.  Nothing
runs on a GPU; this catches what the interpreter tests cannot: a kernel that Triton's
compiler rejects, or a launcher signature that drifted from the kernel's.  It runs in a
child process because the interpreter (``TRITON_INTERPRET=1``, set for the other kernel
tests) replaces compilation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


# The default run compiles the segment scan's covariance kernel (its four variants); the whole set — the covariance
# chain's forward and backward (the default path), every kernel of the segment scan and its backward — is a slow
# test: cold, it takes minutes (the chain's alone about one per kernel and decay on a busy 2-core CPU).
KERNEL_SETS = [pytest.param(("cov",), id="cov"), pytest.param(None, id="all", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_every_kernel_variant_compiles_for_sm90(tmp_path, kernels):
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("this Triton wheel has no NVIDIA backend tools")
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--compile-only", "--D", "64", "--out", str(out)]
        + (["--kernels", *kernels] if kernels else []),
        capture_output=True, text=True, env=env, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    kinds = {(r["kernel"], r["diagonal"], r["checkpoints"]) for r in rows}
    expected = {(k, d, False) for k in ("cov", "mean") for d in (False, True)} | {
        ("step", False, False), ("step", True, False)} | {
        # the segment scan: Phase A (cov64, track64), the prep kernel (prep64 for Phase A, prep for C) and the
        # covariance kernel reading it (covp64, covp), Phase B (phaseb64: float64, no decay variants)
        (k, d, False) for k in ("cov64", "track64", "prep", "prep64", "covp", "covp64") for d in (False, True)} | {
        ("phaseb64", False, False)} | {
        # the backward through the scan: B2, B4, B4 with the variance (both decays), B3 (float64)
        (k, d, False) for k in ("segadj", "segadj4", "segadj4v") for d in (False, True)} | {("rev64", False, False)} | {
        # the covariance chain, the default path: its forward and its backward (both decays)
        (k, d, False) for k in ("chain", "chainb") for d in (False, True)} | {
        # and its float64 arithmetic, as fp32 inputs launch it up to chain_triton.FLOAT64_MAX_HEAD_DIM
        (k, d, False) for k in ("chain64", "chainb64") for d in (False, True)}
    assert kinds == (expected if kernels is None else {x for x in expected if x[0] in kernels})
    for r in rows:
        what = f"{r['kernel']} (diagonal={r['diagonal']}, checkpoints={r['checkpoints']})"
        assert "error" not in r, f"{what}: {r['error']}"
        assert "REG:" in r["resources"], r
        if r["kernel"] in ("chain", "chainb"):  # every product of the chain is a tensor-core dot
            assert r["sass_tensor_core"] > 0 and r["shared_bytes"] <= 227 * 1024, what
