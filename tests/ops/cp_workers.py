"""Worker processes of the context-parallel tests: each runs one rank of a gloo group on the CPU.

The tests start them with ``torch.multiprocessing.spawn`` (test code, not library code); every worker
also runs the one-process reference on the whole sequence (same seed), compares its own slice and
writes its errors to ``out_dir/rank{r}.json`` for the test to check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def init(rank: int, world: int, init_file: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def make_inputs(case: dict, dtype: torch.dtype) -> dict:
    """Global inputs of one case (``T`` tokens, B = 1), the same on every rank."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    T, H, D, m, G = case["T"], case["H"], case["D"], case["m"], case["G"]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    def unit(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64).to(dtype)

    k = torch.nn.functional.normalize(rnd(1, T, H, D), dim=-1)
    x = dict(
        q=rnd(1, T, H, D, scale=D**-0.5),
        k=k,
        v=rnd(1, T, H, m),
        r2=0.5 + unit(1, T, H, G) if G > 1 else 0.5 + unit(1, T, H),
        ell2=0.01 + 0.05 * unit(1, T, H),
    )
    if case["decay"] == "scalar":
        x["alpha"] = 0.85 + 0.15 * unit(1, T, H)
    elif case["decay"] == "diagonal":
        x["alpha"] = 0.8 + 0.2 * unit(1, T, H, D)
    N = len(case["cu"]) - 1
    if case.get("init"):
        X = rnd(N, H, G, D, D, scale=0.3) if G > 1 else rnd(N, H, D, D, scale=0.3)
        P0 = 0.5 * torch.eye(D, dtype=dtype) + X @ X.transpose(-1, -2)
        x["M0"], x["P0"] = rnd(N, H, D, m), P0
    # random weights of a loss over the outputs, variances and final states
    x["wo"], x["wv"] = rnd(1, T, H, m), rnd(1, T, H, G)
    x["wM"] = rnd(N, H, D, m)
    x["wP"] = rnd(N, H, G, D, D) if G > 1 else rnd(N, H, D, D)
    return x


GRAD_NAMES = ("q", "k", "v", "r2", "ell2", "alpha")


def _loss(o, var, state, x, seqs, a, b):
    loss = (o * x["wo"][:, a:b]).sum() + (var * x["wv"][:, a:b]).sum()
    if state is not None and len(seqs):
        loss = loss + (state[0] * x["wM"][seqs]).sum() + (state[1] * x["wP"][seqs]).sum()
    return loss


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def check_case(case: dict, dtype: torch.dtype) -> dict:
    """One case on this rank: CP against one process; the largest relative error of every compared tensor."""
    from bayeslayer.ops import bl_chunk, build_cp_context

    x = make_inputs(case, dtype)
    cu = torch.tensor(case["cu"], dtype=torch.int64)
    C = case.get("C", 16)
    names = [n for n in GRAD_NAMES if n in x]
    init_names = ["M0", "P0"] if case.get("init") else []
    N = len(case["cu"]) - 1
    # one process on the whole sequence
    ref = {n: x[n].clone().requires_grad_() for n in names + init_names}
    st = (ref["M0"], ref["P0"]) if init_names else None
    o, var, state = bl_chunk(
        ref["q"],
        ref["k"],
        ref["v"],
        ref["r2"],
        ref["ell2"],
        alpha=ref.get("alpha"),
        initial_state=st,
        output_final_state=True,
        return_variance=True,
        chunk_size=C,
        cu_seqlens=cu,
        backend="torch",
    )
    _loss(o, var, state, x, list(range(N)), 0, x["q"].shape[1]).backward()
    # this rank's slice
    ctx = build_cp_context(cu, conv1d_kernel_size=case.get("W"))
    a, b = ctx.bounds[ctx.rank], ctx.bounds[ctx.rank + 1]
    loc = {n: x[n][:, a:b].clone().requires_grad_() for n in names}
    for n in init_names:
        loc[n] = x[n].clone().requires_grad_()
    st = (loc["M0"], loc["P0"]) if init_names else None
    ctx.reset_comm()
    o_c, var_c, state_c = bl_chunk(
        loc["q"],
        loc["k"],
        loc["v"],
        loc["r2"],
        loc["ell2"],
        alpha=loc.get("alpha"),
        initial_state=st,
        output_final_state=True,
        return_variance=True,
        chunk_size=C,
        cp_context=ctx,
    )
    _loss(o_c, var_c, state_c, x, ctx.final_seqs, a, b).backward()
    err = {"o": rel(o_c, o[:, a:b]), "variance": rel(var_c, var[:, a:b])}
    if ctx.final_seqs:
        err["M_final"] = rel(state_c[0], state[0][ctx.final_seqs])
        err["P_final"] = rel(state_c[1], state[1][ctx.final_seqs])
    for n in names:
        err["d" + n] = rel(loc[n].grad, ref[n].grad[:, a:b])
    for n in init_names:  # shared: each rank holds its share, their sum is the one-process gradient
        g = loc[n].grad.clone() if loc[n].grad is not None else torch.zeros_like(loc[n])  # unused on this rank
        dist.all_reduce(g)
        if n == "P0":  # P is symmetric: only the symmetric part of its gradient is defined by the filter
            g, r = 0.5 * (g + g.transpose(-1, -2)), 0.5 * (ref[n].grad + ref[n].grad.transpose(-1, -2))
        else:
            r = ref[n].grad
        err["d" + n] = rel(g, r)
    err["comm"] = dict(ctx.comm_bytes)
    return err


def run_grid(rank: int, world: int, init_file: str, out_dir: str, cases: list, dtype_name: str) -> None:
    init(rank, world, init_file)
    try:
        dtype = getattr(torch, dtype_name)
        results = [check_case(case, dtype) for case in cases]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def comm_by_length(lengths: list) -> dict:
    """Bytes per rank of one forward and backward at every length in ``lengths`` (one sequence, H = 1, D = m = 4)."""
    from bayeslayer.ops import bl_chunk, build_cp_context

    out = {}
    for T in lengths:
        case = dict(T=T, H=1, D=4, m=4, G=1, decay="scalar", cu=[0, T])
        x = make_inputs(case, torch.float32)
        ctx = build_cp_context(torch.tensor(case["cu"]))
        a, b = ctx.bounds[ctx.rank], ctx.bounds[ctx.rank + 1]
        q = x["q"][:, a:b].clone().requires_grad_()
        o, _ = bl_chunk(
            q,
            x["k"][:, a:b],
            x["v"][:, a:b],
            x["r2"][:, a:b],
            x["ell2"][:, a:b],
            alpha=x["alpha"][:, a:b],
            chunk_size=64,
            cp_context=ctx,
        )
        o.sum().backward()
        out[str(T)] = dict(ctx.comm_bytes)
    return out


def halo_case() -> dict:
    """A causal depthwise convolution (width 4) over the halo + slice against the one-process convolution,
    varlen (a sequence boundary 2 tokens before rank 1's start), values and gradients."""
    from bayeslayer.ops.bayesian_layer.cp import build_cp_context, cp_conv_halo

    T, W, Dm = 24, 4, 3
    cu = [0, 10, 17, T]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, T, Dm, generator=g, dtype=torch.float64)
    w = torch.randn(Dm, 1, W, generator=g, dtype=torch.float64)
    wo = torch.randn(1, T, Dm, generator=g, dtype=torch.float64)

    def conv(seq):  # one sequence [1, L, Dm] -> causal conv [1, L, Dm]
        y = torch.nn.functional.conv1d(torch.nn.functional.pad(seq.transpose(1, 2), (W - 1, 0)), w, groups=Dm)
        return y.transpose(1, 2)

    xr = x.clone().requires_grad_()
    ref = torch.cat([conv(xr[:, a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)], 1)
    (ref * wo).sum().backward()
    ctx = build_cp_context(torch.tensor(cu), conv1d_kernel_size=W)
    a, b = ctx.bounds[ctx.rank], ctx.bounds[ctx.rank + 1]
    xl = x[:, a:b].clone().requires_grad_()
    ext = cp_conv_halo(xl, ctx)  # one sequence per local piece, the first one with its halo
    lc = [c + W - 1 for c in ctx.local_cu]
    lc[0] = 0
    y = torch.cat(
        [
            conv(ext[:, p:q])[:, (W - 1 if i == 0 else 0) :]
            for i, (p, q) in enumerate(zip(lc[:-1], lc[1:], strict=True))
        ],
        1,
    )
    (y * wo[:, a:b]).sum().backward()
    return {"y": rel(y, ref[:, a:b]), "dx": rel(xl.grad, xr.grad[:, a:b])}


def bad_setups() -> dict:
    """Bad set-ups; every rank records the error it got."""
    from bayeslayer.ops import bl_chunk, build_cp_context

    rank = dist.get_rank()
    got = {}
    try:  # the ranks disagree on the global offsets
        build_cp_context(torch.tensor([0, 10, 32] if rank == 0 else [0, 12, 32]))
    except ValueError as e:
        got["disagree"] = str(e)
    try:  # the ranks disagree on the short convolution's width
        build_cp_context(torch.tensor([0, 32]), conv1d_kernel_size=4 if rank == 0 else 3)
    except ValueError as e:
        got["kernel"] = str(e)
    sub = dist.new_group([0])  # every rank must call new_group; only rank 0 is a member
    try:
        build_cp_context(torch.tensor([0, 32]), group=sub)
        got["member"] = "ok"
    except ValueError as e:
        got["member"] = str(e)
    ctx = build_cp_context(torch.tensor([0, 32]))
    x = make_inputs(dict(T=32, H=1, D=4, m=4, G=1, decay="scalar", cu=[0, 32]), torch.float64)
    try:  # a context for another slice (or group): the whole sequence instead of this rank's slice
        bl_chunk(x["q"], x["k"], x["v"], x["r2"], x["ell2"], cp_context=ctx)
    except ValueError as e:
        got["slice"] = str(e)
    return got


def run_all(rank: int, world: int, init_file: str, out_dir: str, cases64: list, cases32: list, lengths: list) -> None:
    """Everything the default suite checks on 2 ranks, in one group (starting processes is the slow part)."""
    init(rank, world, init_file)
    try:
        out = {
            "float64": [check_case(c, torch.float64) for c in cases64],
            "float32": [check_case(c, torch.float32) for c in cases32],
            "comm": comm_by_length(lengths),
            "bad": bad_setups(),
            "halo": halo_case(),
            "model": {
                "float64": train_model(3, 40, torch.float64),
                "float32": train_model(3, 40, torch.float32),
                "refused": refused_mixers(),
            },
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _tiny_model(mixers: list[str], dtype: torch.dtype):
    from bayeslayer.models import BayesLayerConfig, BayesLayerForCausalLM

    torch.manual_seed(0)
    cfg = BayesLayerConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=len(mixers),
        num_heads=2,
        head_dim=4,
        mixers=mixers,
        bos_token_id=None,
        eos_token_id=None,
    )
    return BayesLayerForCausalLM(cfg).to(dtype).train()


def train_model(steps: int, T: int, dtype: torch.dtype) -> dict:
    """A two-layer model trained ``steps`` SGD steps on one sequence: context parallel (the loss summed over
    ranks, gradients all-reduced, as data parallelism would) against one process; losses and weights."""
    from bayeslayer.ops import build_cp_context

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (1, T), generator=g)
    ref, cp = _tiny_model(["bayesian", "bayesian"], dtype), _tiny_model(["bayesian", "bayesian"], dtype)
    ctx = build_cp_context(total_len=T, conv1d_kernel_size=4)
    a, b = ctx.bounds[ctx.rank], ctx.bounds[ctx.rank + 1]
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt_cp = torch.optim.SGD(cp.parameters(), lr=0.5)
    losses_ref, losses_cp = [], []
    for _ in range(steps):
        opt_ref.zero_grad()
        # the loss in the model's dtype (the model's own labels= loss is computed in float32)
        logits = ref(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum") / (T - 1)
        loss.backward()
        opt_ref.step()
        losses_ref.append(loss.item())
        opt_cp.zero_grad()
        logits = cp(input_ids=ids[:, a:b], cp_context=ctx).logits
        n = min(b, T - 1) - a  # positions of this slice that predict a next token
        local = torch.nn.functional.cross_entropy(logits[0, :n], ids[0, a + 1 : a + 1 + n], reduction="sum") / (T - 1)
        local.backward()
        for p in cp.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        opt_cp.step()
        total = local.detach().clone()
        dist.all_reduce(total)
        losses_cp.append(total.item())
    weights = max(rel(pc, pr) for pc, pr in zip(cp.parameters(), ref.parameters(), strict=True))
    loss_err = max(abs(x - y) / abs(y) for x, y in zip(losses_cp, losses_ref, strict=True))
    return {"weights": weights, "losses": loss_err, "losses_ref": losses_ref}


def refused_mixers() -> dict:
    from bayeslayer.ops import build_cp_context

    ctx = build_cp_context(total_len=16, conv1d_kernel_size=4)
    got = {}
    for mixers in (["bayesian", "attention"], ["mamba2"]):
        model = _tiny_model(mixers, torch.float64)
        a, b = ctx.bounds[ctx.rank], ctx.bounds[ctx.rank + 1]
        try:
            model(input_ids=torch.zeros(1, b - a, dtype=torch.int64), cp_context=ctx)
            got[mixers[-1]] = "ran"
        except ValueError as e:
            got[mixers[-1]] = str(e)
    return got
