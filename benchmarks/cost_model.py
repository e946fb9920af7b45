"""Cost model of the Bayesian Layer's kernels against fla's Gated DeltaNet on an H200, from the compiled SASS.

    python benchmarks/cost_model.py                 # the table: B·H 32, 128, 144; D 64, 128; T 2k, 8k, 32k
    python benchmarks/cost_model.py --json          # the same rows as JSON (variant, BH, D, T, ratios)
    python benchmarks/cost_model.py --check-v1      # v1's kernels (committed SASS) against v1's measured H200 rows
    python benchmarks/cost_model.py --check-gdn     # fla GDN's measured H200 rows against the model

Nothing here is fitted to a kernel's measured time.  Per launch:

1. **What launches.**  The call (BL's default path, ``bl_chunk(..., backend="triton")`` and its backward; fla's
   ``chunk_gated_delta_rule``) runs once in Triton's interpreter with every kernel launch recorded and skipped
   (``benchmarks/kernel_sass.py``): kernel, grid, and what Triton would compile for sm_90.  So the default variant
   is whatever the dispatch launches, found by running it, not a list kept here.  PyTorch ops between the launches
   are counted too (host time).
2. **The kernel's own latency.**  Each launch is compiled for sm_90 and disassembled.  The SASS carries, per
   instruction, the stall cycles the compiler scheduled before the next instruction and the scoreboards it sets
   and waits on (the control word, :class:`kernel_sass.Insn`).  One warp's instruction stream is walked through
   the kernel's loop tree (trip counts from the TTGIR's ``scf.for`` bounds; the loop with a runtime bound is the
   chunk loop): every instruction issues after the previous one's stall and after the scoreboards it waits on are
   released; a variable-latency instruction releases its scoreboard :data:`SM90` cycles later by class (global
   memory, shared memory, special functions, barriers).  That gives one chunk step's dependent chain in cycles;
   the step then takes the larger of it and the throughput bounds of the SM partition the program's warps share
   (issue: one instruction per cycle; FP64, MUFU and tensor-core pipes at their rates).
3. **Launch time** = ``waves · (once + steps · step) / clock`` (``steps``: the chunk loop's trip count at the row's
   shape), at least the launch's bytes at the measured copy bandwidth; a call takes ``max(Σ device, host)``, host =
   :data:`HOST_S_PER_OP` · (launches + PyTorch ops), since the host queues work ahead of the device.
4. **Peak memory** above the inputs: the most bytes the call holds allocated at once, measured while the skipped
   recordings run (every buffer the host code allocates, kernels or not, is allocated as on a GPU; fla's own
   ``fwd_h``/``bwd_dhu`` stand where the CPU would run their twins), carried linearly in the chunk count to the
   row's T, times B·H.  Not counted: the CUDA caching allocator's rounding of each block to 512 bytes.

Free parameters, all in :data:`SM90` with their source: the latencies per instruction class and the unit rates
come from published figures; the one number taken from a measurement of a whole call is the host seconds per
launch (:data:`HOST_S_PER_OP`, from fla's GDN forward at T = 8k, where the device is idle most of the time).

v1 (the chunk-serial kernels measured on 2026-11-30) no longer exists as code: its SASS, compiled from the commit
that was measured, is the committed record ``results/sass/v1_sm90_triton3.6.json`` (``--extract-v1`` rewrites it
from git history), and ``--check-v1`` predicts v1's measured rows from it.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernel_sass as ks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
V1_RECORD = ROOT / "results" / "sass" / "v1_sm90_triton3.6.json"
V1_COMMIT = "113d306662c048893dfdfe273ee848622608e782"  # the code the 2026-11-30 H200 rows measured
V1_MEASURED = ("results/gpu/2026-11-30_h200_bl_d64_d128.json", "results/gpu/2026-11-30_h200_bl_d256.json")
GDN_MEASURED = "results/gpu/2026-11-30_h200_bl_vs_gdn_d64.json"
CACHE = ROOT / "benchmarks" / "results" / "sass_cache"

# sm_90 (H100/H200 SXM) figures the model uses.  Cycles are SM clock cycles.
SM90 = {
    "sms": 132,  # H200 SXM: 132 SMs (device properties)
    # the clock NVIDIA's H100/H200 SXM peak figures are quoted at: 989.4 TFLOPS bf16 dense = 132 SMs · 4096
    # FLOP/cycle · 1.83 GHz (Hopper whitepaper, "H100 SXM5" column)
    "clock_hz": 1.83e9,
    "copy_bytes_s": 4.3e12,  # device-to-device copy on the H200, bytes read + written per second (measured)
    # latencies (cycles) of the variable-latency classes: Table 3 of Pfister et al., Ultrasonics Sonochemistry 99
    # (2023) 106546, "Hardware features of different Nvidia GPU architectures", H100 column (global memory 400,
    # L2 200, shared memory 20, arithmetic 4).  Fixed-latency instructions need none: their stalls are in the SASS.
    "lat_global": 400,  # LDG/LDGSTS that reach HBM
    "lat_l2": 200,  # not used per instruction (the SASS does not say which load hits L2); stated for the docs
    "lat_shared": 20,  # LDS, LDSM, STS/STSM completion, SHFL (shared-memory crossbar), ATOMS
    "lat_alu": 4,  # read release of a store's or MUFU's source registers
    # not in that table: assumed, stated as such (docs/kernels.md "Cost model")
    "lat_mufu": 20,  # MUFU.EX2/RCP/RSQ...: taken as a shared-memory round trip
    "lat_const": 20,  # S2R/S2UR/LDC: constant cache / special registers (prologue only)
    "lat_bar": 20,  # BAR.SYNC of a CTA's warps once all have arrived
    # unit rates per SM and cycle (Hopper whitepaper: 4 partitions, each 32 FP32 lanes, 16 FP64 lanes, 4 SFU)
    "tc_flop_per_cycle": {"bf16": 4096, "fp16": 4096, "tf32": 2048, "fp64": 256, "int8": 8192},
    "fp64_cycles": 2,  # one warp-wide DFMA/DADD/DMUL per partition every 2 cycles
    "mufu_cycles": 8,  # one warp-wide MUFU per partition every 8 cycles
    "tc_latency": 32,  # result latency of one HMMA after its issue slots (assumed: half a shared round trip more)
    # shared memory / L1 data path: 32 banks of 4 bytes, 128 bytes per cycle per SM (Hopper tuning guide; the
    # same 32 banks in the Volta measurements of Jia et al. 2018)
    "lsu_bytes_per_cycle": 128,
    "regs_per_sm": 65536,
    "shared_per_sm": 228 * 1024,
    "max_warps_per_sm": 64,
}
# host seconds to queue one PyTorch op (assumed: eager dispatch of a small op; not measured here)
HOST_S_PER_TORCH_OP = 10e-6

ROW_BH = (32, 128, 144)
ROW_D = (64, 128)
ROW_T = (2048, 8192, 32768)
TARGET_FWD, TARGET_FWD_BWD = 2.2, 2.5
TARGET_MEMORY = 1.5  # peak memory above the inputs, BL over GDN


# ---------------------------------------------------------------------------------------------------------------
# kernels: compact SASS + loop tree
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class Kernel:
    """One compiled kernel as the model reads it: its instructions (op, guard, stall, scoreboards set and waited
    on, branch target index, DEPBAR count), its loop tree with trip counts, warps, registers, shared memory."""

    name: str
    insns: list  # of tuples (op, guarded, stall, write_sb, read_sb, wait_mask, target_index, arg)
    loops: list  # nested [head, tail, trips, children]
    num_warps: int
    registers: int
    shared_bytes: int
    spill_bytes: int = 0
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "num_warps": self.num_warps, "registers": self.registers,
                "shared_bytes": self.shared_bytes, "spill_bytes": self.spill_bytes, "meta": self.meta,
                "loops": self.loops, "insns": ["|".join("" if x is None else str(x) for x in i) for i in self.insns]}

    @classmethod
    def from_json(cls, d: dict) -> Kernel:
        def field_(s, j):
            return None if s == "" else (s if j == 0 else int(s))
        insns = [tuple(field_(s, j) for j, s in enumerate(line.split("|"))) for line in d["insns"]]
        return cls(d["name"], insns, d["loops"], d["num_warps"], d["registers"], d["shared_bytes"],
                   d.get("spill_bytes", 0), d.get("meta", {}))


def kernel_from_sass(name: str, sass: str, ttgir: str, num_warps: int, resources: str, shared_bytes: int,
                     meta: dict | None = None) -> Kernel:
    """Read one compiled kernel (``cuobjdump -sass`` text, its TTGIR, ``-res-usage`` line) into a :class:`Kernel`."""
    import re

    ins = ks.parse_sass(sass)
    roots = ks.loop_tree(ins)
    exact = ks.assign_trips(roots, ks.ttgir_loop_tree(ttgir))
    meta = dict(meta or {}, loops_matched=exact)
    index = {x.addr: i for i, x in enumerate(ins)}
    compact = []
    for x in ins:
        arg = None
        if x.base == "DEPBAR":
            m = re.search(r",\s*(0x[0-9a-f]+|\d+)", x.operands)
            arg = int(m.group(1), 0) if m else 0
        elif x.base in ("HMMA", "HGMMA", "DMMA", "IMMA"):
            arg = _mma_flops(x.op, x.operands)
        elif x.base in ("LDG", "STG", "LDGSTS", "LDS", "STS", "LDSM"):
            m = re.search(r"\.(32|64|128|U8|S8|U16|S16)\b", x.op)
            arg = {"64": 8, "128": 16, "U8": 1, "S8": 1, "U16": 2, "S16": 2}.get(m.group(1), 4) if m else 4
        wait = sum(1 << b for b in x.wait)
        tgt = index.get(x.target) if x.target is not None else None
        compact.append((x.op, 1 if x.pred else 0, x.stall, x.write_sb, x.read_sb, wait, tgt, arg))

    def tree(lp):
        return [lp.head, lp.tail, lp.trips, [tree(c) for c in lp.children]]

    regs = re.search(r"\bREG:(\d+)", resources)
    stack = re.search(r"\bSTACK:(\d+)", resources)
    return Kernel(name, compact, [tree(r) for r in roots], num_warps, int(regs.group(1)) if regs else 0,
                  shared_bytes, int(stack.group(1)) if stack else 0, meta)


def _mma_flops(op: str, operands: str) -> int:
    """FLOPs of one warp-level (HMMA/DMMA/IMMA) or warpgroup-level (HGMMA, counted per warp: a quarter) matrix
    instruction, from its shape modifier."""
    import re

    if op.startswith("HGMMA"):
        m = re.search(r"\.64x(\d+)x(\d+)", op)
        n, k = (int(m.group(1)), int(m.group(2))) if m else (64, 16)
        return 2 * 64 * n * k // 4
    m = re.search(r"\.(\d)(\d)(\d+)", op)  # e.g. HMMA.16816 -> 16, 8, 16; DMMA.884 -> 8, 8, 4
    if op.startswith("DMMA"):
        return 2 * 8 * 8 * 4
    if m:
        digits = m.group(0)[1:]
        for mm, nn in ((16, 8), (8, 8)):
            s = f"{mm}{nn}"
            if digits.startswith(s):
                return 2 * mm * nn * int(digits[len(s):])
    return 2 * 16 * 8 * 16


def _precision(op: str) -> str:
    if op.startswith("DMMA"):
        return "fp64"
    if op.startswith("IMMA") or ".S8" in op or ".U8" in op:
        return "int8"
    if ".TF32" in op or ".F32.TF32" in op:
        return "tf32"
    return "bf16"


# ---------------------------------------------------------------------------------------------------------------
# one warp through the loop tree
# ---------------------------------------------------------------------------------------------------------------

VAR_LATENCY = {"LDG": "lat_global", "LDGSTS": "lat_global", "LDS": "lat_shared", "LDSM": "lat_shared",
               "SHFL": "lat_shared", "ATOMS": "lat_shared", "STS": "lat_shared", "STSM": "lat_shared",
               "MUFU": "lat_mufu", "S2R": "lat_const", "S2UR": "lat_const", "LDC": "lat_const", "ULDC": "lat_const",
               "CS2R": "lat_const", "ATOMG": "lat_global", "RED": "lat_global", "LD": "lat_global",
               "LDL": "lat_global", "STL": "lat_shared", "STG": "lat_alu", "ST": "lat_alu", "I2F": "lat_mufu",
               "F2I": "lat_mufu", "F2F": "lat_mufu", "DMUL": "lat_alu", "DFMA": "lat_alu", "DADD": "lat_alu",
               "POPC": "lat_mufu", "FLO": "lat_mufu", "BREV": "lat_mufu", "I2FP": "lat_mufu", "F2FP": "lat_alu",
               "VOTE": "lat_alu", "REDUX": "lat_shared", "MATCH": "lat_shared", "R2UR": "lat_alu",
               "DSETP": "lat_alu", "QSPC": "lat_shared", "UBLKCP": "lat_global", "SYNCS": "lat_shared",
               "UTMALDG": "lat_global", "UTMASTG": "lat_global", "WARPGROUP": "lat_alu"}


@dataclass
class Walk:
    """One program's walk: ``step`` cycles of one chunk-loop iteration (steady state), ``once`` cycles of
    everything outside the chunk loop, and one warp's dynamic instruction counts of a step and of the rest."""

    step: float
    once: float
    step_counts: Counter
    once_counts: Counter
    has_chunk_loop: bool
    unknown_ops: set


def _mma_cycles(insn, hw) -> float:
    flops = insn[7] or 0
    return flops / (hw["tc_flop_per_cycle"][_precision(insn[0])] / 4)  # per partition


def trace(k: Kernel, chunk_iters: int = 2) -> tuple[list, list]:
    """One warp's dynamic instruction sequence (indices into ``k.insns``) through the loop tree: loops with a
    constant trip count run it, the outermost runtime loop (the chunk loop) runs ``chunk_iters`` times, runtime
    loops inside it once per iteration; forward branches fall through (both sides of an ``if`` are counted)
    unless unconditional (except a jump over the whole chunk loop before it ran: an empty sequence's path).
    Returns ``(sequence, marks)``, ``marks``: positions where a chunk iteration begins, and the position after the
    last one."""
    ins = k.insns
    tails: dict = {}
    runtime_outer = None

    def visit(lp, inside_runtime):
        nonlocal runtime_outer
        head, tail, trips, children = lp
        if trips is None and not inside_runtime and runtime_outer is None:
            runtime_outer = (head, tail)
            tails[tail] = (head, chunk_iters, True)
        else:
            tails[tail] = (head, trips if trips is not None else 1, False)
        for c in children:
            visit(c, inside_runtime or trips is None)

    for lp in k.loops:
        visit(lp, False)
    counters = Counter()
    seq, marks = [], []
    pc = 0
    while pc < len(ins):
        if len(seq) > 30_000_000:
            raise RuntimeError(f"{k.name}: walk did not end (loop structure not understood)")
        op, guarded, _, _, _, _, tgt, _ = ins[pc]
        base = op.split(".")[0]
        if runtime_outer and pc == runtime_outer[0]:
            marks.append(len(seq))
        seq.append(pc)
        if pc in tails:
            head, trips, is_chunk = tails[pc]
            counters[pc] += 1
            if counters[pc] < trips:
                pc = head
                continue
            counters[pc] = 0
            if is_chunk:
                marks.append(len(seq))
            pc += 1
            continue
        if base == "EXIT" and not guarded:
            break
        if base in ("BRA", "JMP") and not guarded and tgt is not None and tgt > pc:
            # a jump over the whole chunk loop before it ran is the path of an empty sequence (the compiler puts
            # it in the fall-through of the guarded branch to the loop): a sequence with chunks does not take it
            if not (runtime_outer and not marks and pc < runtime_outer[0] and tgt > runtime_outer[1]):
                pc = tgt
                continue
        pc += 1
    return seq, marks


PIPE_CYCLES = {"DFMA": "fp64_cycles", "DADD": "fp64_cycles", "DMUL": "fp64_cycles", "MUFU": "mufu_cycles"}
MMA = ("HMMA", "DMMA", "IMMA", "HGMMA")
# instructions that move data through the SM's load/store path (shared memory and L1: 128 bytes per cycle per SM,
# shared by its four partitions); a warp-wide one moves 32 lanes x its width (LDSM/STSM: 4 8x8 16-bit tiles)
LSU = {"LDS": None, "STS": None, "LDSM": 512, "STSM": 512, "SHFL": 128, "LDG": None, "STG": None, "LDGSTS": None,
       "ATOMS": 128, "REDUX": 128}


def lsu_cycles(insn, hw) -> float:
    """Cycles of one partition's share of the SM's load/store bandwidth that ``insn`` occupies (0: none)."""
    b = insn[0].split(".")[0]
    if b not in LSU:
        return 0.0
    nbytes = LSU[b] if LSU[b] is not None else 32 * (insn[7] or 4)
    return nbytes / (hw["lsu_bytes_per_cycle"] / 4)


def simulate(k: Kernel, warps: int, hw: dict = SM90, chunk_iters: int = 2) -> Walk:
    """One SM partition issuing ``warps`` warps of ``k`` (in-order per warp, one instruction per cycle, the oldest
    ready warp first): a warp's next instruction waits for the stall cycles of its previous one, for the
    scoreboards it names (released :data:`SM90` latencies after the instruction that set them), for its pipe
    (FP64, MUFU, tensor core: shared by the partition's warps) and, at ``BAR.SYNC``, for every warp to arrive.
    :class:`Walk` of warp 0: cycles of the last chunk iteration and of the rest."""
    seq, marks = trace(k, chunk_iters)
    ins = k.insns
    lat = [0.0] * len(ins)
    base_of = [i[0].split(".")[0] for i in ins]
    unknown = set()
    for j, i in enumerate(ins):
        b = base_of[j]
        if i[3] is not None and b not in MMA and b != "LDGDEPBAR":
            if b not in VAR_LATENCY:
                unknown.add(b)
            lat[j] = hw[VAR_LATENCY.get(b, "lat_shared")]
    n = len(seq)
    pos = [0] * warps
    ready = [0.0] * warps
    sb = [[0.0] * 6 for _ in range(warps)]
    groups = [[] for _ in range(warps)]
    pend = [0.0] * warps
    pipe_free: dict = {}
    at_bar: dict = {}
    issue_at_mark = []  # warp 0's issue time at each mark
    mark_set = {m: idx for idx, m in enumerate(marks)}
    t = 0.0
    done = 0
    while done < warps:
        # the oldest ready warp (smallest earliest-issue time), ties by index
        best, best_t = -1, None
        for w in range(warps):
            if pos[w] >= n or w in at_bar:
                continue
            j = seq[pos[w]]
            op, _, stall, wr, rd, wait, _, arg = ins[j]
            e = ready[w]
            if wait:
                s = sb[w]
                for b in range(6):
                    if wait >> b & 1 and s[b] > e:
                        e = s[b]
            b_ = base_of[j]
            if b_ == "DEPBAR" and groups[w]:
                keep = arg or 0
                if len(groups[w]) > keep:
                    e = max(e, groups[w][len(groups[w]) - keep - 1])
            pipe = "tc" if b_ in MMA else PIPE_CYCLES.get(b_) or ("lsu" if b_ in LSU else None)
            if pipe and pipe_free.get(pipe, 0.0) > e:
                e = pipe_free[pipe]
            if best_t is None or e < best_t:
                best, best_t = w, e
        if best < 0:  # every live warp waits at the barrier
            release = max(at_bar.values()) + hw["lat_bar"]
            for w in list(at_bar):
                ready[w] = release
                pos[w] += 1
                if pos[w] >= n:
                    done += 1
            at_bar.clear()
            continue
        w = best
        t = max(t + 1, best_t) if t else best_t  # one issue per cycle
        j = seq[pos[w]]
        op, _, stall, wr, rd, wait, _, arg = ins[j]
        b_ = base_of[j]
        if w == 0 and pos[w] in mark_set:
            issue_at_mark.append(t)
        if b_ == "DEPBAR" and groups[w]:
            keep = arg or 0
            groups[w] = groups[w][len(groups[w]) - keep:] if keep else []
        if b_ in MMA:
            c = _mma_cycles(ins[j], hw)
            pipe_free["tc"] = t + c
            if wr is not None:
                sb[w][wr] = max(sb[w][wr], t + c + hw["tc_latency"])
        elif b_ in PIPE_CYCLES:
            pipe_free[PIPE_CYCLES[b_]] = t + hw[PIPE_CYCLES[b_]]
        elif b_ in LSU:
            pipe_free["lsu"] = t + lsu_cycles(ins[j], hw)
        if wr is not None and b_ not in MMA:
            if b_ == "LDGDEPBAR":
                groups[w].append(max(pend[w], t + 1))
                pend[w] = 0.0
            else:
                sb[w][wr] = max(sb[w][wr], t + lat[j])
        if b_ == "LDGSTS":
            pend[w] = max(pend[w], t + hw["lat_global"])
        if rd is not None:
            sb[w][rd] = max(sb[w][rd], t + hw["lat_alu"])
        ready[w] = t + max(stall, 1)
        if b_ == "BAR" and ".ARV" not in op and warps > 1:
            at_bar[w] = t
            continue
        if b_ == "BAR" and ".ARV" not in op:
            ready[w] += hw["lat_bar"]
        pos[w] += 1
        if pos[w] >= n:
            done += 1
            if w == 0 and n in mark_set:
                issue_at_mark.append(ready[w])
    end = max(ready)
    counts_all = Counter(base_of[j] for j in seq)
    if len(marks) >= 2 and len(issue_at_mark) >= len(marks):
        step = issue_at_mark[-1] - issue_at_mark[-2]
        step_counts = Counter(base_of[j] for j in seq[marks[-2]:marks[-1]])
        once = max(end - chunk_iters * step, 0.0)
        once_counts = Counter({o: c - chunk_iters * step_counts.get(o, 0) for o, c in counts_all.items()})
        return Walk(step, once, step_counts, once_counts, True, unknown)
    return Walk(0.0, end, Counter(), counts_all, False, unknown)


def _bound_cycles(counts: Counter, warps_per_partition: float, hw: dict) -> float:
    """Throughput bound of one partition running ``warps_per_partition`` warps of these instruction counts."""
    n = sum(c for o, c in counts.items() if ":" not in o)
    fp64 = sum(counts.get(o, 0) for o in ("DFMA", "DADD", "DMUL")) * hw["fp64_cycles"]
    mufu = counts.get("MUFU", 0) * hw["mufu_cycles"]
    tc = sum(c for o, c in counts.items() if o.startswith("tc_cycles:"))
    return warps_per_partition * max(n, fp64, mufu, tc)


def occupancy(k: Kernel, hw: dict = SM90) -> int:
    """Programs (CTAs) of ``k`` one SM holds at once: registers, shared memory, warps."""
    regs = max(k.registers, 16) * 32 * k.num_warps
    by_regs = hw["regs_per_sm"] // max(regs, 1)
    by_shared = hw["shared_per_sm"] // max(k.shared_bytes, 1) if k.shared_bytes else 32
    by_warps = hw["max_warps_per_sm"] // k.num_warps
    return max(1, min(by_regs, by_shared, by_warps, 32))


_SIMULATED: dict = {}


def simulate_cached(k: Kernel, warps: int, hw: dict = SM90) -> Walk:
    """:func:`simulate`, once per (kernel, warps, figures) in this process."""
    key = (id(k), warps, json.dumps(hw, sort_keys=True))
    if key not in _SIMULATED:
        _SIMULATED[key] = (k, simulate(k, warps, hw))
    return _SIMULATED[key][1]


def kernel_seconds(k: Kernel, programs: int, steps: int, hw: dict = SM90, walked: Walk | None = None) -> dict:
    """Device seconds of one launch of ``k``: ``programs`` CTAs, ``steps`` chunk-loop iterations each."""
    occ = min(occupancy(k, hw), max(1, math.ceil(programs / hw["sms"])))
    rounds = math.ceil(programs / (hw["sms"] * occ))
    wpp = max(1, math.ceil(occ * k.num_warps / 4))  # warps per SM partition at once
    w = walked or simulate_cached(k, wpp, hw)
    step = w.step if w.has_chunk_loop else 0.0
    once = w.once
    cycles = rounds * (once + steps * step)
    return {"seconds": cycles / hw["clock_hz"], "step_cycles": step, "once_cycles": once, "dep_step_cycles": w.step,
            "rounds": rounds, "occupancy": occ}


# ---------------------------------------------------------------------------------------------------------------
# v1: the committed record
# ---------------------------------------------------------------------------------------------------------------

V1_SHAPES = (64, 128, 256)


def extract_v1(out: Path = V1_RECORD) -> Path:
    """Compile v1's covariance and mean kernels from git history (:data:`V1_COMMIT`) for sm_90 with this process's
    Triton, as v1 launched them (bf16 inputs: fp32 buffers, scalar decay, no checkpoints, IEEE products,
    ``num_warps`` 8, BK = 16, BV = min(32, D)), and write their SASS as read by the model to ``out``."""
    import importlib.util
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{V1_COMMIT}:bayeslayer/ops/triton/kernels.py"],
                         capture_output=True, text=True, check=True).stdout
    kernels = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bl_v1_kernels.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("bl_v1_kernels", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bl_v1_kernels"] = mod
        spec.loader.exec_module(mod)
        for D in V1_SHAPES:
            BD = max(16, 1 << (D - 1).bit_length())
            common = dict(H=16, D=D, BD=BD, BK=16, DIAG=False, HAS_ALPHA=True)
            for kind in ("cov", "mean"):
                if kind == "cov":
                    fn = mod.bl_chunk_cov_kernel
                    names = ["q", "k", "r2", "ell2", "la", "cu_seqlens", "P", "W", "LINV", "Yscr", "Uscr", "VAR",
                             "CKP", "ck_offsets"]
                    consts = dict(common, C=64, RETURN_VAR=False, SAVE_CK=False, PREC="ieee", CK_EVERY=1)
                else:
                    fn = mod.bl_chunk_mean_kernel
                    names = ["q", "k", "v", "W", "LINV", "la", "cu_seqlens", "M", "O", "CKM", "ck_offsets"]
                    consts = dict(common, MV=D, C=64, BV=min(32, BD), SAVE_CK=False, PREC="ieee", CK_EVERY=1)
                sig = {n: ("*i64" if n in ("cu_seqlens", "ck_offsets") else "*fp32") for n in names}
                sig.update({n: "constexpr" for n in consts})
                compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
                cubin = Path(tmp) / f"{kind}{D}.cubin"
                cubin.write_bytes(compiled.asm["cubin"])
                sass = subprocess.run([str(ks.triton_bin("cuobjdump")), "-sass", str(cubin)], capture_output=True,
                                      text=True, check=True).stdout
                usage = subprocess.run([str(ks.triton_bin("cuobjdump")), "-res-usage", str(cubin)],
                                       capture_output=True, text=True, check=True).stdout
                res = next((ln.strip() for ln in usage.splitlines() if "REG" in ln), "")
                grid = "B*H" if kind == "cov" else f"B*H*{BD // min(32, BD)}"
                k = kernel_from_sass(f"bl_chunk_{kind}_kernel", sass, compiled.asm["ttgir"], 8, res,
                                     compiled.metadata.shared, {"D": D, "role": kind, "programs": grid,
                                                                "steps": "chunks", "sass_sha256":
                                                                hashlib.sha256(sass.encode()).hexdigest()})
                kernels.append(k.to_json())
    from bayeslayer.experiments.common.provenance import write_record

    write_record(out, {"what": "v1's chunk-serial forward kernels (bl_chunk_cov_kernel, bl_chunk_mean_kernel) as "
                       "compiled for sm_90, read by benchmarks/cost_model.py: per instruction "
                       "'op|guarded|stall|write_sb|read_sb|wait_mask|target|arg'",
                       "source_commit": V1_COMMIT, "source_file": "bayeslayer/ops/triton/kernels.py",
                       "triton": triton.__version__, "arch": "sm_90", "chunk_size": 64,
                       "command": "python benchmarks/cost_model.py --extract-v1", "kernels": kernels})
    return out


def load_v1(path: Path = V1_RECORD) -> dict:
    data = json.loads(Path(path).read_text())
    return {(k["meta"]["role"], k["meta"]["D"]): Kernel.from_json(k) for k in data["kernels"]}


def v1_measured() -> list[dict]:
    """v1's measured forward rows (B = 2, H = 16, bf16, C = 64) and the profile's split at T = 8k, D = 128."""
    rows = []
    for name in V1_MEASURED:
        for r in json.loads((ROOT / name).read_text())["rows"]:
            if "bl" in r:
                rows.append({"BH": r["B"] * r["H"], "T": r["T"], "D": r["D"], "fwd_s": r["bl"]["fwd_s"],
                             "source": name})
    # the T = 2048 rows of the first benchmark (results/gpu/2026-11-30_h200_bench_t2048.log)
    log = (ROOT / "results/gpu/2026-11-30_h200_bench_t2048.log").read_text()
    import re

    for D, fwd in re.findall(r"^\s*2048\s+(\d+) \| BL measured in \d+ s: \{\"fwd_s\": ([0-9.]+)", log, re.M):
        if not any(r["T"] == 2048 and r["D"] == int(D) for r in rows):
            rows.append({"BH": 32, "T": 2048, "D": int(D), "fwd_s": float(fwd),
                         "source": "results/gpu/2026-11-30_h200_bench_t2048.log"})
    return sorted(rows, key=lambda r: (r["D"], r["T"]))


V1_PROFILE_LOG = "results/gpu/2026-11-30_h200_profile.log"


@functools.cache
def v1_profile() -> dict:
    """The profile of v1's forward at B·H = 32, T = 8k, D = 128 (:data:`V1_PROFILE_LOG`): its two kernels' device
    times, all device time of the call, and ``host_s``: the measured call's time (the benchmark row at that shape)
    minus all its device time, i.e. the part of the call during which the GPU ran nothing.  v1's forward reads
    device data on the host before its first launch (value checks, the float64 promotion), so the GPU idles while
    the host validates and prepares; the rows agree: their intercept of time against T is 0.7-1.0 ms at every D
    (``--check-v1`` prints it)."""
    import re

    text = (ROOT / V1_PROFILE_LOG).read_text()
    fwd = text.split("# profile: BL forward+backward")[0]
    head = re.search(r"# profile: BL forward, T=(\d+) D=(\d+) B=(\d+) H=(\d+)", fwd)
    T, D = int(head.group(1)), int(head.group(2))

    def cuda_ms(name):
        m = re.search(rf"^\s*{name}\s.*?([0-9.]+)ms\s+[0-9.]+%\s+[0-9.]+ms", fwd, re.M)
        return float(m.group(1)) / 1e3

    total = float(re.search(r"Self CUDA time total: ([0-9.]+)ms", fwd).group(1)) / 1e3
    row = next(r for r in v1_measured() if r["T"] == T and r["D"] == D)
    return {"D": D, "T": T, "cov_s": cuda_ms("bl_chunk_cov_kernel"), "mean_s": cuda_ms("bl_chunk_mean_kernel"),
            "device_s": total, "fwd_s": row["fwd_s"], "host_s": row["fwd_s"] - total}


def predict_v1(BH: int, T: int, D: int, kernels: dict | None = None, C: int = 64) -> dict:
    """v1's forward at (B·H, T, D): the host's part before the first launch (:func:`v1_profile`), the covariance
    kernel (B·H programs), then the mean kernel (B·H·D/BV), each stepping over every chunk."""
    kernels = kernels or load_v1()
    nc = math.ceil(T / C)
    cov, mean = kernels[("cov", D)], kernels[("mean", D)]
    BD = max(16, 1 << (D - 1).bit_length())
    c = kernel_seconds(cov, BH, nc)
    m = kernel_seconds(mean, BH * (BD // min(32, BD)), nc)
    host = v1_profile()["host_s"]
    return {"cov_s": c["seconds"], "mean_s": m["seconds"], "host_s": host,
            "fwd_s": host + c["seconds"] + m["seconds"],
            "cov_step_cycles": c["step_cycles"], "mean_step_cycles": m["step_cycles"]}


def _intercepts(rows_: list[dict], key: str) -> dict:
    """Per D: the intercept of ``key`` (seconds) against chunks, least squares over the rows' T."""
    out = {}
    for D in sorted({r["D"] for r in rows_}):
        xs = [r["T"] / 64 for r in rows_ if r["D"] == D]
        ys = [r[key] for r in rows_ if r["D"] == D]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-30)
        out[D] = (my - b * mx, b)
    return out


def check_v1(out=print) -> float:
    """Predicted against measured, every v1 row; returns the largest relative error."""
    kernels = load_v1()
    worst = 0.0
    out(f"# v1 (commit {V1_COMMIT[:7]}), SASS from {V1_RECORD.relative_to(ROOT)}; ms measured / predicted")
    for r in v1_measured():
        p = predict_v1(r["BH"], r["T"], r["D"], kernels)
        err = (p["fwd_s"] - r["fwd_s"]) / r["fwd_s"]
        worst = max(worst, abs(err))
        out(f"  B·H={r['BH']} T={r['T']:>6} D={r['D']:>4}: {r['fwd_s'] * 1e3:8.2f} / {p['fwd_s'] * 1e3:8.2f}  "
            f"({err:+.0%}; step cycles cov {p['cov_step_cycles']:.0f}, mean {p['mean_step_cycles']:.0f})")
    pr = v1_profile()
    p = predict_v1(32, pr["T"], pr["D"], kernels)
    out(f"  profile T={pr['T']} D={pr['D']}: covariance kernel {pr['cov_s'] * 1e3:.2f} / {p['cov_s'] * 1e3:.2f} ms, "
        f"mean kernel {pr['mean_s'] * 1e3:.2f} / {p['mean_s'] * 1e3:.2f} ms, host before the first launch "
        f"{pr['host_s'] * 1e3:.2f} ms (measured call {pr['fwd_s'] * 1e3:.2f} - device {pr['device_s'] * 1e3:.2f})")
    meas = v1_measured()
    for r in meas:
        r["pred_dev_s"] = predict_v1(r["BH"], r["T"], r["D"], kernels)["fwd_s"] - pr["host_s"]
    fit_m, fit_p = _intercepts(meas, "fwd_s"), _intercepts(meas, "pred_dev_s")
    out("  per D, measured: intercept ms + ms per chunk; predicted device per chunk: " + ", ".join(
        f"D={D} {fit_m[D][0] * 1e3:.2f} + {fit_m[D][1] * 1e3:.4f} / {fit_p[D][1] * 1e3:.4f}" for D in sorted(fit_m)))
    out(f"v1 max relative error {worst:.3f}")
    return worst


# ---------------------------------------------------------------------------------------------------------------
# what a call launches at a row's shape, and its time
# ---------------------------------------------------------------------------------------------------------------

def _cache_file(kind: str, key: str) -> Path:
    return CACHE / f"{kind}_{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


@functools.cache
def _code_key() -> str:
    """What the recorded launches and compiled kernels depend on: the package's and fla's sources, the recorder
    (``kernel_sass.py``), Triton, NumPy (Triton's interpreter runs on it).  Not ``crossover.py``: its figures,
    which this script writes, only steer the dispatch's choice of covariance pass, which every BL recording holds
    fixed (``path``)."""
    import numpy
    import triton

    h = hashlib.sha256(f"{triton.__version__} {numpy.__version__}".encode())
    for path in [*sorted((ROOT / "bayeslayer" / "ops").rglob("*.py")), Path(ks.__file__)]:
        if path.name != "crossover.py":
            h.update(path.read_bytes())
    try:
        import fla

        h.update(getattr(fla, "__version__", "").encode())
    except ImportError:
        pass
    return h.hexdigest()[:16]


STEP_D = 16  # head dimension of the executed recordings that count chunk-loop steps (steps do not depend on D)


def path_at(which: str, BH: int, T: int, D: int) -> str | None:
    """The covariance pass BL's dispatch runs at (B·H, T, D) on the GPU's SMs (``covariance_path``, the package's
    own rule: ``"chain"`` or ``"scan"``); None for fla's GDN."""
    if which != "bl":
        return None
    from bayeslayer.ops.bayesian_layer.chunk_triton import covariance_path

    return covariance_path(BH, T, D, sms=SM90["sms"])


def segments_at(which: str, BH: int, T: int, C: int = 64, path: str | None = "scan") -> int:
    """Segments per sequence the segment scan splits a call at (B·H, T) into, by the package's own rule
    (``choose_segment_chunks`` on the GPU's SM count); 1 for fla's GDN and the covariance chain."""
    if which != "bl" or path != "scan":
        return 1
    from bayeslayer.ops.bayesian_layer.scan import choose_segment_chunks

    nc = math.ceil(T / C)
    return math.ceil(nc / choose_segment_chunks(BH, nc, T, sms=SM90["sms"]))


def _recording_jobs(which: str, D: int, S: int, C: int = 64, path: str | None = None) -> list[dict]:
    """The four recordings a call's plan at any T is derived from (B = 1, one head, the dispatch held at covariance
    pass ``path`` and ``S`` segments): two executed at head dimension :data:`STEP_D` and S·1, S·2 chunks (at least
    2, 4), counting every launch's chunk-loop steps; two skipped at the call's D and a multiple of 16 chunks and
    twice that (the backward recomputes blocks of 16 chunks), giving grids, bytes and PyTorch ops.  Each quantity
    is linear in the chunk count at fixed S, so two points give it at any T."""
    n1, m1 = max(2, S), 16 * S // math.gcd(16, S)
    common = dict(which=which, B=1, H=1, dtype="bf16", backward=True, segments=S if path == "scan" else None)
    if path is not None:
        common["path"] = path
    return [dict(common, T=n1 * C, D=STEP_D, execute=True), dict(common, T=2 * n1 * C, D=STEP_D, execute=True),
            dict(common, T=m1 * C, D=D, execute=False), dict(common, T=2 * m1 * C, D=D, execute=False)]


def recorded_many(jobs: list[dict]) -> list[dict]:
    """:func:`kernel_sass.record_many`, each job cached on disk per code state; the missing ones in one child
    process."""
    keys = [_cache_file("launches", json.dumps([_code_key(), j], sort_keys=True)) for j in jobs]
    missing = [j for j, f in zip(jobs, keys) if not f.is_file()]
    if missing:
        done: list = []
        try:
            done = ks.record_many(missing)
        except ks.RecordingError as e:
            done = e.done
            raise
        finally:
            for f, rec in zip([f for f in keys if not f.is_file()], done):
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(json.dumps(rec))
    return [json.loads(f.read_text()) for f in keys]


def compiled_kernel(launch: dict) -> Kernel:
    """A recorded launch compiled for sm_90 and read (:func:`kernel_from_sass`), cached on disk."""
    import triton

    key = ks.launch_key(launch) + triton.__version__ + _code_key()
    f = _cache_file("kernel", key)
    if f.is_file():
        return Kernel.from_json(json.loads(f.read_text()))
    c = ks.compile_launch(launch)
    k = kernel_from_sass(launch["kernel"], c["sass"], c["ttgir"], c["num_warps"], c["resources"], c["shared_bytes"],
                         {"triton": c["triton"], "census": ks.sass_census(c["sass"], c["resources"])})
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(k.to_json()))
    return k


def _prod(g) -> int:
    return g[0] * g[1] * g[2]


def _lin(y1: float, y2: float, x1: float, x2: float, x: float) -> float:
    return y1 + (y2 - y1) * (x - x1) / (x2 - x1)


def _chunk_of(launch: dict, default: int) -> int:
    """The chunk size a recorded launch was compiled for: its ``BT`` constexpr (fla's kernels), else ``default``."""
    names = list(launch["signature"])
    if "BT" in names:
        i = names.index("BT")
        for path, value in launch["constexprs"]:
            if path == [i] and isinstance(value, int):
                return value
    return default


def plan(which: str, BH: int, T: int, D: int, backward: bool, C: int = 64, path: str | None = None) -> dict:
    """The launches of one call at (B·H, T, D), ready to time: each with its kernel, programs, chunk-loop steps
    and bytes.  ``path``: BL's covariance pass (None: the dispatch's choice at this shape, :func:`path_at`).

    Nothing runs at the row's shape: the dispatch's covariance pass and segment count S are computed for it
    (:func:`path_at`, :func:`segments_at`), the call is recorded at one head and a few chunks with both held
    (:func:`_recording_jobs`), and every launch's
    programs, steps and bytes, and the PyTorch ops between them, are carried linearly in the chunk count from two
    recordings to the row's T, then times B·H.  The recordings must launch the same kernels in the same order.  A
    kernel the interpreter cannot run has no counted steps: a grid that does not grow with T steps over every
    chunk, one that grows is chunk-parallel (one step)."""
    nc = math.ceil(T / C)
    path = path or path_at(which, BH, T, D)
    S = segments_at(which, BH, T, C, path)
    jobs = _recording_jobs(which, D, S, C, path)
    ex1, ex2, sk1, sk2 = recorded_many(jobs)
    n1, n2, m1, m2 = (j["T"] // C for j in jobs)
    phases = ("fwd", "bwd") if backward else ("fwd",)
    lists = [[x for x in r["launches"] if x["phase"] in phases] for r in (ex1, ex2, sk1, sk2)]
    names = [[(x["phase"], x["kernel"]) for x in lst] for lst in lists]
    if any(nm != names[0] for nm in names[1:]):
        raise RuntimeError(f"{which} B·H={BH} T={T} D={D}: the recordings launch different kernels: {names}")
    out = []
    for e1, e2, a, b in zip(*lists):
        programs = max(1, round(_lin(_prod(a["grid"]), _prod(b["grid"]), m1, m2, nc))) * BH
        if isinstance(e1.get("steps"), str) or isinstance(e2.get("steps"), str):
            if a["module"].startswith("bayeslayer"):
                raise RuntimeError(f"{a['kernel']} did not run in the interpreter: {e1['steps'] or e2['steps']}")
            # the interpreter cannot run it (fla's fwd_h, bwd_dhu): a grid that does not grow with T steps over
            # every chunk (of its own chunk size, fla's BT) of its program's sequence, one that grows with T is
            # chunk-parallel
            steps = float(math.ceil(T / _chunk_of(a, C))) if _prod(a["grid"]) == _prod(b["grid"]) else 1.0
        else:
            steps = 0.0 if e1.get("steps") is None else max(0.0, _lin(e1["steps"], e2["steps"] or 0, n1, n2, nc))
        out.append({"launch": a, "programs": programs, "steps": math.ceil(steps),
                    "bytes": _lin(a["arg_bytes"], b["arg_bytes"], m1, m2, nc) * BH, "phase": a["phase"]})
    key = "torch_ops_fwdbwd" if backward else "torch_ops_fwd"
    ops = max(0.0, _lin(sk1[key], sk2[key], m1, m2, nc))
    mem = "peak_bytes_fwdbwd" if backward else "peak_bytes_fwd"
    peak = _lin(sk1[mem], sk2[mem], m1, m2, nc) * BH
    return {"launches": out, "torch_ops": ops, "segments": S, "path": path, "peak_bytes": peak}


def prefetch(shapes) -> None:
    """Record every (which, B·H, T, D) of ``shapes`` that is not cached yet, in one child process."""
    jobs = []
    for which, BH, T, D in shapes:
        path = path_at(which, BH, T, D)
        for j in _recording_jobs(which, D, segments_at(which, BH, T, path=path), path=path):
            if j not in jobs:
                jobs.append(j)
    recorded_many(jobs)


def launch_seconds(item: dict) -> dict:
    k = compiled_kernel(item["launch"])
    r = kernel_seconds(k, item["programs"], item["steps"])
    r["memory_seconds"] = item["bytes"] / SM90["copy_bytes_s"]
    r["device_seconds"] = max(r["seconds"], r["memory_seconds"])
    return r


def call_seconds(p: dict, host: tuple) -> dict:
    """``max(Σ device, host)`` of a planned call; host = forward launches · ``host[0]`` + backward launches ·
    ``host[1]`` + PyTorch ops · :data:`HOST_S_PER_TORCH_OP`."""
    device = [launch_seconds(x)["device_seconds"] for x in p["launches"]]
    n_b = sum(x["phase"] == "bwd" for x in p["launches"])
    host = (len(p["launches"]) - n_b) * host[0] + n_b * host[1] + (p["torch_ops"] or 0) * HOST_S_PER_TORCH_OP
    return {"seconds": max(sum(device), host), "device_s": sum(device), "host_s": host}


def gdn_measured() -> list[dict]:
    """fla GDN's measured rows on the H200 (2026-11-30, B = 2, H = 16, D = 64, bf16; autotuned)."""
    rows = []
    for r in json.loads((ROOT / GDN_MEASURED).read_text())["rows"]:
        rows.append({"BH": r["B"] * r["H"], "T": r["T"], "D": r["D"], "fwd_s": r["gdn"]["fwd_s"],
                     "fwdbwd_s": r["gdn"]["fwdbwd_s"]})
    import re

    log = (ROOT / "results/gpu/2026-11-30_h200_bench_t2048.log").read_text()
    m = re.search(r"^\s*2048\s+64 \|\s+[0-9.]+\s+([0-9.]+)\s+[0-9.]+ \|\s+[0-9.]+\s+([0-9.]+)", log, re.M)
    if m:
        rows.append({"BH": 32, "T": 2048, "D": 64, "fwd_s": float(m.group(1)) / 1e3,
                     "fwdbwd_s": float(m.group(2)) / 1e3})
    return sorted(rows, key=lambda r: r["T"])


@functools.cache
def host_per_launch() -> tuple:
    """Host seconds per Triton launch in a forward and in autograd's backward: the two free parameters taken from a
    measured call, fla's GDN forward and forward+backward at B·H = 32, T = 8k, D = 64 (host-bound: the device work
    is a small part of them): (measured − PyTorch ops' host time) / launches."""
    row = next(r for r in gdn_measured() if r["T"] == 8192)
    f = plan("gdn", row["BH"], row["T"], row["D"], False)
    fb = plan("gdn", row["BH"], row["T"], row["D"], True)
    h_f = max(0.0, (row["fwd_s"] - (f["torch_ops"] or 0) * HOST_S_PER_TORCH_OP) / len(f["launches"]))
    n_b = sum(x["phase"] == "bwd" for x in fb["launches"])
    rest = row["fwdbwd_s"] - (len(fb["launches"]) - n_b) * h_f - (fb["torch_ops"] or 0) * HOST_S_PER_TORCH_OP
    return h_f, max(0.0, rest / max(n_b, 1))


def predict(BH: int, T: int, D: int, variant: str = "default") -> dict:
    """Predicted seconds of GDN and BL (``variant``: ``"default"``, the code as it stands), forward and
    forward+backward, and the ratios."""
    if variant != "default":
        raise ValueError(f"variant must be 'default', got {variant!r}")
    h = host_per_launch()
    out = {"variant": variant, "BH": BH, "D": D, "T": T}
    for which in ("gdn", "bl"):
        for phase in ("fwd", "fwdbwd"):
            p = plan(which, BH, T, D, phase == "fwdbwd")
            out[f"{which}_{phase}"] = call_seconds(p, h)
            out[f"{which}_{phase}_peak_bytes"] = p["peak_bytes"]
    out["fwd_ratio"] = out["bl_fwd"]["seconds"] / out["gdn_fwd"]["seconds"]
    out["fwd_bwd_ratio"] = out["bl_fwdbwd"]["seconds"] / out["gdn_fwdbwd"]["seconds"]
    out["fwd_memory_ratio"] = out["bl_fwd_peak_bytes"] / out["gdn_fwd_peak_bytes"]
    out["fwd_bwd_memory_ratio"] = out["bl_fwdbwd_peak_bytes"] / out["gdn_fwdbwd_peak_bytes"]
    return out


def rows(variant: str = "default") -> list[dict]:
    prefetch([(w, BH, T, D) for w in ("gdn", "bl") for BH in ROW_BH for D in ROW_D for T in ROW_T]
             + [("gdn", r["BH"], r["T"], r["D"]) for r in gdn_measured()])
    out = []
    for BH in ROW_BH:
        for D in ROW_D:
            for T in ROW_T:
                p = predict(BH, T, D, variant)
                out.append({"variant": variant, "BH": BH, "D": D, "T": T, "fwd_ratio": round(p["fwd_ratio"], 3),
                            "fwd_bwd_ratio": round(p["fwd_bwd_ratio"], 3),
                            **{f"{k}_ms": round(p[k]["seconds"] * 1e3, 4) for k in
                               ("gdn_fwd", "bl_fwd", "gdn_fwdbwd", "bl_fwdbwd")},
                            "fwd_memory_ratio": round(p["fwd_memory_ratio"], 3),
                            "fwd_bwd_memory_ratio": round(p["fwd_bwd_memory_ratio"], 3),
                            **{f"{k}_peak_gib": round(p[f"{k}_peak_bytes"] / 2 ** 30, 4) for k in
                               ("gdn_fwd", "bl_fwd", "gdn_fwdbwd", "bl_fwdbwd")}})
    return out


def check_gdn(out=print) -> float:
    h = host_per_launch()
    worst = 0.0
    out(f"# fla GDN (2026-11-30 H200 rows, autotuned; model: first configs), ms measured / predicted; host "
        f"{h[0] * 1e6:.0f} / {h[1] * 1e6:.0f} us per forward / backward launch (from the T=8192 row)")
    for r in gdn_measured():
        f = call_seconds(plan("gdn", r["BH"], r["T"], r["D"], False), h)["seconds"]
        fb = call_seconds(plan("gdn", r["BH"], r["T"], r["D"], True), h)["seconds"]
        e = max(abs(f - r["fwd_s"]) / r["fwd_s"], abs(fb - r["fwdbwd_s"]) / r["fwdbwd_s"])
        worst = max(worst, e)
        out(f"  B·H={r['BH']} T={r['T']:>6} D={r['D']}: fwd {r['fwd_s'] * 1e3:.2f} / {f * 1e3:.2f}, fwd+bwd "
            f"{r['fwdbwd_s'] * 1e3:.2f} / {fb * 1e3:.2f}")
    out(f"gdn max relative error {worst:.3f}")
    return worst


# ---------------------------------------------------------------------------------------------------------------
# chain or segment scan: the figures of bayeslayer.ops.bayesian_layer.crossover
# ---------------------------------------------------------------------------------------------------------------

CROSSOVER_SHAPE = (32, 32768)  # (B·H, T) the figures are taken at: the scan splits each chain into 8 segments


def crossover_figures(D: int) -> dict:
    """(step cycles, programs per SM) of the covariance chain's forward kernel and of the segment scan's kernels
    at head dimension ``D``, as the dispatch launches them at :data:`CROSSOVER_SHAPE` with each path forced (the
    step at the programs per SM they run at there): the chain's chunk step; Phase A's chunk kernel from P = 0 and
    its tracking kernel, Phase B's segment step, Phase C's replay."""
    BH, T = CROSSOVER_SHAPE
    out = {}
    chain = plan("bl", BH, T, D, False, path="chain")["launches"]
    scan = plan("bl", BH, T, D, False, path="scan")["launches"]
    names = [x["launch"]["kernel"] for x in scan]
    b = names.index("scan_phase_b_kernel")
    picks = {"chain": next(x for x in chain if x["launch"]["kernel"] == "chain_forward_kernel"),
             "a": scan[max(i for i in range(b) if names[i] == "bl_chunk_cov_kernel")],
             "track": scan[names.index("scan_track_kernel")], "b": scan[b],
             "c": scan[b + 1 + names[b + 1:].index("bl_chunk_cov_kernel")]}
    for role, x in picks.items():
        k = compiled_kernel(x["launch"])
        r = kernel_seconds(k, x["programs"], 1)
        out[role] = [round(r["step_cycles"]), occupancy(k)]
    return out


def crossover(out=print) -> dict:
    """The figures of ``bayeslayer.ops.bayesian_layer.crossover`` from the kernels as the dispatch launches them,
    the chain kernel's census, and the crossover they give per D and T."""
    from bayeslayer.ops.bayesian_layer import crossover as xo
    from bayeslayer.ops.bayesian_layer.chunk_triton import CHAIN_CHUNK_SIZE

    figures, chain = {}, {}
    for D in ROW_D:
        figures[D] = crossover_figures(D)
        x = next(x for x in plan("bl", *CROSSOVER_SHAPE, D, False, path="chain")["launches"]
                 if x["launch"]["kernel"] == "chain_forward_kernel")
        k = compiled_kernel(x["launch"])
        w = simulate_cached(k, max(1, math.ceil(k.num_warps / 4)))
        chain[D] = {"registers": k.registers, "shared_bytes": k.shared_bytes,
                    "spill_bytes": k.meta["census"]["spill_bytes"],
                    "sass_tensor_core": k.meta["census"]["sass_tensor_core"],
                    "step_us": figures[D]["chain"][0] / SM90["clock_hz"] * 1e6,
                    "step_instructions_per_warp": sum(w.step_counts.values()),
                    "step_counts": {o: w.step_counts.get(o, 0) for o in ("HMMA", "BAR", "LDL", "STL", "LDS", "STS",
                                                                         "SHFL", "FFMA")}}
        # beside it, for the docs: the reverse chain's step and fla's state pass (GDN's fwd_h) at the same shape
        steps = {}
        for which, kernel in (("bl", "chain_backward_kernel"), ("gdn", "chunk_gated_delta_rule_fwd_kernel_h")):
            y = next(y for y in plan(which, *CROSSOVER_SHAPE, D, True, path="chain" if which == "bl" else None)
                     ["launches"] if y["launch"]["kernel"].startswith(kernel))
            steps[kernel] = kernel_seconds(compiled_kernel(y["launch"]), y["programs"], 1)["step_cycles"]
        chain[D]["backward_step_us"] = steps["chain_backward_kernel"] / SM90["clock_hz"] * 1e6
        chain[D]["gdn_fwd_h_step_us"] = steps["chunk_gated_delta_rule_fwd_kernel_h"] / SM90["clock_hz"] * 1e6
        out(f"# D={D}: step cycles (programs per SM) " + ", ".join(f"{r} {c} ({o})" for r, (c, o) in
                                                                 figures[D].items()))
    chunks = {"chain": CHAIN_CHUNK_SIZE, "scan": 64}
    figs = {d: {r: tuple(v) for r, v in f.items()} for d, f in figures.items()}
    tab = {str(D): {str(T): xo.crossover_chains(T, D, figures=figs, chunks=chunks) for T in (4160, *ROW_T[1:])}
           for D in ROW_D}
    out("# chains below which the scan is predicted faster (of 132 SMs): " + "; ".join(
        f"D={D}: " + ", ".join(f"T={T} {n}" for T, n in v.items()) for D, v in tab.items()))
    return {"figures": figures, "chunks": chunks, "chain_kernel": chain, "crossover_chains": tab}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check-v1", action="store_true")
    p.add_argument("--extract-v1", action="store_true")
    p.add_argument("--check-gdn", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, help="with --json or --crossover: also write a record (with provenance) here")
    p.add_argument("--crossover", action="store_true",
                   help="the chain-or-scan figures (bayeslayer.ops.bayesian_layer.crossover); --out: their record")
    args = p.parse_args(argv)
    if args.crossover:
        import triton

        res = crossover()
        if args.out:
            from bayeslayer.experiments.common.provenance import write_record

            write_record(args.out, {
                "what": "step cycles (programs per SM) of the covariance chain's forward kernel and of the segment "
                        "scan's kernels for bayeslayer.ops.bayesian_layer.crossover, predicted from their sm_90 "
                        "SASS; chunks: the tokens per step of each; crossover_chains: per D and T, the largest "
                        "chain count at which the scan is predicted faster",
                "triton": triton.__version__, **res})
        return 0
    if args.check_gdn:
        check_gdn()
        return 0
    if args.json:
        import time

        import triton

        t0 = time.time()
        out = rows()
        print(json.dumps(out))
        if args.out:
            from bayeslayer.experiments.common.provenance import write_record

            write_record(args.out, {
                "what": "predicted BL (the default path as the dispatch launches it) against fla's GDN on an H200, "
                        "forward and forward+backward, bf16, C = 64, from the kernels compiled for sm_90; peak "
                        "memory above the inputs from what the calls' host code allocates (every launch skipped)",
                "triton": triton.__version__, "clock_hz": SM90["clock_hz"], "host_s_per_launch": host_per_launch(),
                "host_s_per_torch_op": HOST_S_PER_TORCH_OP, "targets": {"fwd": TARGET_FWD, "fwd_bwd": TARGET_FWD_BWD,
                                                                      "memory": TARGET_MEMORY},
                "v1_max_relative_error": round(check_v1(out=lambda *_: None), 3),
                "gdn_max_relative_error": round(check_gdn(out=lambda *_: None), 3), "rows": out},
                wall_seconds=time.time() - t0)
        return 0
    if args.extract_v1:
        print(f"wrote {extract_v1().relative_to(ROOT)}")
        return 0
    if args.check_v1:
        check_v1()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
