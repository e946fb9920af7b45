"""Property tests (hypothesis): on random inputs the covariance stays symmetric PSD and the gain in [0, 1).

For both paths: ``P`` at every chunk boundary and at the end is symmetric with eigenvalues
``≥ −tol``, and the effective gain ``g_t = k_tᵀ K_t`` (``FilterOutput.gain``) lies in
``[0, 1)`` — a Kalman update can only shrink the variance along ``k_t``, never overshoot.
Sizes, noise levels (down to r² = 1e-3, a nearly noiseless write), key norms, priors and decays
are drawn; the tensors themselves come from a drawn seed.
"""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from bayeslayer.ops import filter_chunk, filter_recurrent  # noqa: E402

from .inputs import DYNAMICS  # noqa: E402


def log_uniform(lo: float, hi: float):
    return st.floats(min_value=torch.tensor(lo).log().item(), max_value=torch.tensor(hi).log().item()).map(
        lambda x: float(torch.tensor(x).exp())
    )


@st.composite
def problems(draw, dtype=torch.float64):
    """A random filtering problem: keyword arguments for ``filter_recurrent``/``filter_chunk``."""
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    T = draw(st.integers(1, 80))
    D = draw(st.sampled_from([2, 4, 6]))
    G = draw(st.sampled_from([1, 2]))
    m = G * draw(st.integers(1, 2))
    dynamics = draw(st.sampled_from(DYNAMICS))
    r2_scale, ell2_scale = draw(log_uniform(1e-3, 10.0)), draw(log_uniform(1e-4, 1.0))
    key_scale, p0 = draw(log_uniform(0.1, 3.0)), draw(log_uniform(1e-2, 10.0))
    alpha_low = draw(st.floats(0.5, 1.0))
    chunk_size = draw(st.sampled_from([8, 16, 32]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    kw = dict(
        q=randn(B, T, H, D),
        k=key_scale * randn(B, T, H, D) / D**0.5,
        v=randn(B, T, H, m),
        r2=r2_scale * (0.1 + rand(B, T, H, *((G,) if G > 1 else ()))),
        ell2=ell2_scale * (0.1 + rand(B, T, H)),
        p0=p0,
        alpha=None,
        theta=None,
    )
    decay = lambda *shape: alpha_low + (1.0 - alpha_low) * rand(*shape)  # noqa: E731
    if dynamics == "scalar" or dynamics == "rotation_scalar":
        kw["alpha"] = decay(B, T, H)
    elif dynamics == "diagonal":
        kw["alpha"] = decay(B, T, H, D)
    elif dynamics == "rotation_pairs":
        kw["alpha"] = decay(B, T, H, D // 2)
    if dynamics.startswith("rotation"):
        kw["theta"] = 3.0 * randn(B, T, H, D // 2)
    return kw, chunk_size


def _segments(kw: dict, size: int):
    """Split the per-token arguments into consecutive segments of ``size`` tokens."""
    T = kw["q"].shape[1]
    for start in range(0, T, size):
        yield {k: (x[:, start : start + size] if isinstance(x, torch.Tensor) and k != "p0" else x)
               for k, x in kw.items()}


def assert_psd(P: torch.Tensor, *, rel_tol: float, where: str) -> None:
    scale = P.abs().amax(dim=(-1, -2), keepdim=True).clamp_min(1e-30)
    asym = ((P - P.transpose(-1, -2)).abs() / scale).max().item()
    assert asym <= rel_tol, f"P not symmetric at {where}: relative asymmetry {asym:.3g}"
    eig = torch.linalg.eigvalsh(0.5 * (P + P.transpose(-1, -2))) / scale[..., 0]
    lowest = eig.min().item()
    assert lowest >= -rel_tol, f"P not PSD at {where}: min relative eigenvalue {lowest:.3g}"


def check_run(kw: dict, chunk_size: int, *, write: str, path: str, rel_tol: float, gain_slack: float) -> None:
    """Run ``path`` one chunk-sized segment at a time (the state passed on), checking P and the gain."""
    fn = filter_chunk if path == "chunk" else filter_recurrent
    extra = dict(chunk_size=chunk_size) if path == "chunk" else {}
    state = None
    for i, seg in enumerate(_segments(kw, chunk_size)):
        if state is not None:
            seg["initial_state"] = state
        out = fn(**seg, write=write, output_final_state=True, **extra)
        state = out.state
        assert_psd(state[1], rel_tol=rel_tol, where=f"chunk boundary {i}")
        g = out.gain
        assert bool(torch.isfinite(g).all())
        assert g.min().item() >= -gain_slack, f"gain {g.min().item():.3g} < 0"
        assert g.max().item() < 1.0 + gain_slack, f"gain {g.max().item():.6g} not below 1"
        if write == "diagonal":
            off = state[1] - torch.diag_embed(torch.diagonal(state[1], dim1=-2, dim2=-1))
            assert bool((off == 0).all()), "diagonal-covariance state has off-diagonal entries"


@pytest.mark.parametrize("path", ["recurrent", "chunk"])
@given(problem=problems())
def test_covariance_psd_and_gain_in_unit_interval(path, problem):
    kw, chunk_size = problem
    check_run(kw, chunk_size, write="bayes", path=path, rel_tol=1e-9, gain_slack=0.0)


@pytest.mark.parametrize("path", ["recurrent", "chunk"])
@given(problem=problems())
def test_diagonal_covariance_stays_psd(path, problem):
    kw, chunk_size = problem
    check_run(kw, chunk_size, write="diagonal", path=path, rel_tol=1e-9, gain_slack=0.0)


@given(problem=problems(dtype=torch.float32))
def test_chunk_path_psd_in_float32(problem):
    """float32 filter arithmetic: PSD up to float32 rounding, gain in [0, 1] up to rounding."""
    kw, chunk_size = problem
    check_run(kw, chunk_size, write="bayes", path="chunk", rel_tol=1e-4, gain_slack=1e-5)


@given(problem=problems())
def test_single_call_end_state_psd(problem):
    """One call over the whole sequence (chunk boundaries internal): the final P is PSD."""
    kw, chunk_size = problem
    out = filter_chunk(**kw, write="bayes", chunk_size=chunk_size, output_final_state=True)
    assert_psd(out.state[1], rel_tol=1e-9, where="the end")
    assert 0.0 <= out.gain.min().item() and out.gain.max().item() < 1.0


@given(problem=problems(), lam=log_uniform(1e-2, 10.0))
def test_reset_gain_in_unit_interval(problem, lam):
    """The reset family's gain ``η‖k‖² = λ‖k‖²/(r² + λ‖k‖²)`` lies in [0, 1) on both paths."""
    kw, chunk_size = problem
    kw = {k: x for k, x in kw.items() if k not in ("ell2", "p0")}
    for out in (filter_recurrent(**kw, write="reset", lam=lam),
                filter_chunk(**kw, write="reset", lam=lam, chunk_size=chunk_size)):
        assert 0.0 <= out.gain.min().item() and out.gain.max().item() < 1.0
