"""FLOPs of a training step: what the PyTorch paths compute, counted from the operations they run.

**Convention.**  A count is the number of floating-point operations of the *matrix-shaped* work, the
work that dominates and that every accelerator runs on its fast units:

* matrix products (``mm``, ``bmm``, ``baddbmm``, ``addmm``, the contractions ``einsum`` lowers to, and
  convolutions): **2 FLOPs per multiply-add**, ``2·M·K·N`` for ``[M, K] @ [K, N]``;
* the factorizations and solves of the chunked Bayesian Layer and its low-rank variant, at their
  textbook counts: Cholesky of an ``n × n`` matrix ``n³/3`` (:func:`cholesky_flops`), a triangular solve
  with ``k`` right-hand sides ``n²·k`` (:func:`triangular_solve_flops`), a Cholesky solve ``2·n²·k``, a
  symmetric eigendecomposition with vectors ``9·n³`` (:func:`eigh_flops`);
* softmax attention as PyTorch's flop counter counts it: the full ``T × T`` score matrix, causal or not,
  two products forward and five backward (the scores are recomputed);
* a depthwise convolution of ``W`` taps: ``2·W`` per output element, the same again for each gradient
  (PyTorch's counter prices a grouped convolution's backward as a dense one; the formula registered here
  does not).

**Not counted:** elementwise work (activations, gates, norms, the decay ratios ``exp(g_i − g_j)``,
masks, additions, the loss) and data movement (embedding lookups, copies, concatenations).  Its size
is measured by :func:`bayeslayer.training.flop_counter.measure_training_flops` (``elementwise``: one per
output element of every other operation) and reported beside the counts (docs/layers.md), so a reader
sees what the convention leaves out.

A training step is one forward and one backward pass (:class:`FlopCount`); the backward of a product
computes the gradient of each operand that needs one (``2·M·K·N`` each), the backward of a solve or a
factorization runs the products and solves PyTorch's autograd formulas run.  Operands that need no
gradient (the input ids, a key that is a fixed input, the prior state ``P_0 = p0·I`` and ``M_0 = 0``)
and results the loss does not reach (the final state) get no backward work, exactly as autograd does.

:func:`chunk_flops` counts the chunked filter (:func:`bayeslayer.ops.bayesian_layer.chunk.filter_chunk`,
:func:`bayeslayer.ops.bayesian_layer.lowrank.lowrank_chunk`; docs/theory.md §5) operation by operation;
the mixers add their projections and convolutions (``Mixer.flops``) and the models their blocks.
:func:`bayeslayer.training.flop_counter.measure_training_flops` measures the same quantity with
``torch.utils.flop_counter.FlopCounterMode`` (the factorizations registered at the counts above, since the
counter knows only products), and the tests hold every mixer's count within 10% of the measurement,
forward and backward.  The GPU kernels run
other algorithms; their counts are in ``benchmarks/cost_model.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..checks import check_int
from .bayesian_layer.dynamics import UNIT_INVERSE_BASE
from .bayesian_layer.write_models import WRITE_MODELS

DYNAMICS = ("identity", "scalar", "diagonal")


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one forward and one backward pass (:mod:`bayeslayer.ops.flops`'s convention)."""

    forward: int = 0
    backward: int = 0

    @property
    def total(self) -> int:
        """Forward plus backward: one training step."""
        return self.forward + self.backward

    def __add__(self, other: FlopCount) -> FlopCount:
        if not isinstance(other, FlopCount):
            return NotImplemented
        return FlopCount(self.forward + other.forward, self.backward + other.backward)

    def __mul__(self, times: int) -> FlopCount:
        times = check_int("times", times, minimum=0)
        return FlopCount(self.forward * times, self.backward * times)

    __rmul__ = __mul__

    def to_dict(self) -> dict:
        return {"forward": self.forward, "backward": self.backward, "total": self.total}


# -- the counts of single operations ------------------------------------------------------------------
def matmul_flops(m: int, k: int, n: int) -> int:
    """``[m, k] @ [k, n]``: ``2·m·k·n``."""
    return 2 * m * k * n


def cholesky_flops(n: int) -> int:
    """Cholesky factorization of an ``n × n`` matrix: ``n³/3`` (rounded down)."""
    return n * n * n // 3


def triangular_solve_flops(n: int, k: int) -> int:
    """A triangular ``n × n`` system with ``k`` right-hand sides: ``n²·k``."""
    return n * n * k


def cholesky_solve_flops(n: int, k: int) -> int:
    """Two triangular ``n × n`` solves with ``k`` right-hand sides: ``2·n²·k``."""
    return 2 * n * n * k


def eigh_flops(n: int) -> int:
    """Symmetric eigendecomposition of an ``n × n`` matrix with its eigenvectors: ``9·n³``."""
    return 9 * n * n * n


class Tally:
    """Forward and backward FLOPs of a sequence of operations, each with the gradients it must pass back.

    Every method adds one operation batched ``batch`` times; ``grad_*`` say which operands need a gradient.
    """

    def __init__(self) -> None:
        self.forward = 0
        self.backward = 0

    def count(self) -> FlopCount:
        return FlopCount(self.forward, self.backward)

    def matmul(self, batch: int, m: int, k: int, n: int, *, grad_a: bool = True, grad_b: bool = True,
               backward: bool = True) -> None:
        """``[m, k] @ [k, n]``; the backward forms each needed gradient with one product of the same size.
        ``backward=False``: the result does not reach the loss (no backward at all)."""
        f = batch * matmul_flops(m, k, n)
        self.forward += f
        if backward:
            self.backward += f * (int(grad_a) + int(grad_b))

    def linear(self, tokens: int, d_in: int, d_out: int, *, grad_input: bool = True) -> None:
        """``nn.Linear`` on ``tokens`` rows: the weight's gradient always, the input's when it needs one."""
        self.matmul(1, tokens, d_in, d_out, grad_a=grad_input, grad_b=True)

    def conv(self, batch: int, channels: int, length: int, width: int, *, grad_input: bool = True) -> None:
        """A depthwise convolution of ``width`` taps giving ``length`` outputs per channel."""
        f = 2 * batch * channels * length * width
        self.forward += f
        self.backward += f * (int(grad_input) + 1)

    def solve_triangular(self, batch: int, n: int, k: int, *, grad_a: bool = True, grad_b: bool = True) -> None:
        """``A⁻¹ B`` (``A`` ``n × n`` triangular, ``k`` columns): the backward solves with ``Aᴴ`` and, for
        ``A``'s gradient, forms ``−G Xᴴ`` (PyTorch's ``linalg_solve_triangular_backward``)."""
        f = batch * triangular_solve_flops(n, k)
        self.forward += f
        if grad_a or grad_b:
            self.backward += f
        if grad_a:
            self.backward += batch * matmul_flops(n, k, n)

    def cholesky(self, batch: int, n: int, *, grad: bool = True) -> None:
        """Cholesky factor; its backward is ``Lᴴ Ḡ`` and two triangular solves (PyTorch's ``cholesky_backward``)."""
        self.forward += batch * cholesky_flops(n)
        if grad:
            self.backward += batch * (matmul_flops(n, n, n) + 2 * triangular_solve_flops(n, n))

    def unit_lower_inverse(self, batch: int, n: int, *, grad: bool = True) -> None:
        """:func:`bayeslayer.ops.bayesian_layer.dynamics.unit_lower_inverse`: one solve against the identity, or
        blocks of 16 solved and merged by doubling (``−D B A`` per merge)."""
        base = UNIT_INVERSE_BASE
        nb = n // base if n % base == 0 else 0
        if n <= base or nb == 0 or nb & (nb - 1):
            self.solve_triangular(batch, n, n, grad_a=grad, grad_b=False)
            return
        self.solve_triangular(batch * nb, base, base, grad_a=grad, grad_b=False)
        s = base
        while s < n:
            merges = batch * (n // (2 * s))
            self.matmul(merges, s, s, s, grad_a=grad, grad_b=grad)  # D @ B
            self.matmul(merges, s, s, s, grad_a=grad, grad_b=grad)  # (D B) @ A
            s *= 2


# -- the chunked filter -------------------------------------------------------------------------------
def _check_design(write: str, dynamics: str) -> None:
    if write not in WRITE_MODELS:
        raise ValueError(f"write must be one of {WRITE_MODELS}, got {write!r}")
    if dynamics == "rotation":
        raise ValueError("dynamics='rotation' has no FLOP count: its chunked path runs complex-valued products "
                         "that the convention does not price; use identity, scalar or diagonal")
    if dynamics not in DYNAMICS:
        raise ValueError(f"dynamics must be one of {DYNAMICS}, got {dynamics!r}")


def chunk_flops(write: str, dynamics: str, *, batch_size: int, seq_len: int, num_heads: int, key_dim: int,
                value_dim: int, chunk_size: int = 64, groups: int = 1, rank: int | None = None,
                projection: str = "conservative", qk_grad: bool = True) -> FlopCount:
    """FLOPs of the PyTorch chunked filter over ``[batch_size, seq_len]`` in one training step.

    Args:
        write: the write model, ``bayes``, ``diagonal``, ``reset``, ``latent`` or ``lowrank``.
        dynamics: ``identity``, ``scalar`` or ``diagonal`` (``rotation`` raises: see :func:`_check_design`).
        batch_size, seq_len, num_heads: ``B``, ``T``, ``H``; the sequence is padded to whole chunks of
            ``chunk_size`` tokens (the padding computes like any token; the chunk is no longer than the
            sequence, except in the low-rank write's mean pass, as the ops do).
        key_dim, value_dim: ``D`` and ``m`` per head; ``groups`` (``G``) splits the value columns, each
            group with its own covariance (the ops run ``H·G`` heads of ``m/G`` values).
        rank, projection: the low-rank write's ``r`` and projection (``write="lowrank"`` only; the
            projection ``"conservative"`` or ``"lofi"``).
        qk_grad: whether the keys and queries need gradients (``False`` when they are a fixed input, as
            in the recall models' cores); every other input (values, noise, gains, decays) does.

    The count follows :func:`~bayeslayer.ops.bayesian_layer.chunk.filter_chunk` operation by operation (module
    docstring for the convention): per chunk of ``C`` tokens and head the covariance pass costs
    ``4·C·D² + 5·C²·D + C³/3 + 2·C²`` forward (scalar decay), the mean pass with an erase
    ``6·C·D·m + 2·C²·(3D + 2m)`` plus a ``C × C`` unit-triangular inverse (``C³`` for ``C ≤ 16``).
    """
    _check_design(write, dynamics)
    B = check_int("batch_size", batch_size, minimum=1)
    T = check_int("seq_len", seq_len, minimum=1)
    H = check_int("num_heads", num_heads, minimum=1)
    D = check_int("key_dim", key_dim, minimum=1)
    m = check_int("value_dim", value_dim, minimum=1)
    C = check_int("chunk_size", chunk_size, minimum=1)
    G = check_int("groups", groups, minimum=1)
    if m % G:
        raise ValueError(f"groups={G} must divide value_dim={m}")
    if write != "lowrank" and rank is not None:
        raise ValueError(f"rank applies only to write='lowrank', got write={write!r}")
    if write == "lowrank":
        rank = check_int("rank", rank, minimum=0, maximum=D) if rank is not None else None
        if rank is None:
            raise ValueError("write='lowrank' needs rank")
        if projection not in ("conservative", "lofi"):
            raise ValueError(f"projection must be 'conservative' or 'lofi', got {projection!r}")
    if not isinstance(qk_grad, bool):
        raise TypeError(f"qk_grad must be a bool, got {type(qk_grad).__name__}")
    if write in ("reset", "latent") and G != 1:
        raise ValueError(f"groups apply to the covariance writes, not write={write!r}")
    Hf, mf = H * G, m // G
    n = B * Hf  # one chunk's batch of products
    if write != "lowrank":
        C = min(C, T)  # filter_chunk: a chunk longer than the sequence would only pad it
    N = math.ceil(T / C)
    decay = dynamics != "identity"  # the decays are learned: the transition factors need gradients
    kt_grad = qk_grad or decay  # k̃ = Φᵀk
    t = Tally()
    if write == "bayes":
        _covariance_pass(t, dynamics, n, N, C, D, qk_grad=qk_grad, kt_grad=kt_grad, decay=decay)
    elif write == "lowrank":
        _lowrank_scan(t, n, T, D, rank, projection)
    _mean_pass(t, dynamics, n, N, C, D, mf, erase=write != "latent", qk_grad=qk_grad, kt_grad=kt_grad)
    return t.count()


def _scores(t: Tally, dynamics: str, n: int, C: int, D: int, *, grad_a: bool, grad_b: bool, decay: bool) -> None:
    """``a_iᵀ Φ_iΦ_j⁻¹ b_j`` for a chunk: one ``C×D @ D×C`` product (a scalar ratio scales it afterwards), or
    with a diagonal decay ``a ⊙ ratio`` (elementwise) contracted with ``b`` over ``D``."""
    if dynamics == "diagonal":
        t.matmul(n * C, C, D, 1, grad_a=grad_a or decay, grad_b=grad_b)
    else:
        t.matmul(n, C, D, C, grad_a=grad_a, grad_b=grad_b)


def _covariance_pass(t: Tally, dynamics: str, n: int, N: int, C: int, D: int, *, qk_grad: bool, kt_grad: bool,
                     decay: bool) -> None:
    """The dense Bayesian write's covariance pass over ``N`` chunks (``covariance_pass``)."""
    Da = D if dynamics == "diagonal" else 1
    # covariance_prework, every chunk: B_j = Σ_l ratio² ℓ²_l (a C·Da × C product with ℓ²), N_ij = k_iᵀ Φ B_j k_j
    t.matmul(n * N, C * Da, C, 1, grad_a=decay, grad_b=True)
    _scores(t, dynamics, n * N, C, D, grad_a=qk_grad, grad_b=True, decay=decay)
    for i in range(N):
        first, last = i == 0, i == N - 1
        y_grad = kt_grad or not first  # Y = K̃ P: P_0 = p0·I needs no gradient
        t.matmul(n, C, D, D, grad_a=kt_grad, grad_b=not first)  # Y = K̃ P
        t.matmul(n, C, D, C, grad_a=y_grad, grad_b=kt_grad)  # S = base + Y K̃ᵀ
        t.cholesky(n, C)
        if dynamics == "diagonal":
            t.unit_lower_inverse(n, C)  # L⁻¹
            t.matmul(n, C, C, D, grad_a=True, grad_b=y_grad)  # L⁻¹ Y
            t.matmul(n * D, C, C, 1)  # Σ_j (L⁻¹)_ij Φ_iΦ_j⁻¹ B_j k_j
        else:
            t.solve_triangular(n, C, D)  # Ū = (L_c ⊙ R)⁻¹ X
        t.matmul(n, D, C, D, backward=not last)  # P_C = … − Σ ū ūᵀ (the last P reaches no loss)


def _mean_pass(t: Tally, dynamics: str, n: int, N: int, C: int, D: int, m: int, *, erase: bool, qk_grad: bool,
               kt_grad: bool) -> None:
    """The generalised delta rule over ``N`` chunks (``mean_pass``); ``w`` always needs a gradient."""
    decay = dynamics != "identity"
    nN = n * N
    _scores(t, dynamics, nN, C, D, grad_a=qk_grad, grad_b=True, decay=decay)  # A = q·Φ·w
    if erase:
        _scores(t, dynamics, nN, C, D, grad_a=qk_grad, grad_b=True, decay=decay)  # T = k·Φ·w
        t.unit_lower_inverse(nN, C)  # (I + T)⁻¹
        t.matmul(nN, C, C, m)  # V' = (I + T)⁻¹ V
        t.matmul(nN, C, C, D, grad_a=True, grad_b=kt_grad)  # K' = (I + T)⁻¹ K̃
        for i in range(N):
            t.matmul(n, C, D, m, grad_a=True, grad_b=i > 0)  # E = V' − K' M  (M_0 = 0 needs no gradient)
    for i in range(N):
        t.matmul(n, D, C, m, backward=i < N - 1)  # M ← Φ_C M + W_endᵀ E (the final M reaches no loss)
    t.matmul(nN, C, D, m, grad_a=kt_grad, grad_b=N > 1)  # Q̃ M_0, all chunks' states at once (only M_0 = 0: none)
    t.matmul(nN, C, C, m)  # + A E


def _lowrank_scan(t: Tally, n: int, T: int, D: int, r: int, projection: str) -> None:
    """The low-rank-plus-diagonal covariance pass, token by token (``lowrank._scan``); ``n`` = batch × heads."""
    if r == 0:
        return  # diagonal arithmetic only
    m = r + 1
    for step in range(T):
        # _predict: X = Wᵀ(W·ℓ²/z) (W_0 = 0 is the prior: no gradient), chol(I + X), W̄ = (W·α/z) L⁻ᵀ
        t.matmul(n, r, D, r, grad_a=step > 0)
        t.cholesky(n, r)
        t.solve_triangular(n, r, D)
        # _woodbury_apply(ῡ, W̄, k): S = I + W̄ᵀY, chol, t = cholesky_solve(W̄ᵀs), s − Y t
        t.matmul(n, r, D, r)
        t.cholesky(n, r)
        t.matmul(n, r, D, 1)
        _cholesky_solve(t, n, r, 1)
        t.matmul(n, D, r, 1)
        # _drop_one: G = W̃ᵀ(W̃/ῡ), e (eigh; its backward: Vᵀḡ, V f, (V f) eᵀ), x = W̃e (used by lofi only), W̃w;
        # the last token's projected factor is the final state, which reaches no loss
        used = step < T - 1
        t.matmul(n, m, D, m, backward=used)
        t.forward += n * eigh_flops(m)
        t.backward += n * 3 * matmul_flops(m, m, 1) if used else 0
        t.matmul(n, D, m, 1, backward=used and projection == "lofi")
        t.matmul(n, D, m, 1, backward=used)


def _cholesky_solve(t: Tally, batch: int, n: int, k: int) -> None:
    """``cholesky_solve(B, L)``; its backward solves again for ``B``'s gradient and forms ``L``'s from it
    (PyTorch's ``cholesky_solve_backward``: ``Ḡ Xᴴ``, symmetrised, times ``L``)."""
    t.forward += batch * cholesky_solve_flops(n, k)
    t.backward += batch * (cholesky_solve_flops(n, k) + matmul_flops(n, k, n) + matmul_flops(n, n, n))


__all__ = [
    "DYNAMICS", "FlopCount", "Tally", "cholesky_flops", "cholesky_solve_flops", "chunk_flops", "eigh_flops",
    "matmul_flops", "triangular_solve_flops",
]
