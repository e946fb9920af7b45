"""Parameter counts and recurrent-state sizes of every token mixer at one size (prints a table).

    python benchmarks/layer_sizes.py                       # hidden 512, 4 heads, head dim 128
    python benchmarks/layer_sizes.py --hidden 1024 --heads 4 --head-dim 256

Each mixer is built with its defaults at the given size and its parameters are counted from the
module itself (the docstring formulas are checked against the same count by the tests).  Nothing
is timed or asserted.  The table in docs/layers.md is this script's output.
"""

from __future__ import annotations

import argparse
import warnings

from bayeslayer.layers import MIXERS, build_mixer

# (row label, registry name, extra constructor arguments)
ROWS = [
    ("bayesian (scalar decay)", "bayesian", {}),
    ("bayesian, groups=4", "bayesian", {"groups": 4}),
    ("bayesian, diagonal decay", "bayesian", {"dynamics": "diagonal"}),
    ("bayesian, rotations", "bayesian", {"dynamics": "rotation"}),
    ("bayesian, diagonal covariance", "bayesian", {"covariance": "diagonal"}),
    ("gated_deltanet", "gated_deltanet", {}),
    ("gated_deltanet_noconv", "gated_deltanet_noconv", {}),
    ("deltanet", "deltanet", {}),
    ("linear_attention", "linear_attention", {}),
    ("gla", "gla", {}),
    ("mamba2 (N = 128)", "mamba2", {}),
    ("attention", "attention", {}),
]


def describe(mixer) -> str:
    parts = []
    # Mamba-2's head_dim is its value width P; its keys (B_t) have the state size N
    head = "P" if hasattr(mixer, "state_size") else "D"
    for attr, label in (("head_dim", head), ("head_v_dim", "m"), ("state_size", "N"), ("groups", "G")):
        if hasattr(mixer, attr) and not (attr == "groups" and mixer.groups == 1):
            parts.append(f"{label}={getattr(mixer, attr)}")
    return ", ".join(parts)


def table(hidden: int, heads: int, head_dim: int) -> list[str]:
    lines = [
        f"hidden {hidden}, {heads} heads, head dim {head_dim} (other arguments at each mixer's defaults)",
        "",
        "| mixer | dims per head | parameters | params / hidden² | state floats / head "
        "| state / layer (fp32) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for label, name, extra in ROWS:
        assert name in MIXERS
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mixer = build_mixer(name, hidden, num_heads=heads, head_dim=head_dim, **extra)
        n = sum(p.numel() for p in mixer.parameters())
        per_head = mixer.state_size_per_head()
        if name == "attention":
            state, layer = f"{per_head:,} per token", f"{per_head * heads * 4 / 1024:.1f} KiB per token"
        else:
            state, layer = f"{per_head:,}", f"{per_head * heads * 4 / 1024:,.0f} KiB"
        lines.append(f"| {label} | {describe(mixer)} | {n:,} | {n / hidden**2:.2f} | {state} | {layer} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    print("\n".join(table(args.hidden, args.heads, args.head_dim)))


if __name__ == "__main__":
    main()
