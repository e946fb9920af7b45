"""The configuration of a language-model run: :class:`LMConfig` of a model, a text and a training part.

What ``lm train`` and ``distill train`` run, and what a run directory's ``config.json`` and
``final/lm_config.json`` hold (:meth:`LMConfig.to_json`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..checks import check_int
from ..layers import MIXER_LABELS
from .compute_match import check_mode
from .distributed import PRECISIONS
from .loop import TrainConfig


@dataclass(frozen=True)
class LMModelConfig:
    """The language model: a :class:`~bayeslayer.models.BayesLayerForCausalLM` of ``num_layers`` blocks."""

    mixer: str = "bayesian"
    hidden_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 128
    mixer_kwargs: dict = field(default_factory=dict)
    mlp_dropout: float = 0.4
    match: str = "params"  # MATCHES: what BL and the other mixers share at one head shape (state_matched_kwargs)

    def __post_init__(self):
        object.__setattr__(self, "mixer_kwargs", dict(self.mixer_kwargs or {}))
        from ..layers import MIXERS

        if self.mixer not in MIXERS:
            raise ValueError(f"mixer must be one of {sorted(MIXERS)}, got {self.mixer!r}")
        for name in ("hidden_size", "num_layers", "num_heads", "head_dim"):
            check_int(name, getattr(self, name), minimum=1)
        if self.match not in MATCHES:
            raise ValueError(f"match must be one of {MATCHES}, got {self.match!r}")
        if self.match == "state":
            object.__setattr__(self, "mixer_kwargs", _with_matched_state(self.mixer, self.num_heads, self.head_dim,
                                                                        self.mixer_kwargs))
        if not (isinstance(self.mlp_dropout, (int, float)) and 0.0 <= self.mlp_dropout < 1.0):
            raise ValueError(f"mlp_dropout must be a probability in [0, 1), got {self.mlp_dropout!r}")


#: ``--match``: ``params`` gives every mixer the preset's head shape (``num_heads`` heads of key dim
#: ``head_dim``, the mixer's own default value dim), so parameter counts are close and BL, which keeps a
#: covariance beside its mean, carries more state (1.5× Gated DeltaNet's); ``state`` sizes the mixer's
#: value dim with the state-budget solver so its recurrent state equals the default BL's at that head shape
#: (the paper's comparison: Gated DeltaNet's value dim widened to BL's mean plus covariance).
MATCHES = ("params", "state")


def state_budget_per_layer(num_heads: int, head_dim: int) -> int:
    """The recurrent state (floats per layer) of the default BL layer of ``num_heads`` heads of key dim
    ``head_dim``: the budget that ``--match state`` gives every mixer."""
    import inspect

    from ..layers import MIXERS
    from ..models.state_budget import mixer_design

    num_heads = check_int("num_heads", num_heads, minimum=1)
    head_dim = check_int("head_dim", head_dim, minimum=1)
    expand_v = inspect.signature(MIXERS["bayesian"]).parameters["expand_v"].default
    return num_heads * mixer_design("bayesian").state_size(head_dim, int(head_dim * expand_v), 1)


def state_matched_kwargs(mixer: str, num_heads: int, head_dim: int) -> dict:
    """Mixer keywords (``expand_v``) that give ``mixer``, at ``num_heads`` heads of key dim ``head_dim``, the
    recurrent state of the default BL layer of that shape, as the state-budget solver sizes it
    (:func:`~bayeslayer.models.state_budget.solve_state_budget` with ``num_heads`` fixed; its usage floor
    of 90% bounds the rounding).  Mixers the solver sizes by another rule (Mamba-2's ``d_state``) are refused."""
    from ..models.state_budget import BUDGET_MIXERS, budget_rule, solve_state_budget

    if mixer not in BUDGET_MIXERS or budget_rule(mixer) != "heads":
        sized = [m for m in BUDGET_MIXERS if budget_rule(m) == "heads"]
        raise ValueError(f"--match state sizes the value dim of {', '.join(sized)}; mixer {mixer!r} is not one")
    head = solve_state_budget(state_budget_per_layer(num_heads, head_dim), num_heads * head_dim, mixer,
                              num_heads=num_heads)
    return {"expand_v": head.value_dim / head.key_dim}


def _with_matched_state(mixer: str, num_heads: int, head_dim: int, kwargs: dict) -> dict:
    matched = state_matched_kwargs(mixer, num_heads, head_dim)
    clash = {k: v for k, v in matched.items() if k in kwargs and kwargs[k] != v}
    if clash:
        raise ValueError(f"--match state sets {matched} for mixer {mixer!r}; mixer_kwargs gives "
                         f"{ {k: kwargs[k] for k in clash} }: drop it or use --match params")
    return {**kwargs, **matched}


@dataclass(frozen=True)
class LMDataConfig:
    """The text: a corpus ``source``, its tokenizer (or the size of the BPE trained on it), window length."""

    source: str = "python-docs"
    tokenizer: str | None = None
    vocab_size: int = 8192  # of the BPE trained when no tokenizer is given
    seq_len: int = 2048

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"source must be a non-empty string, got {self.source!r}")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise TypeError(f"tokenizer must be a path string or None, got {type(self.tokenizer).__name__}")
        check_int("vocab_size", self.vocab_size, minimum=1)
        check_int("seq_len", self.seq_len, minimum=2)

#: The optimisation of an LM run unless told otherwise (``batch_size``: windows per step, all ranks).
LM_TRAIN = TrainConfig(steps=7935, batch_size=32, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8,
                       grad_clip=1.0, warmup_steps=400, min_lr_ratio=0.1, eval_every=500, checkpoint_every=250,
                       seed=0)

_PARTS = {"model": LMModelConfig, "data": LMDataConfig, "train": TrainConfig}

_PART_OF = {f.name: part for part, cls in _PARTS.items() for f in fields(cls)}

@dataclass(frozen=True, init=False)
class LMConfig:
    """Everything a language-model run depends on: ``LMConfig(model=LMModelConfig(...),
    data=LMDataConfig(...), train=TrainConfig(...), ...)``.

    ``train.batch_size`` is the *global* number of windows per optimiser step (tokens per step =
    ``batch_size · seq_len``); ``micro_batch_size`` windows go through one forward pass on one rank
    (the loop accumulates the rest).  ``eval_windows`` caps the validation windows of the periodic
    evaluation (0: all); the final evaluation always uses every window.  ``compute_match`` (``steps``,
    ``flops``, ``time``) says how ``train.steps`` was chosen (:mod:`~bayeslayer.training.compute_match`:
    to spend the reference BL run's FLOPs or CPU time).

    The parts' fields may also be given and read flat: ``LMConfig(mixer="mamba2", lr=1e-3)`` is
    ``LMConfig(model=LMModelConfig(mixer="mamba2"), train=replace(LM_TRAIN, lr=1e-3))`` (a flat field
    overrides the part it belongs to), ``config.lr`` is ``config.train.lr``, and
    ``dataclasses.replace(config, lr=...)`` works.  :meth:`to_json` is flat, the form every run directory's
    ``config.json`` and ``final/lm_config.json`` has always had, so older runs resume and load unchanged.
    """

    preset: str = "custom"
    label: str = ""  # the model's name in tables; "" = from the mixer (BL, GDN, ...)
    model: LMModelConfig = LMModelConfig()
    data: LMDataConfig = LMDataConfig()
    train: TrainConfig = LM_TRAIN
    micro_batch_size: int = 8
    precision: str = "auto"
    compute_match: str = "steps"  # compute_match.MODES: train.steps were set to the reference's FLOPs or time
    # bookkeeping (BOOKKEEPING): may change when a run is resumed, with train.eval_every/checkpoint_every
    eval_windows: int = 0
    eval_batch_size: int = 4
    log_every: int = 10

    def __init__(self, *, preset: str = "custom", label: str = "", model: LMModelConfig | None = None,
                 data: LMDataConfig | None = None, train: TrainConfig | None = None, micro_batch_size: int = 8,
                 precision: str = "auto", compute_match: str = "steps", eval_windows: int = 0,
                 eval_batch_size: int = 4, log_every: int = 10, **flat: Any) -> None:
        unknown = sorted(set(flat) - set(_PART_OF))
        if unknown:
            raise TypeError(f"LMConfig got unknown fields {unknown}")
        if "betas" in flat:  # JSON gives a list
            flat["betas"] = tuple(float(b) for b in flat["betas"])
        parts = {"model": LMModelConfig() if model is None else model,
                 "data": LMDataConfig() if data is None else data,
                 "train": LM_TRAIN if train is None else train}
        for name, cls in _PARTS.items():
            if not isinstance(parts[name], cls):
                raise TypeError(f"{name} must be a {cls.__name__}, got {type(parts[name]).__name__}")
            over = {k: v for k, v in flat.items() if _PART_OF[k] == name}
            if over:
                parts[name] = replace(parts[name], **over)
        for name, value in dict(preset=preset, label=label, **parts, micro_batch_size=micro_batch_size,
                                precision=precision, compute_match=compute_match, eval_windows=eval_windows,
                                eval_batch_size=eval_batch_size, log_every=log_every).items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self):
        for name in ("micro_batch_size", "eval_batch_size", "log_every"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("eval_windows", self.eval_windows, minimum=0)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        check_mode(self.compute_match)
        if not isinstance(self.label, str):
            raise TypeError(f"label must be a string, got {type(self.label).__name__}")
        if self.train.batch_size % self.micro_batch_size != 0:
            raise ValueError(f"batch_size ({self.train.batch_size}) must be a multiple of micro_batch_size "
                             f"({self.micro_batch_size})")

    def __getattr__(self, name: str) -> Any:
        """A part's field read flat: ``config.lr`` is ``config.train.lr`` (see the class docstring)."""
        part = _PART_OF.get(name)
        if part is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, part), name)

    def train_config(self) -> TrainConfig:
        """The optimiser/schedule part (:attr:`train`), as the one training loop takes it."""
        return self.train

    @property
    def model_label(self) -> str:
        label = self.label or MIXER_LABELS.get(self.model.mixer, self.model.mixer)
        return f"{label} (state-matched)" if self.model.match == "state" and not self.label else label

    @property
    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.data.seq_len

    def to_json(self) -> dict:
        """The flat form (every field of every part at the top level), as ``config.json`` stores it."""
        flat = {"preset": self.preset, "label": self.label}
        for part in _PARTS:
            flat.update(asdict(getattr(self, part)))
        if flat["match"] == "params":
            del flat["match"]  # the default is not written: parameter-matched runs keep the config.json they had
        flat.update(micro_batch_size=self.micro_batch_size, precision=self.precision,
                    eval_windows=self.eval_windows, eval_batch_size=self.eval_batch_size, log_every=self.log_every)
        if self.compute_match != "steps":  # the default is not written: step-matched runs keep their config.json
            flat["compute_match"] = self.compute_match
        return json.loads(json.dumps(flat))

    @classmethod
    def from_json(cls, obj: dict) -> LMConfig:
        """Read :meth:`to_json`'s flat form (every saved run's ``config.json`` and ``lm_config.json``)."""
        if not isinstance(obj, dict):
            raise TypeError(f"an LMConfig is read from a JSON object, got {type(obj).__name__}")
        obj = {k: v for k, v in obj.items() if k != "provenance"}  # a run directory's config.json records it
        known = set(_PART_OF) | {f.name for f in fields(cls)} - set(_PARTS)
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ValueError(f"unknown LMConfig fields {unknown}")
        return cls(**obj)


#: Fields that may change when a run is resumed: they never change the loss trajectory.
BOOKKEEPING = frozenset({"eval_every", "eval_windows", "eval_batch_size", "checkpoint_every", "log_every"})


def check_resume_config(saved: dict, config: LMConfig, where: str | os.PathLike) -> None:
    """Refuse to resume the run in ``where``, whose saved configuration (:meth:`LMConfig.to_json`, with or without
    its provenance) is ``saved``, with ``config`` when they differ in anything but :data:`BOOKKEEPING`."""
    current = config.to_json()
    saved = {k: v for k, v in saved.items() if k != "provenance"}  # who started the run, not what it is
    diff = sorted(k for k in set(saved) | set(current) if k not in BOOKKEEPING and saved.get(k) != current.get(k))
    if diff:
        detail = ", ".join(f"{k}: {saved.get(k)!r} → {current.get(k)!r}" for k in diff)
        raise ValueError(f"{where} holds a run with a different configuration ({detail}); use another --out "
                         "or the same settings")


__all__ = ["BOOKKEEPING", "LM_TRAIN", "MATCHES", "LMConfig", "LMDataConfig", "LMModelConfig", "check_resume_config",
           "state_budget_per_layer", "state_matched_kwargs"]
