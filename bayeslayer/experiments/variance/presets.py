"""The ``variance`` command's presets: each one's training budget and test-set sizes, what each cost when it
was timed (:data:`MEASURED`), and the ``--preset`` help and smoke-test note drawn from them."""

from __future__ import annotations

from dataclasses import dataclass

from ..common import mqar_setup, recall_task


@dataclass(frozen=True)
class VariancePreset:
    """Training budget and test-set sizes.  ``recall_steps``/``mqar_steps``: ``None`` keeps the source
    preset's own budget (recall ``long``: 1,800 steps; MQAR ``default`` Update: its epochs)."""

    name: str
    seeds: int
    recall_steps: int | None
    mqar_steps: int | None
    recall_test_n_f: tuple[int, ...]
    recall_sequences: int  # per n_f, 8 queries each
    mqar_test_updates: tuple[int, ...]
    mqar_examples: int  # per update count, 16 queries each
    recall_preset: str = "long"
    mqar_preset: str = "default"
    eval_seed: int = 4242
    smoke_test: bool = False  # too small to mean anything: the output and the record say so


def recall_queries(preset: VariancePreset) -> int:
    """Recall queries scored per seed: ``len(recall_test_n_f) × recall_sequences × num_pairs``."""
    return len(preset.recall_test_n_f) * preset.recall_sequences * recall_task.PRESETS[preset.recall_preset].num_pairs


def mqar_queries(preset: VariancePreset) -> int:
    """MQAR Update queries scored per seed: ``len(mqar_test_updates) × mqar_examples × update_test_pairs``."""
    return (len(preset.mqar_test_updates) * preset.mqar_examples
            * mqar_setup.PRESETS[preset.mqar_preset].update_test_pairs)


PRESETS = {
    # Sized so that both tasks and all seeds fit in about 15 minutes on a shared 2-core CPU.
    "default": VariancePreset("default", seeds=3, recall_steps=200, mqar_steps=300,
                              recall_test_n_f=(1, 4, 16, 64, 128), recall_sequences=64,
                              mqar_test_updates=(0, 4, 8, 12, 16), mqar_examples=64),
    # The source experiments' full budgets (recall "long", MQAR Update "default" epochs).
    "full": VariancePreset("full", seeds=3, recall_steps=None, mqar_steps=None,
                           recall_test_n_f=(1, 4, 16, 64, 128, 256), recall_sequences=128,
                           mqar_test_updates=(0, 2, 4, 8, 12, 16), mqar_examples=256),
    # Seconds-long smoke run (tests, trying the command out): untrained models, numbers without meaning.
    "tiny": VariancePreset("tiny", seeds=2, recall_steps=4, mqar_steps=4, recall_test_n_f=(1, 8),
                           recall_sequences=8, mqar_test_updates=(0, 4), mqar_examples=8,
                           recall_preset="tiny", mqar_preset="tiny", smoke_test=True),
}

#: What each preset's whole command cost with one thread (``bayeslayer variance --preset P --threads 1``), from
#: the committed record results/variance/presets.json (``python benchmarks/variance_presets.py --out ...``):
#: ``cpu_seconds`` (the process's CPU time: about the wall time on an idle machine), ``wall_seconds`` and the
#: 1-minute load average over the run on the shared 2-core CPU that measured them.  ``variance --help`` shows
#: them; tests/experiments/test_variance.py checks them against the record.  ``None``: not timed yet (the record
#: has no row for the preset; ``--help`` says so rather than guess).
MEASURED: dict[str, dict | None] = {
    "tiny": {"cpu_seconds": 8, "wall_seconds": 55, "load": "6–7"},
    "default": {"cpu_seconds": 243, "wall_seconds": 1899, "load": "6–7"},
    "full": None,
}
MEASURED_RECORD = "results/variance/presets.json"


def smoke_note(preset: VariancePreset) -> str | None:
    """The warning a smoke-test preset's output and record carry; ``None`` for the others."""
    if not preset.smoke_test:
        return None
    return (f"preset '{preset.name}' is a smoke test (a few training steps, untrained models): it checks that "
            "the command runs, and its accuracies and AUROCs mean nothing; use the default preset for results")


def duration(seconds: float) -> str:
    """``"7 s"``, ``"21 min"``, ``"2.5 h"``: a measured time as ``--help`` prints it."""
    return f"{seconds:.0f} s" if seconds < 100 else f"{seconds / 60:.0f} min" if seconds < 6000 else \
        f"{seconds / 3600:.1f} h"


def preset_help() -> str:
    """``--preset``'s help: each preset's seeds, training steps, scored queries and measured time."""
    parts = []
    timed = sorted((n for n in PRESETS if MEASURED[n]), key=lambda n: MEASURED[n]["cpu_seconds"])
    for name in timed + [n for n in PRESETS if not MEASURED[n]]:
        p = PRESETS[name]
        recall_steps = p.recall_steps if p.recall_steps is not None else recall_task.PRESETS[p.recall_preset].steps
        mqar_steps = (f"{p.mqar_steps:,}" if p.mqar_steps is not None
                      else f"{mqar_setup.PRESETS[p.mqar_preset].epochs} epochs")
        took = MEASURED[name]
        kind = " (a smoke test: its numbers mean nothing)" if p.smoke_test else ""
        cost = (f"≈ {duration(took['cpu_seconds'])} ({duration(took['wall_seconds'])} at load {took['load']})"
                if took else "not timed yet")
        parts.append(f"'{name}'{kind}: {p.seeds} seeds; training steps recall {recall_steps:,}, MQAR Update "
                     f"{mqar_steps}; {recall_queries(p):,} + {mqar_queries(p):,} scored queries per seed; {cost}")
    return ("the run's size (default: default). " + ". ".join(parts) + ". Times: the whole command with one "
            "thread, as CPU time (about the wall time on an idle machine) and in brackets the wall time measured "
            f"on a shared 2-core CPU ({MEASURED_RECORD})")
