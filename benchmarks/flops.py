"""FLOPs per token of every token mixer in a training step, counted and measured (prints a table).

    python benchmarks/flops.py                                   # hidden 512, 4 heads, head dim 128, T = 2048
    python benchmarks/flops.py --out results/flops/mixers.json   # and write the record docs/layers.md reads

Each mixer is built with its defaults at the given size (chunks of 64) and its training step is counted by
``Mixer.flops`` (:mod:`bayeslayer.ops.flops`: matrix products, convolutions and the filters' factorizations,
2 FLOPs per multiply-add) and measured by ``FlopCounterMode`` on the PyTorch path (the factorizations
registered at the same counts), with the elementwise work the convention leaves out (one per output element
of every other operation) beside it.  One intra-op thread; nothing is timed or asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (row label, registry name, extra constructor arguments); the rotation dynamics has no count (complex products)
ROWS = [
    ("bayesian (scalar decay)", "bayesian", {}),
    ("bayesian, groups=4", "bayesian", {"groups": 4}),
    ("bayesian, diagonal decay", "bayesian", {"dynamics": "diagonal"}),
    ("bayesian, diagonal covariance", "bayesian", {"covariance": "diagonal"}),
    ("bayesian, low-rank r=8", "bayesian", {"covariance": "lowrank", "rank": 8}),
    ("gated_deltanet", "gated_deltanet", {}),
    ("gated_deltanet, expand_v=3 (state of BL)", "gated_deltanet", {"expand_v": 3.0}),
    ("gated_deltanet_noconv", "gated_deltanet_noconv", {}),
    ("deltanet", "deltanet", {}),
    ("linear_attention", "linear_attention", {}),
    ("gla", "gla", {}),
    ("mamba2 (N = 128)", "mamba2", {}),
    ("attention", "attention", {}),
]


def measure_row(name: str, extra: dict, hidden: int, heads: int, head_dim: int, seq_len: int, lowrank_len: int):
    """``(mixer, count, measured)`` of one row; the low-rank covariance runs token by token, so it is measured on
    ``lowrank_len`` tokens (its count per token is the same at any length up to the chunk padding)."""
    import torch

    from bayeslayer.layers import build_mixer
    from bayeslayer.ops.flops import Tally
    from bayeslayer.training.flop_counter import measure_training_flops

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mixer = build_mixer(name, hidden, num_heads=heads, head_dim=head_dim, **extra)
    T = lowrank_len if extra.get("covariance") == "lowrank" else seq_len
    front = torch.nn.Linear(hidden, hidden)  # the mixer's input needs a gradient, as inside a model
    x = torch.randn(1, T, hidden)
    meas = measure_training_flops(lambda: mixer(front(x)).o.square().sum())
    t = Tally()
    t.linear(T, hidden, hidden, grad_input=False)
    front_count = t.count()
    measured = {"forward": meas.flops.forward - front_count.forward,
                "backward": meas.flops.backward - front_count.backward}
    return mixer, T, mixer.flops(1, T), measured, meas.elementwise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--lowrank-seq-len", type=int, default=256,
                        help="tokens the low-rank row is measured on (its covariance pass is a token loop)")
    parser.add_argument("--out", default=None, help="also write the rows as a JSON results record here")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    rows = []
    print(f"hidden {args.hidden}, {args.heads} heads, head dim {args.head_dim}, T = {args.seq_len}, batch 1; "
          "MFLOP per token of one training step (forward + backward)")
    print("| mixer | forward | backward | total | of it the filter | measured / counted | elementwise / counted |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, name, extra in ROWS:
        mixer, T, count, measured, elementwise = measure_row(name, extra, args.hidden, args.heads, args.head_dim,
                                                             args.seq_len, args.lowrank_seq_len)
        core = mixer.filter_flops(1, T) if hasattr(mixer, "filter_flops") else None
        row = {"label": label, "mixer": name, "kwargs": extra, "seq_len": T,
               "chunk_size": getattr(mixer, "chunk_size", None), "count": count.to_dict(),
               "filter": core.to_dict() if core is not None else None,
               "measured": {**measured, "total": measured["forward"] + measured["backward"]},
               "elementwise": elementwise.to_dict()}
        rows.append(row)
        print(f"| {label} | {count.forward / T / 1e6:.2f} | {count.backward / T / 1e6:.2f} | "
              f"{count.total / T / 1e6:.2f} | {'—' if core is None else f'{core.total / T / 1e6:.2f}'} | "
              f"{row['measured']['total'] / count.total:.3f} | "
              f"{elementwise.total / count.total:.3f} |", flush=True)
    if args.out:
        from bayeslayer.experiments.common.provenance import write_record

        record = {"benchmark": "flops", "hidden": args.hidden, "heads": args.heads, "head_dim": args.head_dim,
                  "batch_size": 1, "rows": rows}
        write_record(args.out, record, device="cpu", wall_seconds=time.perf_counter() - t_start)
        print(f"# record: {args.out}")


if __name__ == "__main__":
    main()
