"""``benchmarks/cost_model.py``: the SASS control word decoded as documented, the walk and the partition
simulation on hand-made kernels, and v1's committed SASS against v1's measured H200 rows."""

from __future__ import annotations

import pytest

from .benchmark_scripts import loaded_benchmark


@pytest.fixture(scope="module")
def cm():
    yield from loaded_benchmark("cost_model")


# two instructions of real cuobjdump output (sm_90): an LDG that sets scoreboard 2, an R2UR that waits on it
SASS = """
   /*0080*/   LDG.E.64 R6, desc[UR14][R2.64] ;   /* 0x0000000e02067981 */
   /* 0x000ea8000c1e1b00 */
   /*00a0*/   R2UR UR16, R6 ;   /* 0x00000000061072ca */
   /* 0x004fe400000e0000 */
"""


def test_control_word(cm):
    ldg, r2ur = cm.ks.parse_sass(SASS)
    assert (ldg.base, ldg.stall, ldg.write_sb, ldg.read_sb, ldg.wait) == ("LDG", 4, 2, None, ())
    assert (r2ur.base, r2ur.stall, r2ur.write_sb, r2ur.wait) == ("R2UR", 2, None, (2,))


def _kernel(cm, insns, loops, warps=4):
    return cm.Kernel("k", insns, loops, warps, 32, 0)


def test_walk_counts_loops_and_waits(cm):
    # 0: LDG (sets sb0), 1: FADD waits sb0, 2: FFMA, 3: back edge to 2 (4 trips), 4: EXIT
    insns = [("LDG.E", 0, 1, 0, None, 0, None, 4), ("FADD", 0, 1, None, None, 1, None, None),
             ("FFMA", 0, 3, None, None, 0, None, None), ("BRA", 1, 1, None, None, 0, 2, None),
             ("EXIT", 0, 1, None, None, 0, None, None)]
    k = _kernel(cm, insns, [[2, 3, 4, []]])
    seq, marks = cm.trace(k)
    assert seq == [0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4] and marks == []
    w = cm.simulate(k, 1)
    # LDG at 0; FADD waits for the global latency; then 4 × (FFMA 3 + BRA 1) and EXIT
    assert w.once == cm.SM90["lat_global"] + 1 + 4 * 4 + 1
    # two warps: the second fills the first one's wait, the global latency is paid once
    assert cm.simulate(k, 2).once < 2 * w.once


def test_chunk_loop_step(cm):
    # a runtime loop (trips None) of 10 FFMAs with stall 2: one step = 20 cycles + the back edge
    body = [("FFMA", 0, 2, None, None, 0, None, None)] * 10
    insns = body + [("BRA", 1, 1, None, None, 0, 0, None), ("EXIT", 0, 1, None, None, 0, None, None)]
    k = _kernel(cm, insns, [[0, 10, None, []]])
    w = cm.simulate(k, 1)
    assert w.has_chunk_loop and w.step == 21
    t = cm.kernel_seconds(k, programs=132, steps=100)
    assert t["seconds"] == pytest.approx((w.once + 100 * 21) / cm.SM90["clock_hz"])


def test_chunk_loop_behind_an_empty_sequence_jump(cm):
    # 0: @P BRA 2 (chunks to do), 1: BRA 6 (an empty sequence skips the loop), 2-4: the chunk loop, 5-6: the end
    ffma = ("FFMA", 0, 2, None, None, 0, None, None)
    insns = [("BRA", 1, 1, None, None, 0, 2, None), ("BRA", 0, 1, None, None, 0, 6, None), ffma, ffma,
             ("BRA", 1, 1, None, None, 0, 2, None), ("FADD", 0, 1, None, None, 0, None, None),
             ("EXIT", 0, 1, None, None, 0, None, None)]
    w = cm.simulate(_kernel(cm, insns, [[2, 4, None, []]]), 1)
    assert w.has_chunk_loop and w.step == 5  # the walk takes the loop, as a sequence with chunks does


def test_v1_reproduced_within_25_percent_or_said(cm, capsys):
    worst = cm.check_v1()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"v1 max relative error {worst:.3f}"
    assert 0 < worst <= 0.25  # the goal; docs/kernels.md states the error per row and what is left


def test_bad_input(cm):
    with pytest.raises(ValueError, match="variant"):
        cm.predict(32, 2048, 64, variant="nope")
    with pytest.raises(ValueError, match="no SASS"):
        cm.ks.parse_sass("nothing here")
