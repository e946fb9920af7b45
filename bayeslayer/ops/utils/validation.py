"""Input validation shared by every public op.

Every public op funnels its arguments through these helpers so that a bad
shape, dtype, device or value raises a ``ValueError``/``TypeError`` that names
the argument and the shapes seen, instead of broadcasting into a silently wrong
answer.

Two kinds of checks, and where each runs:

* **Structure** (shapes, dtypes, devices, Python numbers): always; they read no tensor data.
* **Values** (finite, ranges, positive definite): they read tensor data, which on a GPU is a host sync
  and inside ``torch.compile`` or ``torch.func.vmap`` is impossible.  :func:`values_checked` says whether
  they run for a call: never while ``torch.compile`` traces or a ``torch.func`` transform runs (the
  compiled graph and the vmapped function then contain no check), never on meta tensors, and otherwise by
  the setting of :func:`set_value_checks`: ``"auto"`` (the default) checks CPU tensors in eager mode,
  where reading a value costs no device sync, and leaves CUDA tensors unchecked, so nothing on the CUDA
  path waits for the device; ``True`` checks every eager call, CUDA included (one host sync per check);
  ``False`` checks nothing.  Code that would branch on a tensor's value (a fast path, a promotion)
  asks :func:`can_read_values` first; when it says no, the code takes the branch that is right for
  every value.

**Precision is static.**  Which dtype a computation runs in is decided by the inputs' dtypes (and the
state's), never by their values: the PyTorch paths carry the covariance in float64 whatever the input
dtype (:data:`COVARIANCE_DTYPE`), the mean in the compute dtype (:func:`compute_dtype`), and return the
state's ``P`` in the dtype it came in.  What a float32 state cannot hold (a wide prior,
:data:`WIDE_PRIOR_RATIO`) is reported by an eager value check, :func:`check_state_precision`, which
says what to pass instead.
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...errors import NonFiniteError, PrecisionWarning

VALUE_CHECK_MODES = ("auto", True, False)
_VALUE_CHECKS: bool | str = "auto"


def set_value_checks(enabled: bool | str) -> bool | str:
    """Value checks (finite, ranges): ``"auto"`` (default: CPU tensors in eager mode), ``True`` (every
    eager call, CUDA tensors included, at one host sync per check) or ``False``; returns the previous
    setting.

    Shape, dtype and device checks are always on: they cost nothing.  Inside ``torch.compile`` and
    ``torch.func`` transforms no value check runs whatever the setting (:func:`values_checked`).
    """
    global _VALUE_CHECKS
    if enabled not in VALUE_CHECK_MODES or not isinstance(enabled, (bool, str)):
        raise ValueError(f"set_value_checks takes True, False or 'auto', got {enabled!r}")
    previous = _VALUE_CHECKS
    _VALUE_CHECKS = enabled
    return previous


@contextlib.contextmanager
def value_checks(enabled: bool | str) -> Iterator[None]:
    """Context manager form of :func:`set_value_checks`."""
    previous = set_value_checks(enabled)
    try:
        yield
    finally:
        set_value_checks(previous)


def can_read_values() -> bool:
    """Whether Python may read tensor values now: not while ``torch.compile`` traces (a read would break
    the graph) nor inside a ``torch.func`` transform such as ``vmap`` (a batched tensor has no single
    value).  Code that branches on a value must take the branch that is right for every value otherwise."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return torch._C._functorch.maybe_current_level() is None


def values_checked(*tensors: torch.Tensor | None) -> bool:
    """Whether the value checks of a call on ``tensors`` run (module docstring): the setting of
    :func:`set_value_checks`, only when :func:`can_read_values`, never for meta or empty tensors, and under
    ``"auto"`` only when every tensor is on the CPU."""
    if _VALUE_CHECKS is False or not can_read_values():
        return False
    xs = [x for x in tensors if x is not None]
    if not xs or any(x.device.type == "meta" or x.numel() == 0 for x in xs):
        return False
    return _VALUE_CHECKS is True or all(x.device.type == "cpu" for x in xs)


def _values_checked(x: torch.Tensor) -> bool:
    return values_checked(x)


def _shape(x: torch.Tensor) -> str:
    return str(tuple(x.shape))


def check_tensor(name: str, x, *, device: torch.device | None = None) -> torch.Tensor:
    """A floating-point tensor, on ``device`` when given, with only finite values."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}; all inputs must share one device")
    if _values_checked(x) and not _all_finite(x):
        raise NonFiniteError(f"{name} contains NaN or Inf values (shape {_shape(x)})")
    return x


def check_shaped(name: str, x, shape: tuple, dtype: torch.dtype | None = None) -> None:
    """``x`` is a tensor of exactly ``shape`` (and ``dtype`` if given), else an error naming ``name``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {x.dtype}")


def _all_finite(x: torch.Tensor) -> bool:
    # A finite sum proves every element finite (NaN/Inf propagate through a sum) and costs one
    # read of x with no temporaries; only when the sum is not finite (a bad value, or a
    # legitimate overflow) do we pay for the exact elementwise test.
    if x.numel() == 0:
        return True
    if bool(torch.isfinite(x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32))):
        return True
    return bool(torch.isfinite(x).all())


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Filter arithmetic runs in fp64 when any input is fp64, else fp32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


@dataclass(frozen=True)
class Dims:
    """Sizes of a sequence-first call: batch, time, heads, key dim, value dim."""

    B: int
    T: int
    H: int
    D: int
    m: int
    device: torch.device
    dtype: torch.dtype  # the callers' dtype (outputs are cast back to it)
    cdtype: torch.dtype  # the filter's arithmetic dtype


def check_qkv(q, k, v, *, single_step: bool = False) -> Dims:
    """Check q, k: [B, T, H, D] and v: [B, T, H, m] (``single_step``: [B, H, D] / [B, H, m])."""
    q = check_tensor("q", q)
    dev = q.device
    if dev.type == "meta":  # the filter's steps read values (pivots, the float64 promotion): a meta tensor has none
        raise ValueError(f"q is a meta tensor (a shape {_shape(q)} without values); the filter needs values: "
                         "pass tensors on the CPU or a GPU")
    k = check_tensor("k", k, device=dev)
    v = check_tensor("v", v, device=dev)
    nd = 3 if single_step else 4
    layout = "[B, H, D]" if single_step else "[B, T, H, D]"
    vlayout = "[B, H, m]" if single_step else "[B, T, H, m]"
    if q.dim() != nd:
        raise ValueError(f"q must be {layout}, got shape {_shape(q)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {layout}: q {_shape(q)}, k {_shape(k)}")
    if v.dim() != nd or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"v must be {vlayout} matching q {_shape(q)} except the last dim, got {_shape(v)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if single_step:
        B, H, D = q.shape
        T = 1
    else:
        B, T, H, D = q.shape
    m = v.shape[-1]
    if D == 0 or m == 0 or H == 0:
        raise ValueError(f"q/v have an empty head or feature dim: q {_shape(q)}, v {_shape(v)}")
    return Dims(B, T, H, D, m, dev, v.dtype, compute_dtype(q, k, v))


def check_positive(
    name: str,
    x,
    dims: Dims,
    *,
    allow_groups: bool = False,
    single_step: bool = False,
    strict: bool = True,
) -> torch.Tensor:
    """A noise-like parameter: a Python number, or a tensor [B, T, H] (or [B, T, H, G]).

    Returns a tensor of shape [B, T, H] or [B, T, H, G] in the compute dtype
    (for ``single_step``: [B, H] or [B, H, G] inputs, returned with T = 1).
    """
    lead = (dims.B, dims.H) if single_step else (dims.B, dims.T, dims.H)
    lead_s = "[B, H]" if single_step else "[B, T, H]"
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        val = float(x)
        if not (val > 0 if strict else val >= 0) or val != val or val in (float("inf"), float("-inf")):
            cond = "> 0" if strict else ">= 0"
            raise ValueError(f"{name} must be finite and {cond}, got {val}")
        t = torch.full(lead, val, dtype=dims.cdtype, device=dims.device)
    else:
        t = check_tensor(name, x, device=dims.device)
        if t.dim() == 0:
            t = t.expand(lead)
        ok = tuple(t.shape) == lead or (allow_groups and t.dim() == len(lead) + 1 and tuple(t.shape[:-1]) == lead)
        if not ok:
            want = f"{lead_s} or {lead_s[:-1]}, G]" if allow_groups else lead_s
            raise ValueError(f"{name} must have shape {want} = {lead}, got {_shape(t)}")
        if _values_checked(t):
            bad = (t <= 0) if strict else (t < 0)
            if bool(bad.any()):
                cond = "> 0" if strict else ">= 0"
                raise ValueError(f"{name} must be {cond} everywhere; min value {t.min().item():.3g}")
        t = t.to(dims.cdtype)
    if allow_groups and t.dim() == len(lead) + 1:
        G = t.shape[-1]
        if G == 0 or dims.m % G != 0:
            raise ValueError(f"{name} has G={G} noise groups but the value dim m={dims.m} is not divisible by G")
    if single_step:
        t = t.unsqueeze(1)
    return t


def check_p0(p0, dims: Dims) -> torch.Tensor:
    """Initial prior variance: a positive number, or a positive tensor [H]. Returns [H]."""
    if isinstance(p0, torch.Tensor):
        p = check_tensor("p0", p0, device=dims.device)
        if p.dim() == 0:
            p = p.expand(dims.H)
        if tuple(p.shape) != (dims.H,):
            raise ValueError(f"p0 must be a number or a tensor of shape [H] = ({dims.H},), got {_shape(p)}")
        if _values_checked(p) and bool((p <= 0).any()):
            raise ValueError(f"p0 must be > 0, got min {p.min().item():.3g}")
        return p.to(dims.cdtype)
    if not isinstance(p0, numbers.Real) or isinstance(p0, bool):
        raise TypeError(f"p0 must be a positive number or a tensor of shape [H], got {type(p0).__name__}")
    if not (float(p0) > 0) or float(p0) == float("inf"):
        raise ValueError(f"p0 must be finite and > 0, got {p0}")
    return torch.full((dims.H,), float(p0), dtype=dims.cdtype, device=dims.device)


@dataclass(frozen=True)
class Dynamics:
    """Structured transition ``A_t`` (docs/theory.md §1.3), canonicalised.

    kind: ``identity`` | ``scalar`` (``α_t I``) | ``diagonal`` (``diag(α_t)``) |
    ``rotation`` (pairs of channels ``(2c, 2c+1)`` rotate by ``θ_t`` and shrink
    by ``α_t``; the even channel of a pair is its real part).

    log_alpha: ``[B, T, H, Da]`` with ``Da`` = 1 (identity/scalar), D (diagonal)
    or D/2 (rotation, one shrink per pair), or ``None`` for identity.
    theta: ``[B, T, H, D/2]`` for rotations, else ``None``.
    """

    kind: str
    log_alpha: torch.Tensor | None
    theta: torch.Tensor | None

    @property
    def rotation(self) -> bool:
        return self.kind == "rotation"


def check_dynamics(alpha, theta, dims: Dims, *, single_step: bool = False) -> Dynamics:
    """Validate ``alpha`` in (0, 1] and ``theta`` and return canonical :class:`Dynamics`.

    Accepted: alpha None / [B, T, H] / [B, T, H, D]; with theta [B, T, H, D/2],
    alpha None / [B, T, H] / [B, T, H, D/2] (a damped rotation shrinks both
    channels of a pair alike).  ``single_step`` drops the T axis from every shape.
    """
    lead = (dims.B, dims.H) if single_step else (dims.B, dims.T, dims.H)
    lead_s = "[B, H" if single_step else "[B, T, H"
    D = dims.D

    def _unsq(t):
        return t.unsqueeze(1) if single_step else t

    th = None
    if theta is not None:
        th = check_tensor("theta", theta, device=dims.device)
        if D % 2 != 0:
            raise ValueError(f"theta (rotations) needs an even key dim D, got D={D}")
        if tuple(th.shape) != lead + (D // 2,):
            raise ValueError(f"theta must have shape {lead_s}, D/2] = {lead + (D // 2,)}, got {_shape(th)}")
        th = _unsq(th.to(dims.cdtype))
    if alpha is None:
        la = None
        if th is not None:
            la = torch.zeros(lead + (1,), dtype=dims.cdtype, device=dims.device)
            la = _unsq(la)
        return Dynamics("rotation" if th is not None else "identity", la, th)
    a = check_tensor("alpha", alpha, device=dims.device)
    if _values_checked(a) and bool(((a <= 0) | (a > 1)).any()):
        raise ValueError(
            f"alpha must lie in (0, 1]; got values in [{a.min().item():.3g}, {a.max().item():.3g}]"
        )
    if tuple(a.shape) == lead:
        kind, a = "scalar", a.unsqueeze(-1)
    elif th is None and tuple(a.shape) == lead + (D,):
        kind = "diagonal"
    elif th is not None and tuple(a.shape) == lead + (D // 2,):
        kind = "rotation"
    else:
        want = f"{lead_s}] or {lead_s}, D/2] with theta" if th is not None else f"{lead_s}] or {lead_s}, D]"
        raise ValueError(f"alpha must have shape {want} (D={D}), got {_shape(a)}")
    if th is not None:
        kind = "rotation"
    return Dynamics(kind, _unsq(torch.log(a.to(dims.cdtype))), th)


def state_pair_error(name: str, state) -> TypeError:
    """The error for a ``state`` that is not a pair ``(M, P)``: says what was given (a tuple of 1, a Tensor, ...)."""
    if isinstance(state, (tuple, list)):
        got = f"a {type(state).__name__} of {len(state)}"
    else:
        got = type(state).__name__
    return TypeError(f"{name} must be a tuple (M, P) of 2 tensors, got {got}")


def split_state(state, name: str = "initial_state") -> tuple:
    """``(M, P)`` of a state pair, ``(None, None)`` for ``None``; anything else that is not a pair raises
    :func:`state_pair_error` (the tensors themselves are checked where their shapes are known)."""
    if state is None:
        return None, None
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise state_pair_error(name, state)
    return state[0], state[1]


def check_state(
    initial_state,
    dims: Dims,
    G: int,
    *,
    need_cov: bool = True,
    name: str = "initial_state",
    keep_float64: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Check ``(M [B, H, D, m], P [B, H, D, D] or [B, H, G, D, D])``; returns P as [B, H, G, D, D].

    For mean-only designs (``need_cov=False``) a bare M tensor or ``(M, None)`` is accepted.
    With value checks on, P must be symmetric and pass one Cholesky (positive semi-definite up to
    a rounding jitter): O(D³) per call, the same test for a sequence and a decoding step, so a
    state the chunked path would refuse is never filtered on silently by the oracle.
    M is returned in the compute dtype; P too, unless ``keep_float64`` and P is float64 (a
    float64 covariance state then stays float64: see :func:`check_state_precision`).
    """
    if initial_state is None:
        return None
    if isinstance(initial_state, torch.Tensor):
        if need_cov:
            raise TypeError(f"{name} must be a tuple (M, P) for a design with a covariance, got one tensor")
        M, P = initial_state, None
    elif isinstance(initial_state, (tuple, list)) and len(initial_state) == 2:
        M, P = initial_state
    else:
        raise state_pair_error(name, initial_state)
    B, H, D, m = dims.B, dims.H, dims.D, dims.m
    M = check_tensor(f"{name}[0] (M)", M, device=dims.device)
    if tuple(M.shape) != (B, H, D, m):
        raise ValueError(f"{name}[0] (M) must be [B, H, D, m] = {(B, H, D, m)}, got {_shape(M)}")
    M = M.to(dims.cdtype)
    if not need_cov:
        return M, None
    if P is None:
        raise ValueError(f"{name}[1] (P) is required for a design with a covariance")
    P = check_tensor(f"{name}[1] (P)", P, device=dims.device)
    if tuple(P.shape) == (B, H, D, D) and G == 1:
        P = P.unsqueeze(2)
    if tuple(P.shape) != (B, H, G, D, D):
        want = f"[B, H, D, D] = {(B, H, D, D)}" if G == 1 else f"[B, H, G, D, D] = {(B, H, G, D, D)}"
        raise ValueError(f"{name}[1] (P) must be {want}, got {_shape(P)}")
    if _values_checked(P):
        asym = (P - P.transpose(-1, -2)).abs().max()
        scale = P.abs().max().clamp_min(1.0)
        if bool(asym > 1e-4 * scale):
            raise ValueError(f"{name}[1] (P) must be symmetric; max |P - P^T| = {asym.item():.3g}")
        if bool((torch.diagonal(P, dim1=-2, dim2=-1) < -1e-6 * scale).any()):
            raise ValueError(f"{name}[1] (P) must be positive semi-definite; it has a negative diagonal entry")
    if _values_checked(P):
        # A positive diagonal does not make P PSD (e.g. [[1, 2], [2, 1]]); the oracle would run on
        # silently and the chunked path fail inside its Cholesky.  A Cholesky of P plus a small
        # jitter (rounding in a filtered state can leave eigenvalues of order -eps·|P|) tells.
        Pc = P.detach().to(compute_dtype(P))
        scale = Pc.abs().max().clamp_min(1.0)
        jitter = (1e-5 if Pc.dtype == torch.float32 else 1e-10) * scale
        eye = torch.eye(D, dtype=Pc.dtype, device=Pc.device)
        if bool((torch.linalg.cholesky_ex(Pc + jitter * eye).info != 0).any()):
            raise ValueError(f"{name}[1] (P) must be positive semi-definite; it has a negative eigenvalue")
    keep = keep_float64 and P.dtype == torch.float64
    return M, P.to(torch.float64 if keep else dims.cdtype)


# Ratio of prior variance along a key to the observation noise above which a float32 covariance
# loses the written direction: the write leaves kᵀPk ≈ r² out of a P̄ of size p, so a float32 P
# keeps it to about eps32·p/r².  Measured (benchmarks/numerics.py, bl_recurrent, D = 16): ratio
# 1e4 gives relative errors ≈ 3e-4 in the variance with a float32 covariance, 1e6 ≈ 2e-2, 1e8 > 100%.
WIDE_PRIOR_RATIO = 1e4

#: the dtype the PyTorch paths carry the covariance in (``P̄``, ``S`` and its factor, the write keys,
#: the variance), whatever the input dtype: a static choice, so no call reads its data to decide it
COVARIANCE_DTYPE = torch.float64


def prior_noise_ratio(P: torch.Tensor, k: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """A cheap measure of ``max kᵀ P k / r²``: ``max diag(P) · max ‖k‖² / min r²`` (a 0-dim tensor).

    P: ``[..., D, D]``; k: ``[..., D]``; r2: any shape.  ``max diag(P)`` is ``p0`` for the prior
    ``p0·I`` and at most ``λ_max(P)`` otherwise.
    """
    pmax = torch.diagonal(P.detach(), dim1=-2, dim2=-1).amax().to(torch.float64)
    kmax = torch.linalg.vector_norm(k.detach(), dim=-1).amax().to(torch.float64) ** 2  # no copy of k
    return pmax * kmax / r2.detach().amin().to(torch.float64)


def check_state_precision(P: torch.Tensor | None, k: torch.Tensor, r2: torch.Tensor | None, *,
                          name: str = "the state") -> None:
    """Warn (:class:`~bayeslayer.errors.PrecisionWarning`) when a float32 covariance state is asked to hold a
    wide prior, ``max diag(P)·max ‖k‖²/min r² > WIDE_PRIOR_RATIO``, and say what to pass instead.

    An eager value check (:func:`values_checked`): it decides nothing.  The call's own arithmetic is
    unaffected (the covariance runs in :data:`COVARIANCE_DTYPE`); only the ``P`` it returns, rounded to
    float32, loses the written directions, so decoding on from it drifts.  A float64 ``P`` (from
    ``initial_bl_state(..., dtype=torch.float64)`` or float64 inputs) stays float64 and holds it.
    """
    if P is None or r2 is None or P.dtype == torch.float64 or not values_checked(P, k, r2):
        return
    if bool(prior_noise_ratio(P, k, r2) > WIDE_PRIOR_RATIO):
        # one message per call site (no value in it), so a decoding loop warns once, not at every token
        warnings.warn(
            f"{name}'s P is {P.dtype} but the prior is wide (max diag(P)·‖k‖²/r² above {WIDE_PRIOR_RATIO:.0e}), "
            f"where a {P.dtype} covariance loses the written directions; this call computes in float64, but "
            "the P it returns is rounded to its dtype. Pass a float64 state (initial_bl_state(..., "
            "dtype=torch.float64), or the returned state with P.double()) or float64 inputs to keep it",
            PrecisionWarning, stacklevel=3)


# The reset family's erase ``I − η k kᵀ`` scales the memory along k by ``1 − η‖k‖²``.  Its design
# model (docs/theory.md §3) gives ``η‖k‖² = λ‖k‖²/(r² + λ‖k‖²) ∈ (0, 1)``; fla's ``allow_neg_eigval``
# (DeltaNet/GDN with β ∈ (0, 2)) extends it to (0, 2), still no expansion.  Above 2 the erase
# expands the memory along k by |1 − η‖k‖²| > 1 at every repeat of a key (gain = 10 with unit keys:
# max |o| 2.8e8 after 2000 tokens).  The small slack absorbs rounding of ‖k‖² for unit keys.
MAX_RESET_GAIN = 2.0


def check_reset_gain(gain: torch.Tensor, k: torch.Tensor) -> None:
    """The reset family's gain given directly: ``0 < η_t ‖k_t‖² ≤ 2`` (gain ``[B, T, H']``, k ``[B, T, H', D]``)."""
    if not _values_checked(gain) or gain.numel() == 0:
        return
    eff = gain * (k * k).sum(-1)
    worst = eff.amax()
    if bool(worst > MAX_RESET_GAIN * (1 + 1e-4)):
        raise ValueError(
            f"gain (the reset family's η) must satisfy gain·‖k‖² ≤ {MAX_RESET_GAIN:g}: the erase I − η k kᵀ "
            f"then never expands the memory (the design model's η = λ/(r² + λ‖k‖²) gives gain·‖k‖² in "
            f"(0, 1), fla's allow_neg_eigval (0, 2)); got max gain·‖k‖² = {worst.item():.4g} "
            f"(max gain {gain.amax().item():.4g})"
        )


def check_chunk_size(chunk_size) -> int:
    if not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    return int(chunk_size)


def check_cu_seqlens(cu_seqlens, batch: int, total: int, device: torch.device) -> torch.Tensor | None:
    """``cu_seqlens``: 1-D int32/int64 ``[N + 1]``, 0 first, ``T`` last, non-decreasing; needs B = 1.

    Packs N variable-length sequences along T like flash-linear-attention: sequence n is
    tokens ``cu_seqlens[n] .. cu_seqlens[n+1] - 1`` and starts from its own initial state.
    The offsets' values are checked only where :func:`values_checked` allows (the packed paths read
    them on the host to split the sequences anyway).
    """
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of int32/int64, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [0, ..., T] with at least 2 entries, got shape {_shape(cu_seqlens)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if batch != 1:
        raise ValueError(f"cu_seqlens packs the sequences along T, so the batch size must be 1, got B={batch}")
    cu = cu_seqlens.to(torch.int64)
    if values_checked(cu):
        offsets = cu.tolist()
        if offsets[0] != 0 or offsets[-1] != total:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={total}, got {offsets[0]} .. {offsets[-1]}")
        if any(b < a for a, b in zip(offsets[:-1], offsets[1:], strict=True)):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    return cu
