"""Float32 accuracy of the Bayesian Layer's PyTorch paths against float64, at wide priors and long decoding.

Prints three tables (relative errors, max over every token, head and batch entry):

1. ``p0`` in {1e4, 1e6, 1e7, 1e8}: ``bl_recurrent``, ``bl_chunk`` and a ``bl_step`` decode, float32
   inputs against the same inputs in float64, with the smallest predictive variance and whether the
   state's ``P`` passed a Cholesky at every decoded token, for a decode from a float64 state (what the
   ``PrecisionWarning`` of a float32 state at a wide prior asks for) and from a float32 one;
2. long decoding with ``bl_step`` (``--tokens``, default 100,000) in two regimes: *benign* (random
   unit keys, α ∈ [0.999, 1]) with a float32 state, and *ill-conditioned* (keys in a 2-dim
   subspace of D = 8, r² ≈ 1e-3, ℓ² ≈ 1e-6, α ≈ 0.9995) with a float32 and a float64 state;
3. ``--forms``: the covariance-update forms the oracle could use, written out here (plain
   ``P̄ − β u uᵀ`` in float32, Joseph ``(I − K kᵀ) P̄ (I − K kᵀ)ᵀ + r² K Kᵀ`` in float32, a
   square-root update (QR time update, Potter measurement update) in float32);
4. ``--ill`` (``--ill-tokens``, default 20,000; B = 1, H = 2, D = m = 16): ill-conditioned regimes of the
   chunked path, r² ≈ 1e-3, ℓ² ≈ 1e-6, α ≈ 0.9995 with keys spread 1e-3 around one direction
   (*collinear*) or confined to a 2-dim subspace, at p0 = 1 and 1e8: ``bl_recurrent`` and ``bl_chunk``
   in float32 against float64, the largest per-token error (``max_t |Δo_t| / max |o_t|``), and the same
   inputs rounded to bfloat16 against the unrounded float64 reference;
5. ``--cost``: ``bl_chunk`` forward and forward+backward time (one thread, minimum over interleaved
   repeats) with the covariance pass in float64 as shipped (``ops.utils.validation.COVARIANCE_DTYPE``) and
   in float32, in a typical regime (unit keys, r² ∈ [0.1, 1.1]) and the collinear one.

Run it against another checkout to compare (``PYTHONPATH=/path/to/checkout python benchmarks/numerics.py``).
Slow by design (the decode is a Python loop over tokens); never a test.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from bayeslayer.errors import PrecisionWarning
from bayeslayer.ops import bl_chunk, bl_recurrent, bl_step, initial_bl_state

F64 = torch.float64


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max error relative to the largest reference value (outputs)."""
    return float((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def rel_each(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max elementwise relative error (variances, all ≥ 1)."""
    return float(((a.double() - ref).abs() / ref.abs()).max())


def wide_prior_inputs(B=2, T=64, H=2, D=16, m=8, seed=0):
    """Random unit keys, r² ∈ [0.1, 1.1], ℓ² ∈ [0.01, 0.11], α ∈ [0.9, 1]; float32 values held in float64."""
    g = torch.Generator().manual_seed(seed)
    x = dict(
        q=torch.randn(B, T, H, D, generator=g, dtype=F64),
        k=torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g, dtype=F64), dim=-1),
        v=torch.randn(B, T, H, m, generator=g, dtype=F64),
        r2=0.1 + torch.rand(B, T, H, generator=g, dtype=F64),
        ell2=0.01 + 0.1 * torch.rand(B, T, H, generator=g, dtype=F64),
        alpha=0.9 + 0.1 * torch.rand(B, T, H, generator=g, dtype=F64),
    )
    return {name: t.float().double() for name, t in x.items()}


def long_inputs(regime: str, T: int, B=1, H=2, D=8, m=8, seed=0):
    """The two decoding regimes of the module docstring; float32 values held in float64."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=F64)

    q = torch.randn(B, T, H, D, generator=g, dtype=F64)
    v = torch.randn(B, T, H, m, generator=g, dtype=F64)
    if regime == "benign":
        k = torch.randn(B, T, H, D, generator=g, dtype=F64)
        r2, ell2, alpha = 0.1 + rand(B, T, H), 1e-3 * (0.1 + rand(B, T, H)), 0.999 + 0.001 * rand(B, T, H)
    else:
        basis = torch.linalg.qr(torch.randn(D, 2, generator=g, dtype=F64))[0]
        k = torch.randn(B, T, H, 2, generator=g, dtype=F64) @ basis.T
        r2, ell2, alpha = 1e-3 * (0.5 + rand(B, T, H)), 1e-6 * (0.5 + rand(B, T, H)), 0.9995 + 0.0005 * rand(B, T, H)
    k = torch.nn.functional.normalize(k, dim=-1)
    x = dict(q=q, k=k, v=v, r2=r2, ell2=ell2, alpha=alpha)
    return {name: t.float().double() for name, t in x.items()}


def decode(x: dict, dtype, state_dtype, p0: float = 1.0):
    """bl_step over every token; returns (o, variance, every token's P passed a Cholesky, min eig/‖P‖)."""
    B, T, H, D = x["q"].shape
    c = {name: t.to(dtype) for name, t in x.items()}
    state = initial_bl_state(B, H, D, x["v"].shape[-1], p0=p0, dtype=state_dtype)
    outs, variances, chol_ok, worst = [], [], True, float("inf")
    eye = torch.eye(D, dtype=F64)
    for t in range(T):
        o, var, state = bl_step(c["q"][:, t], c["k"][:, t], c["v"][:, t], c["r2"][:, t], c["ell2"][:, t],
                                c["alpha"][:, t], state=state, return_variance=True)
        outs.append(o)
        variances.append(var)
        P = state[1].double()
        scale = float(P.abs().max())
        if T <= 4096 or t % 97 == 0:  # an eigendecomposition per token is most of the time at 1e5 tokens
            worst = min(worst, float(torch.linalg.eigvalsh(P).min()) / scale)
        chol_ok &= bool((torch.linalg.cholesky_ex(P + 1e-12 * scale * eye).info == 0).all())
    return torch.stack(outs, 1), torch.stack(variances, 1), chol_ok, worst


def table_p0(p0s=(1e4, 1e6, 1e7, 1e8)):
    x = wide_prior_inputs()
    args = ("q", "k", "v", "r2", "ell2", "alpha")
    print("1. wide prior p0 (B=2, T=64, H=2, D=16, m=8; float32 vs float64, max relative error)")
    print(f"{'p0':>6} | {'recurrent o':>11} {'variance':>9} {'min var':>8} | {'chunk o':>9} {'variance':>9} | "
          f"{'step o':>9} {'variance':>9} {'P chol':>6} {'min eig/|P|':>11} | {'f32 state: o':>12} {'P chol':>6}")
    for p0 in p0s:
        ref_o, ref_var, _ = bl_recurrent(*(x[a] for a in args), p0=p0, return_variance=True)
        f32 = [x[a].float() for a in args]
        o, var, _ = bl_recurrent(*f32, p0=p0, return_variance=True)
        row = f"{p0:>6.0e} | {rel(o, ref_o):>11.1e} {rel_each(var, ref_var):>9.1e} {float(var.min()):>8.3g} | "
        try:
            oc, vc, _ = bl_chunk(*f32, p0=p0, return_variance=True)
            row += f"{rel(oc, ref_o):>9.1e} {rel_each(vc, ref_var):>9.1e} | "
        except Exception as exc:  # noqa: BLE001 - the table reports what the path does
            row += f"{type(exc).__name__:>19.19} | "
        try:
            os_, vs, ok, worst = decode(x, torch.float32, F64, p0=p0)
            row += f"{rel(os_, ref_o):>9.1e} {rel_each(vs, ref_var):>9.1e} {str(ok):>6} {worst:>11.1e} | "
        except Exception as exc:  # noqa: BLE001
            row += f"{type(exc).__name__}: {str(exc)[:60]} | "
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PrecisionWarning)  # the table shows what it warns about
                os_, vs, ok, worst = decode(x, torch.float32, torch.float32, p0=p0)
            row += f"{rel(os_, ref_o):>12.1e} {str(ok):>6}"
        except Exception as exc:  # noqa: BLE001
            row += f"{type(exc).__name__}: {str(exc)[:60]}"
        print(row)


def table_decode(T: int):
    print(f"\n2. decoding {T} tokens with bl_step (B=1, H=2, D=m=8; float32 inputs vs float64)")
    print(f"{'regime':>16} {'state':>7} | {'o':>9} {'variance':>9} {'P chol':>6} {'min eig/|P|':>11} {'s':>6}")
    for regime, state_dtypes in (("benign", (torch.float32,)), ("ill-conditioned", (torch.float32, F64))):
        x = long_inputs(regime, T)
        ref_o, ref_var, _ = bl_recurrent(x["q"], x["k"], x["v"], x["r2"], x["ell2"], x["alpha"],
                                         return_variance=True)
        for sd in state_dtypes:
            t0 = time.time()
            o, var, ok, worst = decode(x, torch.float32, sd)
            print(f"{regime:>16} {str(sd)[6:]:>7} | {rel(o, ref_o):>9.1e} {rel_each(var, ref_var):>9.1e} {str(ok):>6} "
                  f"{worst:>11.1e} {time.time() - t0:>6.0f}")


def scan_forms(form: str, x: dict, p0: float, dtype):
    """The covariance-update forms of table 3 (scalar decay, one noise group)."""
    q, k, v, r2, ell2, alpha = (x[a].to(dtype) for a in ("q", "k", "v", "r2", "ell2", "alpha"))
    B, T, H, D = q.shape
    eye = torch.eye(D, dtype=dtype)
    M = q.new_zeros(B, H, D, v.shape[-1])
    P = p0 * eye.expand(B, H, D, D)
    S = p0**0.5 * eye.expand(B, H, D, D)
    outs, variances = [], []
    for t in range(T):
        a, kt, r = alpha[:, t, :, None, None], k[:, t], r2[:, t, :, None]
        M_bar = a * M
        if form == "square-root":
            # time update: S̄ S̄ᵀ = (aS)(aS)ᵀ + ℓ² I by a QR of the stacked factor; measurement: Potter
            stacked = torch.cat([(a * S).transpose(-1, -2), ell2[:, t, :, None, None].sqrt() * eye], -2)
            S_bar = torch.linalg.qr(stacked, mode="r")[1].transpose(-1, -2)
            f = torch.einsum("bhij,bhi->bhj", S_bar, kt)
            u = torch.einsum("bhij,bhj->bhi", S_bar, f)
            beta = 1 / (r + (f * f).sum(-1, keepdim=True))
            gamma = 1 / (1 + torch.sqrt(r * beta))
            S = S_bar - (beta * gamma)[..., None] * u[..., :, None] * f[..., None, :]
            P = S @ S.transpose(-1, -2)
        else:
            P_bar = a * a * P + ell2[:, t, :, None, None] * eye
            u = torch.einsum("bhij,bhj->bhi", P_bar, kt)
            beta = 1 / (r + (kt * u).sum(-1, keepdim=True))
            if form == "joseph":
                erase = eye - (beta * u)[..., :, None] * kt[..., None, :]
                P = erase @ P_bar @ erase.transpose(-1, -2) + r[..., None] * beta[..., None] ** 2 * (
                    u[..., :, None] * u[..., None, :])
            else:
                P = P_bar - beta[..., None] * u[..., :, None] * u[..., None, :]
            P = 0.5 * (P + P.transpose(-1, -2))
        M = M_bar + (beta * u)[..., :, None] * (v[:, t] - torch.einsum("bhdm,bhd->bhm", M_bar, kt))[..., None, :]
        outs.append(torch.einsum("bhdm,bhd->bhm", M, q[:, t]))
        variances.append(1 + torch.einsum("bhi,bhij,bhj->bh", q[:, t], P, q[:, t]))
    return torch.stack(outs, 1), torch.stack(variances, 1)


def table_forms(p0s=(1e4, 1e6, 1e7, 1e8)):
    x = wide_prior_inputs()
    print("\n3. covariance-update forms (same inputs as table 1; relative error of o / variance vs float64)")
    # (the plain form in float64 is the reference itself; table 1's recurrent column is the float64 covariance
    # with a float32 mean, as the oracle now runs)
    forms = (("plain", torch.float32), ("joseph", torch.float32), ("square-root", torch.float32))
    print(f"{'p0':>6} | " + " | ".join(f"{f + ' ' + str(d)[6:]:>19}" for f, d in forms))
    timing = {}
    for p0 in p0s:
        ref_o, ref_var = scan_forms("plain", {n: t.double() for n, t in x.items()}, p0, F64)
        cells = []
        for form, dtype in forms:
            t0 = time.time()
            o, var = scan_forms(form, x, p0, dtype)
            timing[(form, dtype)] = time.time() - t0
            cells.append(f"{rel(o, ref_o):>9.1e} {rel_each(var, ref_var):>9.1e}")
        print(f"{p0:>6.0e} | " + " | ".join(cells))
    print("seconds per run: " + ", ".join(f"{f} {str(d)[6:]} {s:.2f}" for (f, d), s in timing.items()))


def ill_inputs(keys: str, T: int, B=1, H=2, D=16, m=16, spread=1e-3, seed=0):
    """Table 4's regimes: unit keys spread ``spread`` around one direction per head (``collinear``) or in a
    2-dim subspace; r² ≈ 1e-3, ℓ² ≈ 1e-6, α ≈ 0.9995.  float32 values held in float64."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=F64)

    q = torch.randn(B, T, H, D, generator=g, dtype=F64)
    v = torch.randn(B, T, H, m, generator=g, dtype=F64)
    if keys == "collinear":
        k = torch.randn(H, D, generator=g, dtype=F64) + spread * torch.randn(B, T, H, D, generator=g, dtype=F64)
    else:
        basis = torch.linalg.qr(torch.randn(D, 2, generator=g, dtype=F64))[0]
        k = torch.randn(B, T, H, 2, generator=g, dtype=F64) @ basis.T
    x = dict(q=q, k=torch.nn.functional.normalize(k, dim=-1), v=v, r2=1e-3 * (0.5 + rand(B, T, H)),
             ell2=1e-6 * (0.5 + rand(B, T, H)), alpha=0.9995 + 0.0005 * rand(B, T, H))
    return {name: t.float().double() for name, t in x.items()}


def per_token(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max over tokens of ``|Δo_t| / max |o_t|`` (each token against its own largest output)."""
    return float(((a.double() - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)).max())


def key_spread(k: torch.Tensor) -> float:
    """Mean distance of the keys from their mean direction (per head)."""
    centre = torch.nn.functional.normalize(k.double().mean(dim=(0, 1), keepdim=True), dim=-1)
    return float((k.double() - centre).norm(dim=-1).mean())


def table_ill(T: int):
    args = ("q", "k", "v", "r2", "ell2", "alpha")
    print(f"\n4. ill-conditioned chunks (B=1, T={T}, H=2, D=m=16; r² ≈ 1e-3, ℓ² ≈ 1e-6, α ≈ 0.9995): max|Δo| / "
          "max|o| against float64 on the same values")
    print("   (bf16: the keys, or every input, rounded to bfloat16, against the reference on the unrounded values;"
          " ‖Δk‖: mean change of a key by that rounding; spread: mean distance of the keys from their mean direction)")
    print(f"{'keys':>9} {'p0':>5} | {'recurrent':>9} {'per token':>9} | {'chunk':>9} {'per token':>9} "
          f"| {'bf16 k: rec.':>12} {'chunk':>6} {'all bf16: chunk':>15} {'‖Δk‖':>7} {'spread':>7}")
    for keys, p0 in (("collinear", 1.0), ("subspace", 1.0), ("subspace", 1e8)):
        x = ill_inputs(keys, T)
        ref, _ = bl_recurrent(*(x[a] for a in args), p0=p0)
        f32 = [x[a].float() for a in args]
        o_r, _ = bl_recurrent(*f32, p0=p0)
        o_c, _ = bl_chunk(*f32, p0=p0)
        k_bf = x["k"].to(torch.bfloat16).float()
        o_rb, _ = bl_recurrent(f32[0], k_bf, *f32[2:], p0=p0)
        o_cb, _ = bl_chunk(f32[0], k_bf, *f32[2:], p0=p0)
        o_ab, _ = bl_chunk(*(x[a].to(torch.bfloat16) for a in args), p0=p0)
        dk = float((k_bf.double() - x["k"]).norm(dim=-1).mean())
        print(f"{keys:>9} {p0:>5.0e} | {rel(o_r, ref):>9.1e} {per_token(o_r, ref):>9.1e} | {rel(o_c, ref):>9.1e} "
              f"{per_token(o_c, ref):>9.1e} | {rel(o_rb, ref):>12.2g} {rel(o_cb, ref):>6.2g} "
              f"{rel(o_ab, ref):>15.2g} {dk:>7.1e} {key_spread(x['k']):>7.1e}", flush=True)


def table_cost(T: int = 4096, repeats: int = 5):
    from bayeslayer.ops.bayesian_layer import chunk as chunk_module

    g = torch.Generator().manual_seed(0)
    B, H, D = 1, 4, 32
    typical = dict(q=torch.randn(B, T, H, D, generator=g),
                   k=torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1),
                   v=torch.randn(B, T, H, D, generator=g), r2=0.1 + torch.rand(B, T, H, generator=g),
                   ell2=1e-3 + 0.01 * torch.rand(B, T, H, generator=g),
                   alpha=0.9 + 0.1 * torch.rand(B, T, H, generator=g))
    collinear = {name: t.float() for name, t in ill_inputs("collinear", T, H=H, D=D, m=D).items()}
    args = ("q", "k", "v", "r2", "ell2", "alpha")
    rules = {"as shipped (float64)": chunk_module.COVARIANCE_DTYPE, "covariance in float32": torch.float32}
    print(f"\n5. bl_chunk time (B={B}, T={T}, H={H}, D=m={D}, one thread; min of {repeats} interleaved runs)")
    print(f"{'regime':>10} {'covariance pass':>24} | {'forward s':>9} {'ratio':>6} | {'fwd+bwd s':>9} {'ratio':>6}")
    for regime, x in (("typical", typical), ("collinear", collinear)):
        fwd = dict.fromkeys(rules, float("inf"))
        both = dict.fromkeys(rules, float("inf"))
        leaves = [x[a].clone().requires_grad_() for a in ("q", "k", "v")]
        try:
            for _ in range(repeats):
                for name, dtype in rules.items():
                    chunk_module.COVARIANCE_DTYPE = dtype
                    t0 = time.perf_counter()
                    bl_chunk(*(x[a] for a in args))
                    fwd[name] = min(fwd[name], time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    o, _ = bl_chunk(*leaves, *(x[a] for a in args[3:]))
                    o.sum().backward()
                    both[name] = min(both[name], time.perf_counter() - t0)
        finally:
            chunk_module.COVARIANCE_DTYPE = rules["as shipped (float64)"]
        base, base_both = fwd["covariance in float32"], both["covariance in float32"]
        for name in rules:
            print(f"{regime:>10} {name:>24} | {fwd[name]:>9.3f} {fwd[name] / base:>6.2f} | {both[name]:>9.3f} "
                  f"{both[name] / base_both:>6.2f}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000, help="decoded tokens in table 2 (0: skip it)")
    parser.add_argument("--forms", action="store_true", help="also print table 3 (the update forms)")
    parser.add_argument("--ill", action="store_true", help="also print table 4 (ill-conditioned chunks, bf16)")
    parser.add_argument("--ill-tokens", type=int, default=20_000, help="tokens of table 4 (default 20,000)")
    parser.add_argument("--cost", action="store_true", help="also print table 5 (the float64 rule's cost)")
    parser.add_argument("--only", action="store_true", help="print only the tables asked for by --forms/--ill/--cost")
    args = parser.parse_args(argv)
    if args.tokens < 0:
        parser.error(f"--tokens must be >= 0, got {args.tokens}")
    if args.ill_tokens < 1:
        parser.error(f"--ill-tokens must be >= 1, got {args.ill_tokens}")
    torch.set_num_threads(1)  # tiny matrices: threads only add synchronisation
    if not args.only:
        table_p0()
        if args.tokens:
            table_decode(args.tokens)
    if args.forms:
        table_forms()
    if args.ill:
        table_ill(args.ill_tokens)
    if args.cost:
        table_cost()


if __name__ == "__main__":
    main()
