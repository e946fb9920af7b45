"""Cost model of the Bayesian Layer's segment-scan forward and backward against fla's GDN on an H200.

    python benchmarks/cost_model.py                          # B·H ∈ {32, 128}, D ∈ {64, 128}, T ∈ {2k, 8k, 32k}
    python benchmarks/cost_model.py --launches 2 16 8192 64  # every launch of one shape, per variant
    python benchmarks/cost_model.py --measured out/scan.json # predictions beside a device check's rows (recalibrated)

Every launch of a forward or backward is counted at (B, H, T, D; C, segments): FLOPs by unit (tensor-core bf16 /
tf32 / fp64, FFMA fp32 / fp64), HBM bytes read and written, programs (CTAs) and serial depth (dependent steps per
program and the FLOPs of each step).  A launch takes

    launch_s + max(roofline, waves · steps · (t0[kind] + step FLOPs / (peak per SM · eff_serial)))
    roofline = max(Σ_unit FLOPs / (peak · eff_par), bytes / (bandwidth · eff_bw)) / min(1, programs / SMs)

and a call takes max(device time, host time), host time = host_per_op · (launches + PyTorch ops), since the host
queues work asynchronously.  The constants come from the device (:data:`H200`), from assumptions stated in
:data:`ASSUMED`, and from a fit on the 2026-11-30 H200 measurements (:func:`calibrate`): the chunk-serial forward's
per-chunk times give the covariance and mean kernels' step overheads and the serial rate, GDN's forward and
forward+backward at D = 64 its fwd_h step overhead and the host cost per op.  With ``--measured``, a device check's
rows (``benchmarks/gpu.py --scan`` JSON) refit the covariance step from BL's measured Phase C times and GDN's
constants from its times, and the table shows measured beside predicted.

Variants (:data:`VARIANTS`):

- ``v1``: the chunk-serial forward the 2026-11-30 numbers measured (one program per (sequence, head)); for the fit.
- ``built``: the segment scan as it is (float64 prep and Phase A with T·D-sized float64 W/L⁻¹, fp32 copies of
  q/k/v, IEEE FFMA covariance products, w/kw/vu cast to bf16 for fla's mean pass, segments chosen by
  ``bayeslayer.ops.bayesian_layer.scan.choose_segment_chunks``), backward ``"scan"`` (fla's mean-pass backward, the
  substitution's adjoint, B2–B4).
- ``cuts``: the same after the planned cuts: no T·D float64 tensor (Phase A on the fp32 prep, W/L⁻¹ kept in fp32),
  the covariance products as 3×TF32 ``tl.dot`` (tensor cores, three passes), W and the substituted tensors written
  once in bf16 (no cast pass), one segment per sequence when B·H ≥ the SM count (no Phase A/B).

What the model does not know is said in :data:`ASSUMED`; its numbers are estimates, not measurements.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# H200 (SXM): measured on an H200 where marked, else the vendor's datasheet (the H100's rates)
H200 = {
    "sms": 132,
    "bandwidth": 4.3e12,  # device-to-device copy, measured (bytes read + written per second)
    "tc_bf16": 788e12,  # 8192³ bf16 matmul, measured
    "tc_tf32": 394e12,  # half the bf16 rate (datasheet ratio)
    "tc_fp64": 67e12,  # datasheet, DMMA
    "ffma_fp32": 67e12,  # datasheet
    "ffma_fp64": 34e12,  # datasheet
}
UNITS = ("tc_bf16", "tc_tf32", "tc_fp64", "ffma_fp32", "ffma_fp64")

# not measured anywhere: the model's assumptions
ASSUMED = {
    "eff_par": 0.5,  # parallel kernels reach half a unit's peak
    "eff_bw": 0.8,  # and 80% of the copy bandwidth
    "launch_s": 4e-6,  # device-side gap per launch
    "segment_t0": 1.0,  # Phase B / B3 step overhead = the covariance step's × this (D×D LDLᵀ chains)
    "adjoint_t0": 2.0,  # B2 / B4 step overhead = the covariance step's × this (replay + reverse chain)
    "tc_split": 3,  # 3×TF32: three tensor-core passes per product
}


@dataclass
class Launch:
    """One kernel launch (or PyTorch op): what it computes, moves and waits for."""

    name: str
    phase: str
    flops: dict = field(default_factory=dict)  # unit -> FLOPs (whole launch)
    bytes: float = 0.0  # HBM bytes read + written
    programs: int = 1  # independent programs
    steps: int = 0  # dependent steps per program (0: fully parallel)
    step_flops: dict = field(default_factory=dict)  # unit -> FLOPs per program per step
    kind: str = ""  # which step overhead t0 applies
    torch_op: bool = False  # a PyTorch op (host cost, no Triton compile)
    backward: bool = False  # queued by autograd's backward (its host cost per op differs)


def _add(d: dict, unit: str, x: float) -> dict:
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    d[unit] = d.get(unit, 0.0) + x
    return d


def _check_shape(B, H, T, D, C):
    for name, x in (("B", B), ("H", H), ("T", T), ("D", D), ("C", C)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")


def segments(N: int, T: int, C: int) -> int:
    """Segments per sequence as the forward chooses them (``choose_segment_chunks``) for N chains."""
    from bayeslayer.ops.bayesian_layer.scan import choose_segment_chunks

    nc = math.ceil(T / C)
    return math.ceil(nc / choose_segment_chunks(N, nc, T))


def cut_segments(N: int, T: int, C: int, sms: int = H200["sms"]) -> int:
    """Segments per sequence after the cuts: as many as fit one wave of programs (one per SM: the covariance
    kernels hold a whole register file), so one when the N chains already fill half the SMs or more; none
    shorter than 4 chunks.  A second wave doubles the serial depth that more segments were meant to cut."""
    nc = math.ceil(T / C)
    return max(1, min(sms // max(N, 1), nc // 4))


def cov_step_flops(D: int, C: int) -> float:
    """FLOPs of one chunk step of the covariance kernel: Y = K̃P (2CD²), S = YK̃ᵀ (2C²D), LDLᵀ and L⁻¹ of S
    (C³/3 each), L⁻¹Y (2C²D), the rank-C update of P (2CD²)."""
    return 4 * C * D * D + 4 * C * C * D + 2 * C**3 / 3


def track_step_flops(D: int, C: int) -> float:
    """One chunk of the tracking kernel: fla's fwd_h recurrence with a D×D state (W·H, Kᵀ·(…): 4CD²) and
    J += Hᵀdiag(β)H (2CD²)."""
    return 6 * C * D * D


def segment_step_flops(D: int) -> float:
    """One segment of Phase B (or B3): two D×D LDLᵀ (D³/3 each), GᵀJG (4D³), A·G·L⁻ᵀ (2D³), ZZᵀ (2D³)."""
    return 2 * D**3 / 3 + 8 * D**3


def gdn_forward(B, H, T, D, C=64) -> list[Launch]:
    """fla's ``chunk_gated_delta_rule`` forward, bf16 (m = D): cumsum, A = βKKᵀ, solve_tril, w/u, fwd_h, fwd_o."""
    _check_shape(B, H, T, D, C)
    n, nc, tok = B * H, math.ceil(T / C), B * H * T
    BV = 32 if D <= 64 else 64  # fwd_h's value tile (its first configs)
    out = [
        Launch("chunk_local_cumsum", "gdn", bytes=tok * 8, programs=n * nc),
        Launch("chunk_scaled_dot_kkt", "gdn", {"tc_bf16": tok * 2 * C * D}, tok * (2 * D + 4 * C), n * nc),
        Launch("solve_tril", "gdn", {"ffma_fp32": tok * C * C / 3}, tok * 8 * C, n * nc),
        Launch("recompute_w_u", "gdn", {"tc_bf16": tok * 2 * C * (2 * D)}, tok * (4 * D + 2 * C + 4 * D), n * nc),
        Launch("fwd_h", "gdn", {"tc_bf16": tok * 4 * D * D}, tok * (6 * D + 2 * D) + n * nc * 2 * D * D,
               n * math.ceil(D / BV), nc, {"tc_bf16": 4 * C * D * BV}, "fwd_h"),
        Launch("fwd_o", "gdn", {"tc_bf16": tok * (2 * D * D + 2 * C * D + 2 * C * D)},
               tok * 8 * D + n * nc * 2 * D * D, n * nc * math.ceil(D / BV)),
    ]
    return out


def gdn_backward(B, H, T, D, C=64) -> list[Launch]:
    """fla's GDN backward: w/u recompute, fwd_h recompute, dv local, bwd_dhu (serial, reverse), dq/dk/dw/dg,
    WY backward, reverse cumsum."""
    return [_as_backward(x) for x in _gdn_backward(B, H, T, D, C)]


def _as_backward(x: Launch) -> Launch:
    x.backward = True
    return x


def _gdn_backward(B, H, T, D, C) -> list[Launch]:
    _check_shape(B, H, T, D, C)
    n, nc, tok = B * H, math.ceil(T / C), B * H * T
    BV = 32 if D <= 64 else 64
    fwd = {x.name: x for x in gdn_forward(B, H, T, D, C)}
    return [
        Launch("recompute_w_u (bwd)", "gdn_bwd", dict(fwd["recompute_w_u"].flops), fwd["recompute_w_u"].bytes,
               n * nc),
        Launch("fwd_h (recompute)", "gdn_bwd", dict(fwd["fwd_h"].flops), fwd["fwd_h"].bytes, n * math.ceil(D / BV), nc,
               dict(fwd["fwd_h"].step_flops), "fwd_h"),
        Launch("bwd_dv_local", "gdn_bwd", {"tc_bf16": tok * 4 * C * D}, tok * 8 * D, n * nc),
        Launch("bwd_dhu", "gdn_bwd", {"tc_bf16": tok * 6 * D * D}, tok * 8 * D + n * nc * 4 * D * D,
               n * math.ceil(D / BV), nc, {"tc_bf16": 6 * C * D * BV}, "fwd_h"),
        Launch("bwd_dqkwg", "gdn_bwd", {"tc_bf16": tok * (8 * D * D + 4 * C * D)},
               tok * 14 * D + n * nc * 4 * D * D, n * nc),
        Launch("prepare_wy_bwd", "gdn_bwd", {"tc_bf16": tok * 8 * C * D}, tok * (12 * D + 8 * C), n * nc),
        Launch("chunk_local_cumsum (rev)", "gdn_bwd", bytes=tok * 8, programs=n * nc),
    ]


def _glue(name, phase, tok, bytes_per_tok, ops=1) -> list[Launch]:
    return [Launch(name if ops == 1 else f"{name} [{i + 1}/{ops}]", phase, bytes=tok * bytes_per_tok / ops,
                   programs=max(1, tok // 1024), torch_op=True) for i in range(ops)]


def bl_forward(B, H, T, D, C=64, variant="built") -> list[Launch]:
    """Every launch of BL's forward (bf16 inputs, m = D, scalar decay) for ``variant`` (module docstring)."""
    _check_shape(B, H, T, D, C)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    n, nc, tok = B * H, math.ceil(T / C), B * H * T
    F = cov_step_flops(D, C)
    if variant == "v1":  # chunk-serial: one covariance program and D/32 mean programs per (sequence, head)
        BV = min(32, D)
        mean_step = 2 * C * D * BV * 3 + 2 * C * C * (D + BV)
        return [
            *_glue("casts (fp32 q, k, v)", "glue", tok, 18 * D, ops=3),
            Launch("bl_chunk_cov_kernel", "cov", {"ffma_fp32": n * nc * F}, tok * (8 * D + 4 * D + 4 * C), n, nc,
                   {"ffma_fp32": F}, "cov"),
            Launch("bl_chunk_mean_kernel", "mean", {"ffma_fp32": n * nc * mean_step * D / BV},
                   tok * (16 * D + 4 * C + 2 * D), n * D // BV, nc, {"ffma_fp32": mean_step}, "mean"),
        ]
    cuts = variant in CUT_VARIANTS
    S = cut_segments(n, T, C) if cuts else segments(n, T, C)
    n_s = math.ceil(nc / S)  # chunks per segment
    tok_a = tok * (S - 1) / S  # Phase A covers every segment but each sequence's last
    prod = _products(variant)  # the covariance products
    out = []
    if not cuts:
        out += _glue("casts (fp32 q, k, v; r², ℓ², log α)", "glue", tok, 18 * D + 24, ops=4)
    else:
        out += _glue("casts (r², ℓ², log α)", "glue", tok, 24, ops=1)
    if S > 1:
        if not cuts:
            out.append(Launch("prep (float64, Phase A)", "prep", {"tc_fp64": tok * 2 * C * D},
                              tok * (8 * D + 8 * C + 24), n * nc))
        out.append(Launch("cov (Phase A, float64)" if not cuts else f"cov (Phase A, 3x{prod[0][3:]})", "phase_a",
                          ({"tc_fp64": tok_a / C * F} if not cuts else {prod[0]: prod[1] * tok_a / C * F}),
                          tok_a * ((8 * D + 8 * C) * (1 if cuts else 2) + 8 * D + 8 * C), n * (S - 1), n_s,
                          ({"tc_fp64": F} if not cuts else {prod[0]: prod[1] * F}), "cov"))
        out.append(Launch("track (Phase A)", "phase_a",
                          ({"tc_fp64": tok_a / C * track_step_flops(D, C)} if not cuts else
                           {prod[0]: prod[1] * tok_a / C * track_step_flops(D, C)}),
                          tok_a * (8 if not cuts else 4) * (D + 2) + n * (S - 1) * 16 * D * D, n * (S - 1), n_s,
                          ({"tc_fp64": track_step_flops(D, C)} if not cuts else
                           {prod[0]: prod[1] * track_step_flops(D, C)}), "track"))
        out.append(Launch("phase_b", "phase_b", {"tc_fp64": n * S * segment_step_flops(D)}, n * S * 40 * D * D, n, S,
                          {"tc_fp64": segment_step_flops(D)}, "segment"))
    out.append(Launch("prep (fp32, Phase C)", "prep", {prod[0]: prod[1] * tok * 2 * C * D},
                      tok * (8 * D + 4 * C + 16), n * nc))
    wb = 2 if cuts else 4  # W written in bf16 (cuts) or fp32
    out.append(Launch("cov (Phase C)", "phase_c", {prod[0]: prod[1] * tok / C * F},
                      tok * (8 * D + 4 * C + 16 + wb * D + 4 * C), n * S, n_s, {prod[0]: prod[1] * F}, "cov"))
    out.append(Launch("isfinite / flags", "phase_c", bytes=n * 4 * D * D, torch_op=True))
    sub_b = tok * (4 * C + 8 * D + (4 if not cuts else 2) * 2 * D)
    out.append(Launch("substitute L⁻¹(γK), L⁻¹V", "substitute", {prod[0]: prod[1] * tok * 4 * C * D}, sub_b,
                      n * nc, torch_op=True))
    if not cuts:
        out += _glue("casts to bf16 (q, W, kw, vu)", "substitute", tok, 24 * D, ops=4)
    gdn = {x.name: x for x in gdn_forward(B, H, T, D, C)}
    for name in ("fwd_h", "fwd_o"):
        x = gdn[name]
        out.append(Launch(f"fla {name} (mean)", "mean", dict(x.flops), x.bytes, x.programs, x.steps,
                          dict(x.step_flops), x.kind))
    return out


def bl_backward(B, H, T, D, C=64, variant="built") -> list[Launch]:
    """BL's ``backward="scan"`` after its forward (which keeps W, L⁻¹, P_starts, Phase A's elements):
    fla's mean-pass backward, the substitution's adjoint, B2 (replay + local adjoints), B3 (reverse over
    segments, float64), B4 (adjoints of the inputs)."""
    return [_as_backward(x) for x in _bl_backward(B, H, T, D, C, variant)]


def _bl_backward(B, H, T, D, C, variant) -> list[Launch]:
    _check_shape(B, H, T, D, C)
    if variant not in ("built", *CUT_VARIANTS):
        raise ValueError(f"variant must be one of {('built', *CUT_VARIANTS)} (the v1 backward is block-wise "
                         f"PyTorch), got {variant!r}")
    n, nc, tok = B * H, math.ceil(T / C), B * H * T
    cuts = variant in CUT_VARIANTS
    S = cut_segments(n, T, C) if cuts else segments(n, T, C)
    n_s = math.ceil(nc / S)
    prod = _products(variant)
    F = cov_step_flops(D, C)
    g = {x.name: x for x in gdn_backward(B, H, T, D, C)}
    out = []
    for name in ("fwd_h (recompute)", "bwd_dv_local", "bwd_dhu", "bwd_dqkwg"):
        x = g[name]
        out.append(Launch(f"fla {name} (mean)", "mean_bwd", dict(x.flops), x.bytes, x.programs, x.steps,
                          dict(x.step_flops), x.kind))
    out.append(Launch("substitution adjoint", "substitute_bwd", {prod[0]: prod[1] * tok * 8 * C * D},
                      tok * (8 * C + 24 * D), n * nc, torch_op=True))
    if not cuts:
        out += _glue("casts (adjoints to fp32)", "substitute_bwd", tok, 18 * D, ops=3)
    state_bytes = n * nc * 4 * D * D  # B2 keeps every chunk's P for B4
    out.append(Launch("B2 segment adjoint (replay)", "b2", {prod[0]: prod[1] * 3 * tok / C * F},
                      tok * (12 * D + 12 * C + 16) + state_bytes, n * S, n_s, {prod[0]: prod[1] * 3 * F}, "adjoint"))
    if S > 1:
        out.append(Launch("B3 reverse (float64)", "b3", {"tc_fp64": 2 * n * S * segment_step_flops(D)},
                          n * S * 56 * D * D, n, S, {"tc_fp64": 2 * segment_step_flops(D)}, "segment"))
    out.append(Launch("B4 segment adjoint (inputs)", "b4", {prod[0]: prod[1] * 3 * tok / C * F},
                      tok * (16 * D + 12 * C + 24) + state_bytes, n * S, n_s, {prod[0]: prod[1] * 3 * F}, "adjoint"))
    out += _glue("gradient sums and casts", "glue_bwd", tok, 24 * D, ops=4)
    return out


VARIANTS = {"v1": "chunk-serial (2026-11-30)", "built": "segment scan as built", "cuts": "after the cuts (3xTF32)",
            "cuts_bf16x3": "after the cuts, products as 3xbf16"}
CUT_VARIANTS = ("cuts", "cuts_bf16x3")


def _products(variant: str) -> tuple[str, int]:
    """(unit, passes) of the covariance products: IEEE FFMA as built, 3 tensor-core passes after the cuts."""
    return {"cuts": ("tc_tf32", ASSUMED["tc_split"]), "cuts_bf16x3": ("tc_bf16", 3)}.get(variant, ("ffma_fp32", 1))


@dataclass
class Calibration:
    """Fitted constants (seconds): step overheads per kind, the serial rate as a fraction of a unit's per-SM peak,
    host seconds per launch or PyTorch op."""

    t0: dict
    eff_serial: float
    host_per_op: float
    host_per_op_bwd: float = 0.0
    chain_speedup: float = 1.0  # what-if: BL's own serial steps (CHAIN_KINDS) this many times faster
    source: str = ""


def launch_time(x: Launch, cal: Calibration, hw: dict = H200) -> float:
    """Predicted device seconds of one launch (module docstring)."""
    occ = min(1.0, x.programs / hw["sms"])
    compute = sum(f / (hw[u] * ASSUMED["eff_par"]) for u, f in x.flops.items())
    memory = x.bytes / (hw["bandwidth"] * ASSUMED["eff_bw"])
    roof = max(compute, memory) / occ
    serial = 0.0
    if x.steps:
        waves = math.ceil(x.programs / hw["sms"])
        per_step = cal.t0.get(x.kind, 0.0) + sum(f / (hw[u] / hw["sms"] * cal.eff_serial)
                                                 for u, f in x.step_flops.items())
        serial = waves * x.steps * per_step / (cal.chain_speedup if x.kind in CHAIN_KINDS else 1.0)
    return ASSUMED["launch_s"] + max(roof, serial)


def call_time(launches: list[Launch], cal: Calibration) -> tuple[float, dict]:
    """``(seconds, {phase: device seconds})`` of one call: max(device, host)."""
    phases: dict = {}
    for x in launches:
        phases[x.phase] = phases.get(x.phase, 0.0) + launch_time(x, cal)
    device = sum(phases.values())
    host = sum(cal.host_per_op_bwd if x.backward else cal.host_per_op for x in launches)
    return max(device, host), phases


CHAIN_KINDS = ("cov", "adjoint", "segment", "track")  # BL's own serial chains (not fla's fwd_h/bwd_dhu, not v1's)


def _t0_defaults(t_cov: float, t_fwd_h: float, t_mean: float) -> dict:
    return {"cov": t_cov, "mean": t_mean, "fwd_h": t_fwd_h, "track": t_fwd_h,
            "segment": t_cov * ASSUMED["segment_t0"], "adjoint": t_cov * ASSUMED["adjoint_t0"]}


# the 2026-11-30 H200 measurements (results/gpu/2026-11-30_h200_*): B = 2, H = 16, C = 64, bf16
V1_PER_CHUNK_S = {64: (0.01827 / 128 + 0.07008 / 512) / 2, 128: (0.03065 / 128 + 0.11908 / 512) / 2,
                  256: (0.07898 / 128 + 0.31300 / 512) / 2}  # BL forward / chunks, T = 8k and 32k averaged
V1_PROFILE_D128_S = {"cov": 0.024072 / 128, "mean": 0.005459 / 128}  # T = 8192, per chunk (torch.profiler)
GDN_D64_S = {"fwd": {2048: 0.00095, 8192: 0.000753, 32768: 0.001361},
             "fwdbwd": {2048: 0.00591, 8192: 0.00275, 32768: 0.004311}}


def calibrate(measured_rows: list[dict] | None = None) -> Calibration:
    """Fit the constants on the 2026-11-30 measurements (module docstring); ``measured_rows`` (a device check's
    latency/occupancy rows) refit the covariance step from BL's Phase C times and GDN's constants from its times."""
    import numpy as np

    C, per_sm = 64, H200["ffma_fp32"] / H200["sms"]
    # v1 per chunk = t_cov + t_mean + (F_cov + F_mean) / (per_sm · eff); the profile splits D = 128
    rows, rhs = [], []
    for D, t in V1_PER_CHUNK_S.items():
        BV = min(32, D)
        fm = (2 * C * D * BV * 3 + 2 * C * C * (D + BV))
        rows.append([1, 1, (cov_step_flops(D, C) + fm) / per_sm])
        rhs.append(t)
    rows.append([1, 0, cov_step_flops(128, C) / per_sm])
    rhs.append(V1_PROFILE_D128_S["cov"])
    a, b = np.array(rows), np.array(rhs)
    t_cov, t_mean, inv_eff = (float(s) for s in np.linalg.lstsq(a, b, rcond=None)[0])
    if t_mean < 0:  # no step overhead left for the mean kernel: fit without it
        t_cov, inv_eff = (float(s) for s in np.linalg.lstsq(a[:, [0, 2]], b, rcond=None)[0])
        t_mean = 0.0
    eff = 1.0 / inv_eff
    source = f"v1 fit: t_cov {t_cov * 1e6:.0f} us, t_mean {t_mean * 1e6:.0f} us, serial eff {eff:.3f}"
    # GDN: device-bound at T = 32k (fwd_h's step overhead), host-bound at 8k (host seconds per op)
    cal = Calibration(_t0_defaults(t_cov, 0.0, t_mean), eff, 0.0)
    gdn = gdn_forward(2, 16, 32768, 64)
    rest = sum(launch_time(x, cal) for x in gdn)  # with t0[fwd_h] = 0
    fwd_h = next(x for x in gdn if x.name == "fwd_h")
    t_h = max(0.0, (GDN_D64_S["fwd"][32768] - rest) / (math.ceil(fwd_h.programs / H200["sms"]) * fwd_h.steps))
    # host-bound at T = 8192 (as fast as at 2048): host seconds per forward op, then per backward op
    host = GDN_D64_S["fwd"][8192] / len(gdn_forward(2, 16, 8192, 64))
    host_b = (GDN_D64_S["fwdbwd"][8192] - GDN_D64_S["fwd"][8192]) / len(gdn_backward(2, 16, 8192, 64))
    cal = Calibration(_t0_defaults(t_cov, t_h, t_mean), eff, host, host_b, source=source + f"; GDN: t_fwd_h "
                      f"{t_h * 1e6:.2f} us, host {host * 1e6:.0f} us per forward op, {host_b * 1e6:.0f} per backward")
    for r in measured_rows or []:
        phases = r.get("bl_phases_s") or {}
        if "phase_c" in phases:  # Phase C: n·S programs (one wave when ≤ SMs) of n_s chunk steps
            n, nc = r["B"] * r["H"], math.ceil(r["T"] / C)
            S = segments(n, r["T"], C)
            steps = math.ceil(nc / S) * math.ceil(n * S / H200["sms"])
            F = cov_step_flops(r["D"], C)
            cal.t0["cov"] = max(0.0, phases["phase_c"] / steps - F / (per_sm * eff))
            cal.t0.update(_t0_defaults(cal.t0["cov"], cal.t0["fwd_h"], cal.t0["mean"]))
            cal.source += f"; refit on the device check: t_cov {cal.t0['cov'] * 1e6:.0f} us (row T={r['T']} D={r['D']})"
            break
    return cal


def predict(B, H, T, D, cal: Calibration, C=64) -> dict:
    """Predicted seconds of GDN and each BL variant, forward and forward+backward, with per-phase times."""
    out = {"B": B, "H": H, "T": T, "D": D, "segments": segments(B * H, T, C)}
    g_f, _ = call_time(gdn_forward(B, H, T, D, C), cal)
    g_fb, _ = call_time(gdn_forward(B, H, T, D, C) + gdn_backward(B, H, T, D, C), cal)
    out["gdn_fwd_s"], out["gdn_fwdbwd_s"] = g_f, g_fb
    for v in ("built", *CUT_VARIANTS):
        f, ph = call_time(bl_forward(B, H, T, D, C, v), cal)
        fb, ph_b = call_time(bl_forward(B, H, T, D, C, v) + bl_backward(B, H, T, D, C, v), cal)
        out[v] = {"fwd_s": f, "fwdbwd_s": fb, "ratio_fwd": f / g_f, "ratio_fwdbwd": fb / g_fb, "phases_s": ph_b}
    return out


def chain_speedup_for(B, H, T, D, cal: Calibration, *, target: float, fwdbwd: bool, variant: str = "cuts",
                      C: int = 64) -> float | None:
    """By how much every step of BL's own serial chains (the covariance step of Phase A/C and B2/B4, the tracking
    and Phase B/B3 steps: overhead and arithmetic alike) would have to get faster for ``variant`` to reach
    BL/GDN = ``target`` (forward, or forward+backward); 1.0: already there; None: not even 1000× (the parallel
    work alone is over the target)."""
    if not target > 0:
        raise ValueError(f"target must be > 0, got {target!r}")
    bl = bl_forward(B, H, T, D, C, variant) + (bl_backward(B, H, T, D, C, variant) if fwdbwd else [])
    gdn_t = call_time(gdn_forward(B, H, T, D, C) + (gdn_backward(B, H, T, D, C) if fwdbwd else []), cal)[0]

    def ratio(f: float) -> float:
        c = Calibration(dict(cal.t0), cal.eff_serial, cal.host_per_op, cal.host_per_op_bwd, chain_speedup=f)
        return call_time(bl, c)[0] / gdn_t

    if ratio(1.0) <= target:
        return 1.0
    if ratio(1000.0) > target:
        return None
    lo, hi = 1.0, 1000.0
    for _ in range(50):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ratio(mid) <= target else (mid, hi)
    return hi


GRID = [(B, 16, T, D) for B in (2, 8) for D in (64, 128) for T in (2048, 8192, 32768)]


def load_measured(paths: list[str]) -> list[dict]:
    """Latency/occupancy rows of device-check JSON files (``benchmarks/gpu.py --scan``), and the older benchmark's
    rows (``bl``/``gdn`` dicts) as ``{"B", "H", "T", "D", "gdn_fwd_s", "gdn_fwdbwd_s", "v1_fwd_s"}``."""
    rows = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        for r in data.get("rows", []):
            if r.get("kind") in ("latency", "occupancy"):
                rows.append(dict(r, source=Path(p).name))
            elif "bl" in r or "gdn" in r:
                rows.append({"B": r["B"], "H": r["H"], "T": r["T"], "D": r["D"], "source": Path(p).name,
                             "gdn_fwd_s": r.get("gdn", {}).get("fwd_s"),
                             "gdn_fwdbwd_s": r.get("gdn", {}).get("fwdbwd_s"),
                             "v1_fwd_s": r.get("bl", {}).get("fwd_s")})
    return rows


def print_grid(cal: Calibration, measured: list[dict]) -> None:
    def ms(x):
        return f"{x * 1e3:.2f}" if isinstance(x, (int, float)) else "—"

    def fx(x):
        return f"{x:.1f}" if x is not None else "none"

    print(f"# calibration: {cal.source}")
    print("# ms predicted (measured in brackets where a row exists); r = BL / GDN for the segment scan as built, "
          "after the cuts (3xTF32) and with 3xbf16 products; x: how many times faster BL's own serial steps would "
          "have to run for the 3xbf16 variant to reach 2.2x forward / 2.5x forward+backward (none: not even 1000x)")
    head = (f"{'B·H':>4} {'D':>4} {'T':>6} {'seg':>3} | {'GDN fwd':>12} {'built':>14} {'r':>5} {'cuts':>6} {'r':>5} "
            f"{'r 3xbf16':>8} {'x':>5} | {'GDN f+b':>12} {'built':>16} {'r':>5} {'cuts':>7} {'r':>5} {'r 3xbf16':>8} "
            f"{'x':>5}")
    print(head)
    print("-" * len(head))
    for B, H, T, D in GRID:
        p = predict(B, H, T, D, cal)
        m: dict = {}  # every measurement of this shape, the first of each key (files in order)
        for r in measured:
            if (r["B"], r["H"], r["T"], r["D"]) == (B, H, T, D):
                m.update({k: v for k, v in r.items() if v is not None and k not in m})
        gf = ms(p["gdn_fwd_s"]) + (f" ({ms(m['gdn_fwd_s'])})" if m.get("gdn_fwd_s") else "")
        gfb = ms(p["gdn_fwdbwd_s"]) + (f" ({ms(m['gdn_fwdbwd_s'])})" if m.get("gdn_fwdbwd_s") else "")
        bf = ms(p["built"]["fwd_s"]) + (f" ({ms(m['bl_fwd_s'])})" if m.get("bl_fwd_s") else "")
        bfb = ms(p["built"]["fwdbwd_s"]) + (f" ({ms(m['bl_scan_fwdbwd_s'])})" if m.get("bl_scan_fwdbwd_s") else "")
        c, c3 = p["cuts"], p["cuts_bf16x3"]
        xf = chain_speedup_for(B, H, T, D, cal, target=2.2, fwdbwd=False, variant="cuts_bf16x3")
        xfb = chain_speedup_for(B, H, T, D, cal, target=2.5, fwdbwd=True, variant="cuts_bf16x3")
        print(f"{B * H:>4} {D:>4} {T:>6} {p['segments']:>3} | {gf:>12} {bf:>14} {p['built']['ratio_fwd']:>5.1f} "
              f"{ms(c['fwd_s']):>6} {c['ratio_fwd']:>5.1f} {c3['ratio_fwd']:>8.1f} {fx(xf):>5} | {gfb:>12} {bfb:>16} "
              f"{p['built']['ratio_fwdbwd']:>5.1f} {ms(c['fwdbwd_s']):>7} {c['ratio_fwdbwd']:>5.1f} "
              f"{c3['ratio_fwdbwd']:>8.1f} {fx(xfb):>5}")
    v1 = [r for r in measured if r.get("v1_fwd_s")]
    if v1:
        print("# the fit's own rows (v1 chunk-serial forward, 2026-11-30): measured / predicted ms")
        for r in v1:
            pred, _ = call_time(bl_forward(r["B"], r["H"], r["T"], r["D"], 64, "v1"), cal)
            print(f"  B={r['B']} H={r['H']} T={r['T']} D={r['D']}: {r['v1_fwd_s'] * 1e3:.2f} / {pred * 1e3:.2f}")


def print_launches(B, H, T, D, cal: Calibration, C=64) -> None:
    for title, launches in (("GDN forward", gdn_forward(B, H, T, D, C)), ("GDN backward", gdn_backward(B, H, T, D, C)),
                            *((f"BL forward ({v})", bl_forward(B, H, T, D, C, v)) for v in VARIANTS),
                            *((f"BL backward ({v})", bl_backward(B, H, T, D, C, v)) for v in ("built", *CUT_VARIANTS))):
        print(f"# {title}, B={B} H={H} T={T} D={D} C={C}")
        print(f"  {'launch':<34} {'GFLOP by unit':<44} {'MB':>8} {'progs':>6} {'steps':>5} {'ms':>8}")
        for x in launches:
            fl = ", ".join(f"{u} {f / 1e9:.2f}" for u, f in x.flops.items()) or "—"
            print(f"  {x.name:<34} {fl:<44} {x.bytes / 1e6:>8.1f} {x.programs:>6} {x.steps:>5} "
                  f"{launch_time(x, cal) * 1e3:>8.3f}")
        t, _ = call_time(launches, cal)
        print(f"  {'total (max of device, host)':<34} {'':<44} {'':>8} {'':>6} {'':>5} {t * 1e3:>8.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measured", nargs="*", default=None,
                   help="device-check JSON files (default: results/gpu/*.json)")
    p.add_argument("--launches", type=int, nargs=4, metavar=("B", "H", "T", "D"), help="every launch of one shape")
    args = p.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    paths = args.measured if args.measured is not None else sorted(glob.glob(str(root / "results/gpu/*.json")))
    for path in paths:
        if not Path(path).is_file():
            p.error(f"--measured: no such file: {path}")
    measured = load_measured(paths)
    cal = calibrate([r for r in measured if "bl_phases_s" in r])
    if args.launches:
        B, H, T, D = args.launches
        try:
            print_launches(B, H, T, D, cal)
        except ValueError as err:
            p.error(str(err))
        return 0
    print_grid(cal, measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
