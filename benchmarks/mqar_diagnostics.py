"""Training diagnostics of one MQAR model: loss, gradient norms per parameter group, and the filter's gains.

    python benchmarks/mqar_diagnostics.py --mixer bayesian --task update --max-steps 300 --threads 1 \
        --out results/mqar/stacked_bl/bl_default.json
    python benchmarks/mqar_diagnostics.py --mixer bayesian --set r2_init=0.1 --lr 3e-3 ...

Builds exactly the model ``bayeslayer mqar`` builds (:func:`bayeslayer.experiments.mqar.model_config`, the
preset's layout, width and state budget), on the same pool, batches and optimiser (AdamW with the library's
parameter groups, linear warmup then cosine, global-norm clipping), and logs:

* every step: the loss, the learning rate and the gradient norm (before clipping) of each parameter group —
  ``embed``, ``head``, ``norms`` and, per mixer layer ``L<i>``, its projections, convolutions, output gate and
  norm, and the write parameters (``noise``: r²/ℓ² maps and biases; ``beta``: GDN's gain map; ``decay``);
* every ``--every`` steps, on a fixed probe batch of the test task (Update: length 128, 16 pairs, 16 updates):
  the query accuracy, and per mixer layer the write statistics over all tokens — the gain ``kᵀw`` (BL:
  ``kᵀP̄k / (r² + kᵀP̄k)``, the Kalman gain's size along the key; GDN: ``β``), ``r²``, ``ℓ²``, ``α``, and the
  covariance's ``tr(P)/D`` (mean over tokens, and at the last token), from the layer's own recurrent step.

``--plot OUT.png FILE.json ...`` draws the smoothed training losses of diagnostic records (nothing is trained).

``--set name=value`` overrides a mixer constructor keyword (``r2_init``, ``ell2_init``, ``p0``, ``use_gate`` …)
to test an initialisation.  The JSON goes through :func:`bayeslayer.experiments.common.provenance.write_record`.
"""

from __future__ import annotations

import argparse
import ast
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bayeslayer.data.mqar import MQARTask, make_pool  # noqa: E402
from bayeslayer.evaluation.mqar import query_counts  # noqa: E402
from bayeslayer.experiments.common.harness import masked_cross_entropy  # noqa: E402
from bayeslayer.experiments.common.provenance import write_record  # noqa: E402
from bayeslayer.experiments.mqar import (  # noqa: E402
    PRESETS,
    MQARModel,
    epoch_sampler,
    model_config,
    train_config,
    train_tasks,
)
from bayeslayer.training.loop import lr_lambda  # noqa: E402
from bayeslayer.training.optim import DECAY_POLICY, param_groups  # noqa: E402
from bayeslayer.training.state import seed_everything  # noqa: E402

PART_OF = (  # (name fragment, group) in order; the first match wins
    ("r2_", "noise"), ("ell2_", "noise"), ("b_proj", "beta"), ("a_proj", "decay"), ("A_log", "decay"),
    ("dt_bias", "decay"), ("q_conv1d", "q_conv"), ("k_conv1d", "k_conv"), ("v_conv1d", "v_conv"),
    ("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("g_proj", "g_proj"),
    ("o_norm", "o_norm"), ("o_proj", "o_proj"),
)


def group_of(name: str) -> str:
    """``embed``, ``head``, ``norms`` or ``L<i>.<part>`` of a parameter name of an :class:`MQARModel`."""
    if name.startswith("embed."):
        return "embed"
    if name.startswith("head."):
        return "head"
    parts = name.split(".")
    if parts[0] in ("mixers", "sequence_mixers"):
        for frag, group in PART_OF:
            if frag in name:
                return f"L{parts[1]}.{group}"
        return f"L{parts[1]}.other"
    return "norms"


def parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--set takes name=value, got {item!r}")
        name, value = item.split("=", 1)
        try:
            out[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--set {name}: {value!r} is not a Python literal") from None
    return out


def quantiles(x: torch.Tensor) -> dict:
    x = x.detach().double().flatten()
    q = torch.quantile(x, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)) if x.numel() else None
    return {"mean": float(x.mean()), "p05": float(q[0]), "p50": float(q[1]), "p95": float(q[2]),
            "min": float(x.min()), "max": float(x.max())}


@torch.no_grad()
def write_statistics(model: MQARModel, inputs: torch.Tensor, mask: torch.Tensor) -> list[dict]:
    """Per mixer layer: the gain, noise, decay and covariance statistics on ``inputs`` (see the module doc)."""
    captured: dict[int, tuple] = {}
    layers = model.recurrent_mixers()
    originals = []
    for i, layer in enumerate(layers):
        orig = layer.features

        def wrapped(x, m, c, orig=orig, i=i):
            out = orig(x, m, c)
            captured[i] = out
            return out

        originals.append(orig)
        layer.features = wrapped
    try:
        logits = model(inputs)
    finally:
        for layer, orig in zip(layers, originals, strict=True):
            layer.features = orig
    stats = []
    for i, layer in enumerate(layers):
        q, k, v, write, _, _ = captured[i]
        s: dict = {"k_norm": quantiles(k.norm(dim=-1))}
        if "alpha" in write:
            s["alpha"] = quantiles(write["alpha"])
        if "gain" in write:  # the delta rule: the gain is β itself
            s["gain"] = quantiles(write["gain"])
        if "r2" in write:
            s["r2"], s["ell2"] = quantiles(write["r2"]), quantiles(write["ell2"])
            B, T, H, D = k.shape
            state = layer.initial_state(B, torch.float32, k.device)
            gains, traces, kpk = [], [], []
            for t in range(T):
                M, P = state
                # the step may hand back a float64 state; the statistics are computed in float64
                alpha = write["alpha"][:, t].double() if "alpha" in write else torch.ones(B, H, dtype=torch.float64)
                a2 = alpha.reshape(B, H, 1, 1) ** 2
                Pbar = a2 * P.double() + write["ell2"][:, t].double().reshape(B, H, 1, 1) * torch.eye(D).double()
                kt = k[:, t].double()
                u = torch.einsum("bhij,bhj->bhi", Pbar, kt)
                ku = (kt * u).sum(-1)
                gains.append(ku / (write["r2"][:, t].double() + ku))
                kpk.append(ku)
                out = layer.design.step(q[:, t], k[:, t], v[:, t], state=state, backend="torch",
                                        **{n: val[:, t] for n, val in write.items()})
                state = out.state
                traces.append(torch.diagonal(state[1].double(), dim1=-2, dim2=-1).sum(-1) / D)
            s["gain"] = quantiles(torch.stack(gains))
            s["kPk"] = quantiles(torch.stack(kpk))
            s["trace_P_over_D"] = quantiles(torch.stack(traces))
            s["trace_P_over_D_last"] = quantiles(traces[-1])
        stats.append(s)
    labels = mask
    hit = (logits.argmax(-1) == labels) & (labels != -100)
    return stats, float(hit.sum()) / max(1, int((labels != -100).sum()))


def plot(png: str, files: list[str], window: int = 25) -> None:
    """Training loss (moving mean over ``window`` steps) of each diagnostic record in ``files``."""
    import json

    from bayeslayer.experiments.common.plotting import Series, line_plot

    series = []
    for f in files:
        with open(f) as fh:
            r = json.load(fh)
        loss, steps = r["log"]["loss"], r["log"]["step"]
        y = [sum(loss[max(0, i - window + 1): i + 1]) / len(loss[max(0, i - window + 1): i + 1])
             for i in range(len(loss))]
        over = ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "defaults"
        label = f"{r['mixer']} ({over}), lr {r['lr']:g}"
        series.append(Series(label, steps, y))
    line_plot(png, series, xlabel="step", ylabel=f"training loss (mean of {window} steps)",
              title="MQAR Update, stacked layout: training loss", legend_loc="outside", figsize=(11, 4.5))
    print(f"wrote {png}")


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--plot":
        if len(argv) < 3:
            raise SystemExit("--plot OUT.png FILE.json [FILE.json ...]")
        plot(argv[1], argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixer", default="bayesian")
    p.add_argument("--task", default="update", choices=("update", "block"))
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--layout", default=None, choices=("stacked", "hybrid"))
    p.add_argument("--lr", type=float, default=None, help="default: the preset's first lr")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--probe", type=int, default=16, help="probe sequences")
    p.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE")
    p.add_argument("--init-alpha", type=float, default=None,
                   help="start every mixer layer's decay at α = exp(−softplus(dt_bias)) = this value (A = 1)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval", action="store_true", help="evaluate the test points at the end (slower)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    preset = PRESETS[args.preset]
    if args.layout:
        preset = replace(preset, layout=args.layout)
    if args.lr is not None:
        preset = replace(preset, lrs=(args.lr,))
    if args.max_steps is not None:
        preset = replace(preset, max_steps=args.max_steps)
    overrides = parse_set(args.set)
    train_ds, val_ds = make_pool(train_tasks(args.task, preset), num_examples=preset.pool_size(args.task),
                                 vocab_size=preset.vocab_size, seed=preset.data_seed,
                                 val_fraction=preset.val_fraction, random_non_queries=preset.random_non_queries)
    sampler = epoch_sampler(train_ds, preset.batch_size, preset.data_seed)
    steps = preset.epochs * sampler.steps_per_epoch
    if preset.max_steps is not None:
        steps = min(steps, preset.max_steps)
    cfg = replace(train_config(preset, steps), seed=args.seed)
    if args.task == "update":
        probe_task = MQARTask("update", preset.update_test_seq_len, preset.update_test_pairs,
                              max(preset.update_test_updates))
    else:
        probe_task = MQARTask("block", preset.block_seq_len, max(preset.block_test_pairs), block_size=preset.block_size)
    probe = probe_task.generate(args.probe, vocab_size=preset.vocab_size, seed=preset.test_seed + 99,
                                random_non_queries=preset.random_non_queries)

    mcfg, head = model_config(args.mixer, preset, preset.width)
    mcfg = replace(mcfg, mixer_kwargs={**mcfg.mixer_kwargs, **overrides})
    seed_everything(args.seed)
    model = MQARModel(mcfg)
    if args.init_alpha is not None:
        if not 0 < args.init_alpha < 1:
            raise SystemExit(f"--init-alpha must be in (0, 1), got {args.init_alpha}")
        from bayeslayer.layers.common import inverse_softplus

        with torch.no_grad():
            for layer in model.recurrent_mixers():
                layer.A_log.zero_()
                layer.dt_bias.copy_(inverse_softplus(torch.full_like(layer.dt_bias, -math.log(args.init_alpha))))
        overrides["init_alpha"] = args.init_alpha
    names = {id(p): n for n, p in model.named_parameters()}
    groups = sorted({group_of(n) for n in names.values()})
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    params = [p for p in model.parameters() if p.requires_grad]
    log = {"step": [], "loss": [], "lr": [], "grad_norm": [], "group_grad_norm": {g: [] for g in groups}}
    probes = []

    def do_probe(step: int) -> None:
        model.eval()
        stats, acc = write_statistics(model, probe.inputs, probe.labels)
        model.train()
        probes.append({"step": step, "probe_accuracy": acc, "layers": stats})
        g = stats[-1].get("gain", {})
        print(f"  probe step {step}: acc {acc:.3f}; " + "; ".join(
            f"L{i} gain {s['gain']['p50']:.3f} [{s['gain']['p05']:.3f},{s['gain']['p95']:.3f}]"
            + (f" r2 {s['r2']['p50']:.3g} l2 {s['ell2']['p50']:.3g} trP/D {s['trace_P_over_D']['p50']:.3g}"
               if "r2" in s else "") + (f" a {s['alpha']['p50']:.3f}" if "alpha" in s else "")
            for i, s in enumerate(stats)) if g else "", flush=True)

    t0 = time.perf_counter()
    do_probe(0)
    model.train()
    for step in range(steps):
        batch = sampler(step, cfg.batch_size, None)
        loss = masked_cross_entropy(model(batch.inputs), batch.labels)
        if not torch.isfinite(loss):
            print(f"non-finite loss at step {step}", flush=True)
            break
        loss.backward()
        sq = dict.fromkeys(groups, 0.0)
        for n, p_ in model.named_parameters():
            if p_.grad is not None:
                sq[group_of(n)] += float(p_.grad.double().pow(2).sum())
        total = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        log["step"].append(step + 1)
        log["loss"].append(float(loss.detach()))
        log["lr"].append(opt.param_groups[0]["lr"])
        log["grad_norm"].append(float(total))
        for g in groups:
            log["group_grad_norm"][g].append(math.sqrt(sq[g]))
        if (step + 1) % args.every == 0 or step + 1 == steps:
            tail = log["loss"][-args.every:]
            print(f"step {step + 1}/{steps} loss {sum(tail) / len(tail):.4f} |g| {float(total):.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
            do_probe(step + 1)
    train_seconds = time.perf_counter() - t0
    layer0 = model.recurrent_mixers()[0]
    record = {"experiment": "mqar_diagnostics", "preset": preset.name, "task": args.task, "mixer": args.mixer,
              "layout": preset.layout, "width": preset.width, "head": head.summary(),
              "mixer_kwargs": mcfg.mixer_kwargs, "overrides": overrides,
              "built": {"num_heads": layer0.num_heads, "head_dim": layer0.head_dim, "head_v_dim": layer0.head_v_dim,
                        "state_per_layer": model.state_size_per_layer(), "use_gate": layer0.use_gate},
              "lr": cfg.lr, "steps": steps,
              "train_config": {k: getattr(cfg, k) for k in ("steps", "batch_size", "lr", "warmup_steps",
                                                             "weight_decay", "grad_clip", "seed")},
              "probe_task": {"seq_len": probe_task.seq_len, "num_pairs": probe_task.num_pairs,
                             "examples": args.probe},
              "train_seconds": train_seconds, "log": log, "probes": probes}
    if args.eval:
        evals = []
        model.eval()
        with torch.no_grad():
            for seg in val_ds.segments:
                evals.append({"seq_len": seg.seq_len, "accuracy": query_counts(model, seg, 128)["accuracy"]})
            tests = []
            if args.task == "update":
                for i, u in enumerate(preset.update_test_updates):
                    if u not in (0, 8, 16):
                        continue
                    data = MQARTask("update", preset.update_test_seq_len, preset.update_test_pairs, u).generate(
                        preset.test_examples, vocab_size=preset.vocab_size, seed=preset.test_seed + i,
                        random_non_queries=preset.random_non_queries)
                    tests.append({"x": u, "accuracy": query_counts(model, data, 128)["accuracy"]})
        record["val_by_segment"], record["test"] = evals, tests
        print("test:", tests, flush=True)
    write_record(args.out, record, seeds=[args.seed], wall_seconds=time.perf_counter() - t_start,
                 optimizer_groups=DECAY_POLICY)
    print(f"wrote {args.out} ({train_seconds:.0f}s training)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
