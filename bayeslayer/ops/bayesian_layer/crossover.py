"""Chain or segment scan: which covariance pass the cost model predicts faster for a call (docs/kernels.md, "Cost
model", "Chain or segment scan"); :func:`bayeslayer.ops.bayesian_layer.chunk_triton.covariance_path` asks it for
the calls where both could run.

Both covariance passes run one program per SM at a time (each holds a chain's ``D×D`` state on chip and fills
the SM's register file).  With ``N`` chains (sequences × heads × groups) of ``T`` tokens on a GPU of ``s`` SMs, in
SM cycles, ``n = ceil(T / c)`` steps of a kernel that takes ``c`` tokens per step (:data:`CHUNKS`):

    chain   ceil(N / (s·o_chain)) · n_chain · t_chain
    scan    S segments per sequence (``choose_segment_chunks``), m = ceil(n_scan / S) chunks per segment:
            Phase A   ceil(N·S / (s·o_a)) · m · t_a  +  ceil(N·(S − 1) / (s·o_track)) · m · t_track
            Phase B   (S − 1) · t_b
            Phase C   ceil(N·S / (s·o_c)) · m · t_c

``t``: cycles of one chunk step of the kernel (Phase B: of one segment step), ``o``: its programs per SM at once;
both from the kernels as compiled for sm_90 (:data:`STEP_CYCLES`).  The mean pass runs after either and is not
part of the choice.  With ``S ≈ 2s/N`` segments (two waves, as ``choose_segment_chunks`` aims at) and long
sequences the scan costs about ``n_scan·N/s · (t_a + t_track/2 + t_c) + (S − 1)·t_b`` against the chain's
``n_chain·t_chain``: it is faster below about ``N* = s · (n_chain·t_chain) / (n_scan·(t_a + t_track/2 + t_c))``
chains, except where the ``S − 1`` serial Phase B steps of very few chains (many segments each) cost more than
they save.  :func:`scan_predicted_faster` evaluates the exact sums above; :func:`crossover_chains` gives the largest
chain count at which the scan wins.
"""

from __future__ import annotations

import math

from .scan import DEFAULT_SMS, choose_segment_chunks

# (cycles of one step, programs per SM) per kernel and head dimension, as the cost model predicts them from the
# kernels compiled for sm_90 with Triton 3.6, launched as the dispatch launches them (record:
# results/cost_model/crossover_sm90_triton3.6.json, written by `python benchmarks/cost_model.py --crossover --out
# ...`; a test keeps the two equal).  They change when the kernels do; the record and these are regenerated together.
STEP_CYCLES: dict[int, dict[str, tuple[int, int]]] = {
    64: {"chain": (30437, 1), "a": (160313, 1), "track": (78847, 2), "b": (418356, 2), "c": (136746, 1)},
    128: {"chain": (49019, 1), "a": (741585, 1), "track": (284822, 2), "b": (2052018, 2), "c": (228104, 1)},
}
#: tokens per step of the kernels the figures were compiled for: the chain kernel's chunk
#: (``chunk_triton.CHAIN_CHUNK_SIZE``, a test keeps them equal) and the scan's
CHUNKS: dict[str, int] = {"chain": 32, "scan": 64}


def _check(name: str, x, low: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise ValueError(f"{name} must be an int >= {low}, got {x!r}")
    return x


def _figures(D: int, figures: dict | None) -> dict:
    _check("D", D, 1)
    table = STEP_CYCLES if figures is None else figures
    for d in sorted(table):
        if D <= d:
            return table[d]
    raise ValueError(f"D must be at most {max(table)} (the chain kernel's limit), got {D}")


def covariance_cycles(path: str, n_chains: int, T: int, D: int, *, sms: int = DEFAULT_SMS,
                      segments: int | None = None, figures: dict | None = None, chunks: dict | None = None) -> float:
    """Predicted SM cycles of the covariance pass ``path`` (``"chain"`` or ``"scan"``) for ``n_chains`` chains of
    ``T`` tokens at head dimension ``D`` (the figures of the next tabulated D at or above it) on ``sms`` SMs;
    ``segments``: the scan's segments per sequence (None: ``choose_segment_chunks``'s choice); ``figures``,
    ``chunks``: step cycles and tokens per step in the form of :data:`STEP_CYCLES` and :data:`CHUNKS` (None:
    those)."""
    if path not in ("chain", "scan"):
        raise ValueError(f"path must be 'chain' or 'scan', got {path!r}")
    N, T, s = _check("n_chains", n_chains, 1), _check("T", T, 1), _check("sms", sms, 1)
    f = _figures(D, figures)
    c = CHUNKS if chunks is None else chunks
    if path == "chain":
        t, o = f["chain"]
        return math.ceil(N / (s * o)) * math.ceil(T / c["chain"]) * t
    n = math.ceil(T / c["scan"])
    S = _check("segments", segments, 1) if segments is not None else \
        math.ceil(n / choose_segment_chunks(N, n, T, sms=s))
    m = math.ceil(n / S)

    def rounds(programs, key):
        return math.ceil(programs / (s * f[key][1]))

    cycles = rounds(N * S, "a") * m * f["a"][0] + rounds(N * S, "c") * m * f["c"][0]
    if S > 1:
        cycles += rounds(N * (S - 1), "track") * m * f["track"][0] + (S - 1) * f["b"][0]
    return cycles


def scan_predicted_faster(n_chains: int, T: int, D: int, *, sms: int = DEFAULT_SMS, figures: dict | None = None,
                          chunks: dict | None = None) -> bool:
    """Whether the segment scan's covariance pass is predicted faster than the chain's for this call."""
    kw = dict(sms=sms, figures=figures, chunks=chunks)
    return covariance_cycles("scan", n_chains, T, D, **kw) < covariance_cycles("chain", n_chains, T, D, **kw)


def crossover_chains(T: int, D: int, *, sms: int = DEFAULT_SMS, figures: dict | None = None,
                     chunks: dict | None = None) -> int:
    """The largest number of chains (at most ``sms``) for which the scan is predicted faster for sequences of ``T``
    tokens at head dimension ``D``; 0 when the chain is predicted faster for every count.  Below it the scan wins
    except, possibly, at the fewest chains (Phase B's serial steps): :func:`scan_predicted_faster` decides a call."""
    _check("T", T, 1)
    _check("sms", sms, 1)
    best = 0
    for N in range(1, sms + 1):
        if scan_predicted_faster(N, T, D, sms=sms, figures=figures, chunks=chunks):
            best = N
    return best
