"""``benchmarks/kernel_sass.py``'s recorder: the peak memory it measures while a call's launches are skipped, and
fla imported with its device queries answering as on an H200."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from .benchmark_scripts import BENCHMARKS, loaded_benchmark


@pytest.fixture(scope="module")
def ks():
    yield from loaded_benchmark("kernel_sass")


def test_peak_bytes_is_the_most_held_at_once_above_the_start(ks):
    before = torch.empty(1 << 20, dtype=torch.uint8)  # held before the block: not counted
    out: dict = {}
    with ks._peak_bytes(out, "x"):
        a = torch.empty(4_000_000, dtype=torch.uint8)
        b = torch.empty(2_000_000, dtype=torch.uint8)
        del a
        c = torch.empty(8_000_000, dtype=torch.uint8)
        del b, c
    assert out == {"x": 10_000_000}
    skipped: dict = {}
    with ks._peak_bytes(skipped, "x", measure=False):
        torch.empty(1000)
    assert skipped == {} and before.numel() == 1 << 20


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the recorder runs under Triton's interpreter")
@pytest.mark.parametrize("which", [pytest.param("bl", marks=pytest.mark.slow), "gdn"])
def test_recorded_peak_memory_is_linear_in_the_chunk_count(ks, which):
    """The cost model carries each call's peak memory linearly from two chunk counts to any T: at 2, 4 and 6
    chunks the steps are equal, the forward+backward holds more than the forward, and the forward more than its
    output."""
    D = 16
    recs = [ks.record_in_process(which, 1, 64 * n, 1, D, backward=True, path="chain" if which == "bl" else None)
            for n in (2, 4, 6)]
    fwd = [r["peak_bytes_fwd"] for r in recs]
    fb = [r["peak_bytes_fwdbwd"] for r in recs]
    assert fwd[2] - fwd[1] == fwd[1] - fwd[0] > 0
    assert fb[2] - fb[1] == fb[1] - fb[0] > 0
    assert all(f > 64 * n * D * 2 for f, n in zip(fwd, (2, 4, 6)))  # at least the bf16 output
    assert all(b > f for b, f in zip(fb, fwd))


@pytest.mark.slow  # a fresh interpreter importing torch, Triton and fla
def test_fla_imported_as_on_an_h200():
    """In a fresh interpreter: fla's device flags and call-time queries answer as on an H200, ``torch.cuda`` as
    before afterwards, and a second import attempt is refused."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import kernel_sass as ks; ks.import_fla_as_on_h200()\n"
        "import torch, fla.utils.hardware as hw\n"
        "try:\n    ks.import_fla_as_on_h200(); again = 'accepted'\nexcept RuntimeError as e:\n    again = str(e)\n"
        "print(json.dumps([hw.IS_NVIDIA_HOPPER, hw.IS_TF32_SUPPORTED, hw.check_shared_mem('hopper'),"
        " hw.get_multiprocessor_count(0), torch.cuda.is_available(), torch.cuda.device_count(), again]))")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    hopper, tf32, smem, sms, cuda, count, again = json.loads(res.stdout.strip().splitlines()[-1])
    assert (hopper, tf32, smem, sms) == (True, True, True, 132)
    assert (cuda, count) == (False, 0)
    assert "already imported" in again
