"""``bayeslayer distill``'s configuration: :class:`DistillConfig`, its presets, and what each stage of the retrofit
trains (:func:`stage_objective`, an objective of :mod:`bayeslayer.training.distillation`) with which LM run
configuration (:func:`stage_config`)."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ...checks import check_int
from ...training.distillation import MLP_LR_SCALE, PAPER_LAYERS, RetrofitObjective, check_retrofit
from ...training.distributed import PRECISIONS
from ...training.lm_config import LM_TRAIN, LMConfig, LMDataConfig, LMModelConfig

STAGE_LABELS = {"phase_a": "BL (Phase A)", "phase_b": "BL", "gdn_ft": "GDN-FT"}


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class DistillConfig:
    """One retrofit: teacher, swapped layers, data, the two phases and the control.

    ``phase_a_steps``/``phase_b_steps`` optimiser steps of ``batch_size`` windows of ``seq_len``
    tokens (global, over all ranks); the control runs ``phase_a_steps + phase_b_steps`` steps of
    the same size (the same tokens).  ``lr_a`` trains Phase A, ``lr_b`` Phase B and the control.
    """

    preset: str = "custom"
    teacher: str = ""
    layers: tuple[int, ...] = PAPER_LAYERS
    mixer_kwargs: dict = field(default_factory=dict)
    source: str = "python-docs"
    tokenizer: str | None = None  # default: the teacher's tokenizer.json
    seq_len: int = 2048
    batch_size: int = 32
    micro_batch_size: int = 4
    phase_a_steps: int = 1526
    phase_b_steps: int = 4578
    lr_a: float = 1e-3
    lr_b: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.0
    mlp_parts: tuple[str, ...] = ()
    mlp_lr_scale: float = MLP_LR_SCALE
    switch_fraction: float = 0.5
    temperature: float = 1.0
    precision: str = "auto"
    eval_every: int = 500
    eval_windows: int = 16
    checkpoint_every: int = 250
    log_every: int = 10
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "mlp_parts", tuple(self.mlp_parts))
        object.__setattr__(self, "mixer_kwargs", dict(self.mixer_kwargs or {}))
        if not isinstance(self.teacher, str):
            raise TypeError(f"teacher must be a path or hub id string, got {type(self.teacher).__name__}")
        check_retrofit(self.layers, self.mlp_parts)
        check_int("seq_len", self.seq_len, minimum=2)
        for name in ("batch_size", "micro_batch_size", "phase_a_steps", "phase_b_steps", "log_every"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("warmup_steps", "eval_every", "eval_windows", "checkpoint_every"):
            check_int(name, getattr(self, name), minimum=0)
        for name, positive in (("lr_a", True), ("lr_b", True), ("mlp_lr_scale", True), ("temperature", True),
                               ("weight_decay", False)):
            v = getattr(self, name)
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or (v <= 0 if positive else v < 0):
                raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}")
        if not (isinstance(self.switch_fraction, numbers.Real) and 0.0 <= self.switch_fraction <= 1.0):
            raise ValueError(f"switch_fraction must be in [0, 1], got {self.switch_fraction!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size "
                             f"({self.micro_batch_size})")

    @property
    def switch_step(self) -> int:
        """First Phase B step with weights (0.9, 0.1)."""
        return int(round(self.switch_fraction * self.phase_b_steps))

    @property
    def tokens(self) -> dict[str, int]:
        per_step = self.batch_size * self.seq_len
        return {"phase_a": self.phase_a_steps * per_step, "phase_b": self.phase_b_steps * per_step,
                "gdn_ft": (self.phase_a_steps + self.phase_b_steps) * per_step}

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, obj: dict) -> DistillConfig:
        unknown = sorted(set(obj) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown DistillConfig fields {unknown}")
        return cls(**obj)


PRESETS: dict[str, DistillConfig] = {
    # docs/theory.md §8.6: 340M GDN teacher, layers {5, 11, 17, 23}, SlimPajama, length 2,048, Phase A ≈100M
    # tokens (1,526 steps × 65,536), Phase B ≈300M (4,578 steps), one seed.  Our choices (not in the
    # paper): the 6B-token SlimPajama sample on the hub, batch 32 × 2,048, lr 1e-3 (A) / 1e-4 (B and
    # GDN-FT), 100 warm-up steps, the MLPs' down_proj at 0.1× lr, switch halfway through Phase B.
    "paper": DistillConfig(preset="paper", teacher="linear-moe-hub/Gated-Deltanet-340M", layers=PAPER_LAYERS,
                           source="hf:DKYoon/SlimPajama-6B", seq_len=2048, batch_size=32, micro_batch_size=4,
                           phase_a_steps=1526, phase_b_steps=4578, lr_a=1e-3, lr_b=1e-4, warmup_steps=100,
                           mlp_parts=("down_proj",), eval_every=500, eval_windows=16, checkpoint_every=250),
    # A pipeline check on the 2-core CPU: a 4-layer teacher from `bayeslayer lm train --preset cpu
    # --mixer gated_deltanet` (pass --teacher), layers 1 and 3 swapped, windows of 512 tokens.
    "cpu": DistillConfig(preset="cpu", teacher="runs/lm/cpu-gated_deltanet-seed0/final", layers=(1, 3),
                         source="python-docs", seq_len=512, batch_size=8, micro_batch_size=4, phase_a_steps=40,
                         phase_b_steps=80, lr_a=1e-3, lr_b=3e-4, warmup_steps=5, mlp_parts=("down_proj",),
                         eval_every=40, eval_windows=8, checkpoint_every=20),
    # A smoke test: seconds.
    "tiny": DistillConfig(preset="tiny", teacher="", layers=(1,), source="python-docs", seq_len=64,
                          batch_size=4, micro_batch_size=2, phase_a_steps=4, phase_b_steps=4, lr_a=1e-3,
                          lr_b=1e-3, warmup_steps=1, mlp_parts=("down_proj",), eval_every=0, eval_windows=4,
                          checkpoint_every=2, log_every=1),
}

PRESET_HELP = (  # bayeslayer distill train --preset
    "'paper' = the paper's settings (docs/theory.md §8.6; 340M teacher, ≈100M + 300M tokens); "
    "'cpu' = a pipeline check with a "
    "teacher from `lm train --preset cpu --mixer gated_deltanet`; 'tiny' = smoke test"
)


# --------------------------------------------------------------------------- the stages


def stage_objective(config: DistillConfig, stage: str, teacher_dir: Path, init_dir: Path | None = None
                    ) -> RetrofitObjective:
    """The :class:`~bayeslayer.training.distillation.RetrofitObjective` of one stage of ``config``."""
    return RetrofitObjective(stage, teacher_dir, init_dir, teacher=config.teacher, layers=config.layers,
                             mixer_kwargs=config.mixer_kwargs, mlp_parts=config.mlp_parts,
                             mlp_lr_scale=config.mlp_lr_scale, switch_step=config.switch_step,
                             temperature=config.temperature)


def stage_config(config: DistillConfig, stage: str, teacher: Any, tokenizer: str) -> LMConfig:
    """The :class:`LMConfig` of one stage: the shared loop's data, schedule and bookkeeping."""
    steps = {"phase_a": config.phase_a_steps, "phase_b": config.phase_b_steps,
             "gdn_ft": config.phase_a_steps + config.phase_b_steps}[stage]
    lr = config.lr_a if stage == "phase_a" else config.lr_b
    return LMConfig(
        preset=f"distill-{config.preset}", label=STAGE_LABELS[stage],
        model=LMModelConfig(mixer="gated_deltanet" if stage == "gdn_ft" else "bayesian",
                            hidden_size=teacher.hidden_size, num_layers=teacher.num_hidden_layers,
                            num_heads=teacher.num_heads, head_dim=teacher.head_dim, mlp_dropout=0.0),
        data=LMDataConfig(source=config.source, tokenizer=tokenizer, vocab_size=teacher.vocab_size,
                          seq_len=config.seq_len),
        train=replace(LM_TRAIN, steps=steps, batch_size=config.batch_size, lr=lr, weight_decay=config.weight_decay,
                      warmup_steps=min(config.warmup_steps, steps), min_lr_ratio=0.1, eval_every=config.eval_every,
                      checkpoint_every=config.checkpoint_every, seed=config.seed),
        micro_batch_size=config.micro_batch_size, precision=config.precision, eval_windows=config.eval_windows,
        eval_batch_size=config.micro_batch_size, log_every=config.log_every)


__all__ = ["PRESETS", "PRESET_HELP", "STAGE_LABELS", "DistillConfig", "stage_config", "stage_objective"]
