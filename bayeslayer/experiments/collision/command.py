"""``bayeslayer collision``: the whole experiment as ``run(CollisionConfig) -> record`` and its command line."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ...training.lock import lock_output
from ..common.options import PLOT_ONLY_HELP, check_int, check_out_dir, plot_only_json, redrawing
from ..common.plotting import load_json
from ..common.provenance import write_record
from ..common.threads import SMALL, add_threads_option
from .figures import (
    MEANING,
    format_table,
    plot_collision,
)
from .lowrank import (
    LOWRANK_RANKS,
    MULTI_PAIRS,
    format_lowrank_table,
    plot_lowrank,
    run_lowrank,
    run_multi_pair,
)
from .protocol import (
    FIXED_PRIORS,
    MODELS,
    OVERLAP_RHOS,
    PAPER_CONFIG,
    check_nonempty,
    check_overlap,
    check_positive,
    chunk_agreement,
    prior_key,
    run_collision,
    run_extras,
)

DESCRIPTION = (
    "Write A..F twice, reinforce B 40×, then write the overlapping A 60×; read at B's key "
    "after every step.  Writes DIR/collision.json and PNG figures drawn from it."
)


# -- the whole experiment: config -> record -------------------------------------------------------
@dataclass(frozen=True)
class CollisionConfig:
    """What ``bayeslayer collision`` runs: the docs/theory.md §8.1 protocol at overlap ``rho`` with prior ``p0`` and
    noises ``r2``, ``ell2``; the sweeps (``fixed_priors``, ``overlap_rhos``, the low-rank ``lowrank_ranks``,
    the key-rotation ``rotation_seeds`` and the reinforcement lengths ``b_repeats`` of the write angle); and
    ``out``, the folder for the JSON files and figures (``None``: write nothing); ``progress``, a progress
    line on stderr, one tick per sweep.  The defaults are the paper's and the command's.  Every field is
    checked here, with its name in the error.
    """

    rho: float = PAPER_CONFIG["rho"]
    p0: float = PAPER_CONFIG["p0"]
    r2: float = PAPER_CONFIG["r2"]
    ell2: float = PAPER_CONFIG["ell2"]
    fixed_priors: tuple[float, ...] = FIXED_PRIORS
    overlap_rhos: tuple[float, ...] = OVERLAP_RHOS
    lowrank_ranks: tuple[int, ...] = LOWRANK_RANKS
    rotation_seeds: tuple[int, ...] = tuple(range(8))
    b_repeats: tuple[int, ...] = (40, 400, 4000)
    out: str | None = None
    progress: bool = False

    def __post_init__(self):
        check_overlap("rho", self.rho)
        for name in ("p0", "r2", "ell2"):
            check_positive(name, getattr(self, name))
        priors = tuple(check_positive("fixed_priors entry", c)
                       for c in check_nonempty("fixed_priors", self.fixed_priors))
        if len({prior_key(c) for c in priors}) != len(priors):
            raise ValueError(f"fixed_priors must be distinct, got {list(self.fixed_priors)}")
        for name, minimum in (("lowrank_ranks", 0), ("rotation_seeds", 0), ("b_repeats", 1)):
            values = check_nonempty(name, getattr(self, name))
            object.__setattr__(self, name, tuple(check_int(f"{name} entry", v, minimum=minimum) for v in values))
        object.__setattr__(self, "overlap_rhos", tuple(
            check_overlap("overlap_rhos entry", r) for r in check_nonempty("overlap_rhos", self.overlap_rhos)))
        object.__setattr__(self, "fixed_priors", tuple(self.fixed_priors))
        if self.out is not None and not isinstance(self.out, (str, os.PathLike)):
            raise TypeError(f"out must be a folder path or None, got {type(self.out).__name__}")

    def noise(self) -> dict:
        """``rho``, ``p0``, ``r2``, ``ell2`` as the keywords of the experiment's functions."""
        return {"rho": self.rho, "p0": self.p0, "r2": self.r2, "ell2": self.ell2}


def run(config: CollisionConfig) -> dict:
    """The whole experiment: ``{"collision": ..., "chunk_agreement": ..., "extra": ..., "lowrank": ...}``.

    ``collision`` is :func:`run_collision`'s dict (``collision.json``), ``chunk_agreement``
    :func:`chunk_agreement`'s, ``extra`` :func:`run_extras`'s (``collision_extra.json``) and ``lowrank``
    :func:`run_lowrank`'s with :func:`run_multi_pair`'s under ``multi_pair`` (``collision_lowrank.json``).
    With ``config.out`` the three JSON files and the figures are written there and ``figures`` lists them; the
    folder is locked for the call (:func:`~bayeslayer.training.lock.lock_output`).
    """
    if not isinstance(config, CollisionConfig):
        raise TypeError(f"config must be a CollisionConfig, got {type(config).__name__}")
    out_dir = check_out_dir(config.out, option="out") if config.out is not None else None
    with lock_output(out_dir):  # one writer per output folder
        return _run(config, out_dir)


def _run(config: CollisionConfig, out_dir: Path | None) -> dict:
    kw = config.noise()
    with _sweep_progress(len(MULTI_PAIRS) + 4, config.progress) as tick:
        tick("collision schedule and sweeps")
        results = run_collision(**kw, fixed_priors=config.fixed_priors, overlap_rhos=config.overlap_rhos)
        tick("oracle vs chunked path")
        record = {"collision": results, "chunk_agreement": chunk_agreement(**kw, overlap_rhos=config.overlap_rhos)}
        tick("write angle, rotated keys")
        record["extra"] = run_extras(**kw, b_repeats=config.b_repeats, seeds=config.rotation_seeds)
        tick("low-rank ranks")
        lowrank = run_lowrank(**kw, ranks=config.lowrank_ranks, seeds=config.rotation_seeds)
        tick(f"multi-pair n = {MULTI_PAIRS[0]}")
        lowrank["multi_pair"] = run_multi_pair(**kw, ranks=config.lowrank_ranks, seeds=config.rotation_seeds,
                                               on_pairs_done=lambda n: tick(f"multi-pair, n = {n} done"))
        record["lowrank"] = lowrank
    if out_dir is not None:
        seeds = list(config.rotation_seeds)
        write_record(out_dir / "collision.json", results, allow_nan=False)
        paths = plot_collision(results, out_dir)
        write_record(out_dir / "collision_extra.json", record["extra"], seeds=seeds, allow_nan=False)
        write_record(out_dir / "collision_lowrank.json", lowrank, seeds=seeds, allow_nan=False)
        paths += plot_lowrank(lowrank, out_dir)
        record["figures"] = [str(p) for p in paths]
    return record


class _sweep_progress:
    """``with _sweep_progress(total, on) as tick: tick(label)``: a tqdm line on stderr that counts finished
    sweeps and names the next; ``tick`` marks the one before it done.  Nothing is shown when ``on`` is false."""

    def __init__(self, total: int, on: bool):
        self.total, self.on, self.bar, self.started = total, on, None, False

    def __enter__(self):
        if self.on:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc="collision", unit="sweep", file=sys.stderr, leave=False,
                            bar_format="{desc}: {n}/{total} sweeps [{elapsed}] {postfix}")
        return self.tick

    def tick(self, label: str) -> None:
        if self.bar is None:
            return
        if self.started:
            self.bar.update(1)
        self.started = True
        self.bar.set_postfix_str(label)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
        return False


def config_from_args(args: argparse.Namespace) -> CollisionConfig:
    """The :class:`CollisionConfig` that ``bayeslayer collision`` arguments name (``--out`` checked first)."""
    out_dir = check_out_dir(args.out)
    return CollisionConfig(rho=args.rho, p0=args.p0, r2=args.r2, ell2=args.ell2, out=str(out_dir),
                           progress=not args.no_progress)


# -- command line ---------------------------------------------------------------------------------
def _redraw(out_dir: Path) -> int:
    """``collision --plot-only``: the figures and tables of ``out_dir``'s JSON files, drawn again."""
    results = plot_only_json(out_dir, "collision")
    with redrawing(out_dir / "collision.json"):
        paths = plot_collision(results, out_dir)
        print(format_table(results))
    lowrank_paths = []
    if (out_dir / "collision_lowrank.json").exists():
        lowrank = load_json(out_dir / "collision_lowrank.json")
        with redrawing(out_dir / "collision_lowrank.json"):
            lowrank_paths = plot_lowrank(lowrank, out_dir)
            print(format_lowrank_table(lowrank))
    print(
        f"\nRedrew {len(paths)} figures from {out_dir / 'collision.json'}: "
        + ", ".join(str(p) for p in paths)
    )
    if lowrank_paths:
        print(f"Redrew {len(lowrank_paths)} low-rank figures from {out_dir / 'collision_lowrank.json'}")
    return 0


def _main(args: argparse.Namespace) -> int:
    out_dir = check_out_dir(args.out)
    if args.plot_only:
        with lock_output(out_dir):  # a redraw writes into --out too: one writer per output folder
            return _redraw(out_dir)
    record = run(config_from_args(args))
    results, diffs, extras, lowrank = (record[k] for k in ("collision", "chunk_agreement", "extra", "lowrank"))
    print(format_table(results))
    print(
        "oracle vs chunked path, max |Δ| of readouts and gains: "
        + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items())
    )
    av, rot = extras["angle_vs_reinforcement"], extras["rotated_keys"]
    print(
        "write angle after n writes of B (deg): "
        + ", ".join(f"n={n}: {a:.2f}" for n, a in zip(av["b_repeats"], av["angle"], strict=True))
        + f"; limit arcsin ρ = {av['angle_limit']:.2f}"
    )
    print(
        f"keys turned by {len(rot['seeds'])} random rotations, final p^AB: "
        + ", ".join(f"{n} {min(rot[n]):.4f}..{max(rot[n]):.4f}" for n in MODELS)
    )
    print(format_lowrank_table(lowrank))
    paths = [Path(p) for p in record["figures"]]
    print(
        f"\nWrote {out_dir / 'collision.json'} (and collision_extra.json, collision_lowrank.json) and "
        f"{len(paths)} figures: " + ", ".join(p.name for p in paths) + f" in {out_dir}."
    )
    print(MEANING)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "collision",
        help="deterministic key-collision experiment (docs/theory.md §8.1): BL vs Delta, LA, diagonal; seconds",
        description=DESCRIPTION,
    )
    p.add_argument(
        "--out",
        default="runs/collision",
        metavar="DIR",
        help="folder for collision.json and the figures (default: runs/collision)",
    )
    p.add_argument("--plot-only", action="store_true", help=PLOT_ONLY_HELP)
    p.add_argument(
        "--rho", type=float, default=PAPER_CONFIG["rho"], help="key overlap k_Aᵀk_B (default 0.92)"
    )
    p.add_argument(
        "--p0", type=float, default=PAPER_CONFIG["p0"], help="prior variance P_0 = p0 I (default 3)"
    )
    p.add_argument("--r2", type=float, default=PAPER_CONFIG["r2"], help="observation noise r² (default 0.05)")
    p.add_argument("--ell2", type=float, default=PAPER_CONFIG["ell2"], help="process noise ℓ² (default 0.05)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    add_threads_option(p, SMALL)
    p.set_defaults(func=_main)
