"""``bayeslayer lm``: from-scratch language modelling with AR-hit evaluation (docs/theory.md §8.5).

``bayeslayer lm train`` trains a :class:`~bayeslayer.models.BayesLayerForCausalLM` (any mixer of
:data:`bayeslayer.layers.MIXERS`) on packed windows of a text corpus (:mod:`bayeslayer.data.text`);
``bayeslayer lm eval`` measures perplexity over all tokens, AR-hit tokens, the other tokens and
AR-hit tokens per distance bucket (:mod:`bayeslayer.data.arhit`), mean ± std over seeds, and
writes a Table-2-layout markdown table and a bar plot, both drawn from the saved JSON.

Training (one optimiser step):

* the global batch is ``batch_size`` windows of ``seq_len`` tokens; with ``W`` ranks each rank
  runs ``batch_size / (W · micro_batch_size)`` micro-batches and accumulates gradients (DDP
  synchronises only on the last one), so the update does not depend on ``W``;
* loss ``L = mean_t CE(logits_t, x_{t+1})`` over the ``seq_len − 1`` predictions of each window;
* AdamW, learning rate ``lr · s(step)`` with the harness's warmup + cosine factor
  (:func:`bayeslayer.training.loop.lr_lambda`), global-norm gradient clipping — the package's one
  loop, :func:`bayeslayer.training.loop.train_loop`;
* bf16 autocast where asked (``precision="auto"``: bf16 on a CUDA device that supports it, else
  fp32); the filters compute in fp32 whatever the input dtype.

Data position: window order is a fixed permutation of the train windows per epoch, drawn from
``(seed, epoch)``; the step-``s`` batch is the global sample indices ``[s·B, (s+1)·B)`` of that
sequence, so the data position is a pure function of the step and a resumed run reads exactly the
windows an uninterrupted one would.

Run directory (``--out``)::

    .lock                            held while a run uses the folder (a second run is refused)
    config.json                      the LMConfig (a resume must match it), written once the
                                     corpus has loaded and the model was built
    log.jsonl                        one JSON object per logged step / evaluation
    checkpoints/latest               name of the newest complete checkpoint
    checkpoints/step-00000100/       HF model dir (config.json, model.safetensors), trainer_state.json
                                     + trainer_state.safetensors, manifest.json (SHA-256 of each)
    final/                           HF model dir of the finished model (from_pretrained-able)
    train_summary.json               steps, tokens, tokens/s, final validation PPL by group

Checkpoints are :class:`bayeslayer.training.CheckpointStore` folders: written into a temporary
directory, fsynced, renamed into place and only then named in ``checkpoints/latest``, so a run
killed at any moment resumes from the last complete one; each file's SHA-256 is checked on load
(a damaged checkpoint is named, and an older one used when it exists).  A checkpoint holds the
model (safetensors), optimizer and scheduler states, step, loss history and every rank's RNG
states (JSON + safetensors, no pickle), so a resumed run continues the same loss trajectory bit
for bit on the same machine and world size; the log is cut back to the checkpoint's step, so no
step appears in it twice.  Ctrl-C stops after the current step with a checkpoint
(:class:`bayeslayer.training.TrainingInterrupted`).

Distributed: launch with ``torchrun --nproc_per_node N -m bayeslayer.cli lm train ...``; the
``gloo`` backend is used on CPU, ``nccl`` on CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..checks import check_int
from ..data.text.sources import SOURCE_HELP, WIKITEXT_103
from ..errors import UsageError
from ..training import (
    CheckpointStore,
    OutputLock,
    atomic_write_text,
    read_json,
    remove_stale_temporaries,
    save_state,
)
from ..training.distributed import PRECISIONS, DistContext, autocast, resolve_precision
from ..training.distributed import init_distributed as _init_distributed
from ..training.files import append_text, publish_directory, sha256_file
from ..training.loop import Checkpoints, LoopState, StepInfo, train_loop
from ..training.optim import DECAY_POLICY
from ..training.state import read_safetensors, write_safetensors
from .cli_checks import (
    DEVICE_HELP,
    PLOT_ONLY_HELP,
    cache_dir_arg,
    check_file_name,
    check_in_dir,
    check_memory,
    check_out_dir,
    check_source,
    check_tokenizer,
    device_arg,
    int_arg,
    plot_only_json,
    positive_int_arg,
    redrawing,
    resolve_device,
)
from .cli_help import override_help, preset_values
from .harness import TrainConfig, results_record, seed_everything, summarize, weights_digest
from .plotting import save_figure
from .provenance import write_record
from .threads import SMALL, TORCH_DEFAULT, add_threads_option

# Table-2 columns, then the distance buckets, in the order of :meth:`ARHitAnnotation.masks`.
GROUPS = ("all", "ar_hit", "other", "ar_hit_1_64", "ar_hit_65_256", "ar_hit_257_1024")
GROUP_LABELS = {"all": "all", "ar_hit": "AR-hit", "other": "other", "ar_hit_1_64": "AR-hit 1–64",
                "ar_hit_65_256": "AR-hit 65–256", "ar_hit_257_1024": "AR-hit 257–1,024"}
MODEL_LABELS = {"bayesian": "BL", "gated_deltanet": "GDN", "gated_deltanet_noconv": "GDN (no conv)",
                "deltanet": "DeltaNet", "linear_attention": "LA", "gla": "GLA", "mamba2": "Mamba-2",
                "attention": "Attention"}
# the paper's Table 2, docs/theory.md §8.5 (mean ± std over 3 seeds, WikiText-103 test, 32k BPE).
PAPER_TABLE2 = {
    "BL": {"all": (20.01, 0.15), "ar_hit": (18.15, 1.08), "other": (20.03, 0.15)},
    "GDN": {"all": (18.75, 0.07), "ar_hit": (23.72, 1.76), "other": (18.69, 0.08)},
    "Mamba-2": {"all": (21.36, 0.27), "ar_hit": (424.8, 120.4), "other": (20.58, 0.19)},
}
# Fields that may change when a run is resumed: they never change the loss trajectory.
_BOOKKEEPING = frozenset({"eval_every", "eval_windows", "eval_batch_size", "checkpoint_every", "log_every"})


# --------------------------------------------------------------------------- configuration



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
    from .state_budget import mixer_design

    num_heads = check_int("num_heads", num_heads, minimum=1)
    head_dim = check_int("head_dim", head_dim, minimum=1)
    expand_v = inspect.signature(MIXERS["bayesian"]).parameters["expand_v"].default
    return num_heads * mixer_design("bayesian").state_size(head_dim, int(head_dim * expand_v), 1)


def state_matched_kwargs(mixer: str, num_heads: int, head_dim: int) -> dict:
    """Mixer keywords (``expand_v``) that give ``mixer``, at ``num_heads`` heads of key dim ``head_dim``, the
    recurrent state of the default BL layer of that shape, as the state-budget solver sizes it
    (:func:`~bayeslayer.experiments.state_budget.solve_state_budget` with ``num_heads`` fixed; its usage floor
    of 90% bounds the rounding).  Mixers the solver sizes by another rule (Mamba-2's ``d_state``) are refused."""
    from .state_budget import BUDGET_MIXERS, SSD_MIXERS, solve_state_budget

    if mixer not in BUDGET_MIXERS or mixer in SSD_MIXERS:
        sized = [m for m in BUDGET_MIXERS if m not in SSD_MIXERS]
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
    evaluation (0: all); the final evaluation always uses every window.

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
    # bookkeeping: may change when a run is resumed (see _BOOKKEEPING), with train.eval_every/checkpoint_every
    eval_windows: int = 0
    eval_batch_size: int = 4
    log_every: int = 10

    def __init__(self, *, preset: str = "custom", label: str = "", model: LMModelConfig | None = None,
                 data: LMDataConfig | None = None, train: TrainConfig | None = None, micro_batch_size: int = 8,
                 precision: str = "auto", eval_windows: int = 0, eval_batch_size: int = 4, log_every: int = 10,
                 **flat: Any) -> None:
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
                                precision=precision, eval_windows=eval_windows, eval_batch_size=eval_batch_size,
                                log_every=log_every).items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self):
        for name in ("micro_batch_size", "eval_batch_size", "log_every"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("eval_windows", self.eval_windows, minimum=0)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
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
        label = self.label or MODEL_LABELS.get(self.model.mixer, self.model.mixer)
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


PRESETS: dict[str, LMConfig] = {
    # docs/theory.md §8.5: width 512, 4 layers, 4 heads × 128, 7,935 steps × 65,536 tokens (520M), length
    # 2,048, lr 6e-4, MLP dropout 0.4, WikiText-103 with a 32k BPE.  Betas, weight decay, warmup
    # and the final lr ratio are not in the paper: flash-linear-attention's usual values (LM_TRAIN).
    "paper": LMConfig(preset="paper",
                      model=LMModelConfig(hidden_size=512, num_layers=4, num_heads=4, head_dim=128, mlp_dropout=0.4),
                      data=LMDataConfig(source=WIKITEXT_103, vocab_size=32000, seq_len=2048),
                      train=replace(LM_TRAIN, steps=7935, batch_size=32, lr=6e-4, warmup_steps=400, eval_every=500,
                                    checkpoint_every=250),
                      micro_batch_size=8, eval_windows=64),
    # Sized from tokens/s measured on the 2-core CPU (docs/experiments.md, lm section): about
    # 30 minutes each for BL and GDN on an idle machine, ~1 epoch of the python3-doc corpus
    # (1.79M train tokens with the 8k BPE).  Length 1,024 covers every AR-hit distance bucket.
    "cpu": LMConfig(preset="cpu",
                    model=LMModelConfig(hidden_size=256, num_layers=4, num_heads=4, head_dim=64, mlp_dropout=0.1),
                    data=LMDataConfig(source="python-docs", vocab_size=8192, seq_len=1024),
                    train=replace(LM_TRAIN, steps=200, batch_size=8, lr=1e-3, warmup_steps=20, eval_every=50,
                                  checkpoint_every=25),
                    micro_batch_size=4, eval_windows=16),
    # A smoke test: seconds on any machine, on the corpus every Python installation has.
    "tiny": LMConfig(preset="tiny",
                     model=LMModelConfig(hidden_size=64, num_layers=2, num_heads=2, head_dim=16, mlp_dropout=0.0),
                     data=LMDataConfig(source="python-docstrings", vocab_size=8192, seq_len=128),
                     train=replace(LM_TRAIN, steps=20, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=10,
                                   checkpoint_every=10),
                     micro_batch_size=2, eval_windows=4, log_every=5),
}


# --------------------------------------------------------------------------- distributed context


SINGLE_PROCESS = DistContext()  # the default context: one process on the CPU


def init_distributed(device: str | torch.device = "auto") -> DistContext:
    """Join the ``torchrun`` job (if any) on ``device``: ``auto`` (``cuda:LOCAL_RANK`` when available, else
    CPU), ``cpu``, ``cuda``, ``cuda:0``, ... (:func:`bayeslayer.training.distributed.init_distributed`)."""
    return _init_distributed(resolve_device(device))  # "cuda" -> cuda:LOCAL_RANK; refuses a missing GPU


# --------------------------------------------------------------------------- data


def load_corpus(config: LMConfig, ctx: DistContext = SINGLE_PROCESS, *, cache_dir: str | None = None,
                splits: Sequence[str] = ("train", "validation", "test")):
    """The run's tokenized corpus; rank 0 tokenizes (or finds the cache) first, then every rank reads it."""
    from ..data.text import load_text_corpus

    def load():
        return load_text_corpus(config.source, tokenizer=config.tokenizer, vocab_size=config.vocab_size,
                                cache_dir=cache_dir, splits=splits)

    if ctx.distributed:
        if ctx.is_main:
            load()
        ctx.barrier()
    return load()


def epoch_permutation(n_windows: int, seed: int, epoch: int) -> np.ndarray:
    """The window order of one epoch: a permutation of ``range(n_windows)`` drawn from ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch, 0x4C4D]).permutation(n_windows)


class WindowSchedule:
    """Which train windows each optimiser step reads: a pure function of ``(seed, step)``.

    Global sample ``g = step · batch_size + i`` is window ``perm_e[g mod N]`` of epoch
    ``e = g div N``.  Rank ``r`` of ``W`` takes the ``r``-th contiguous ``batch_size / W`` share.
    """

    def __init__(self, n_windows: int, batch_size: int, seed: int) -> None:
        if n_windows < 1:
            raise ValueError("the train split has no complete window; use a shorter seq_len or more text")
        self.n_windows, self.batch_size, self.seed = n_windows, batch_size, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: epoch_permutation(self.n_windows, self.seed, epoch)}  # keep one epoch
        return self._perms[epoch]

    def step_windows(self, step: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        share = self.batch_size // world_size
        g = step * self.batch_size + rank * share + np.arange(share)
        out = np.empty(share, dtype=np.int64)
        for epoch in np.unique(g // self.n_windows):
            sel = g // self.n_windows == epoch
            out[sel] = self._perm(int(epoch))[g[sel] % self.n_windows]
        return out


# --------------------------------------------------------------------------- model


def build_model(config: LMConfig, vocab_size: int, eos_id: int | None = None):
    """A freshly initialised :class:`BayesLayerForCausalLM` for ``config`` (seed torch first)."""
    from ..models import BayesLayerConfig, BayesLayerForCausalLM

    mixer_kwargs = {config.mixer: dict(config.mixer_kwargs)} if config.mixer_kwargs else None
    model_config = BayesLayerConfig(
        vocab_size=vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_heads=config.num_heads, head_dim=config.head_dim, mixer=config.mixer, mixer_kwargs=mixer_kwargs,
        mlp_dropout=config.mlp_dropout, bos_token_id=None, eos_token_id=eos_id, pad_token_id=None,
        use_cache=False,
    )
    return BayesLayerForCausalLM(model_config)


def token_cross_entropy(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Per-token CE ``[b, L−1]`` (fp32) of predicting ``input_ids[:, 1:]`` from the prefix."""
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten(),
                           reduction="none").view(input_ids.shape[0], -1)


class NextTokenTrainee(torch.nn.Module):
    """Wraps a causal LM so that ``forward(input_ids)`` is the training loss (what DDP wraps).

    ``loss = mean_t CE(logits_t, x_{t+1})``; ``.model`` is the part that is checkpointed.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


class Objective:
    """What a run trains: :func:`train_lm`'s loop is the same for every objective.

    An objective builds the *trainee*, an ``nn.Module`` whose ``forward(input_ids [b, L])``
    returns the loss (or ``(loss, {name: float})`` with parts to log) and whose ``.model``
    is the causal LM that is checkpointed, evaluated and saved in ``final/``; it names the
    optimiser's parameter groups; it may check the trained model at the end
    (:meth:`finish`).  This default is from-scratch next-token training of
    :func:`build_model`; :mod:`bayeslayer.experiments.distill` adds the retrofit's Phase A,
    Phase B and the GDN-FT control.  A trainee with ``set_step(step)`` is told the step
    before each optimiser step (schedules inside the loss).
    """

    name = "next_token"
    #: DDP must look for parameters the loss does not reach (e.g. frozen paths).
    find_unused_parameters = False

    def describe(self) -> dict:
        """What the objective depends on; stored in ``objective.json`` and checked on resume."""
        return {"name": self.name}

    def build(self, config: LMConfig, corpus, device: torch.device) -> torch.nn.Module:
        return NextTokenTrainee(build_model(config, corpus.vocab_size, corpus.eos_id).to(device))

    def param_groups(self, trainee: torch.nn.Module, config: LMConfig) -> list[dict]:
        return [{"params": [p for p in trainee.model.parameters() if p.requires_grad]}]

    def finish(self, trainee: torch.nn.Module) -> dict:
        """Checks of the trained model (raise on failure) and facts for ``train_summary.json``."""
        return {}


# --------------------------------------------------------------------------- evaluation


def grouped_perplexity(model, windows: np.ndarray, masks: dict[str, np.ndarray], *, batch_size: int = 4,
                       ctx: DistContext = SINGLE_PROCESS, precision: str = "fp32") -> dict[str, dict]:
    """PPL ``exp(Σ ce·mask / Σ mask)`` per group over packed ``windows [N, L]`` (docs/theory.md §8.5).

    ``masks``: group → boolean ``[N, L−1]`` aligned with the next-token loss
    (``annotation.masks(shifted=True)``).  Windows are shared out across ranks (``rank::world``)
    and the float64 sums all-reduced, so every rank returns the same numbers.  The model runs in
    eval mode under ``torch.no_grad``; its previous mode is restored.  Returns
    ``{group: {"ppl", "mean_ce", "n_tokens"}}``; a group with no token has ``ppl = mean_ce = None``.
    """
    from ..data.arhit import GroupedCE

    if not isinstance(windows, np.ndarray) or windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be a numpy array [N, L >= 2], got {getattr(windows, 'shape', windows)}")
    if not masks:
        raise ValueError("masks must name at least one group")
    for name, mask in masks.items():
        if tuple(mask.shape) != (windows.shape[0], windows.shape[1] - 1):
            raise ValueError(f"masks[{name!r}] has shape {tuple(mask.shape)}; windows {windows.shape} need "
                             f"[N, L-1] = {(windows.shape[0], windows.shape[1] - 1)}")
    check_int("batch_size", batch_size, minimum=1)
    dtype = resolve_precision(precision, ctx.device)
    mine = np.arange(ctx.rank, windows.shape[0], ctx.world_size)
    groups = GroupedCE()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(mine), batch_size):
                idx = mine[start:start + batch_size]
                ids = torch.from_numpy(np.asarray(windows[idx], dtype=np.int64)).to(ctx.device)
                with autocast(ctx.device, dtype):
                    ce = token_cross_entropy(model, ids)
                groups.update(ce.float().cpu(), {k: m[idx] for k, m in masks.items()})
    finally:
        model.train(was_training)
    names = sorted(masks)
    sums = torch.tensor([[groups.sum_ce.get(k, 0.0), float(groups.n_tokens.get(k, 0))] for k in names],
                        dtype=torch.float64)
    if ctx.distributed:
        dist.all_reduce(sums)  # gloo and nccl both reduce float64 on this tensor's device
    groups.sum_ce = {k: float(sums[i, 0]) for i, k in enumerate(names)}
    groups.n_tokens = {k: int(round(float(sums[i, 1]))) for i, k in enumerate(names)}
    # an empty group (e.g. no hit beyond distance 256 in short windows) is null, so results stay strict JSON
    return {k: v if v["n_tokens"] else {**v, "ppl": None, "mean_ce": None} for k, v in groups.result().items()}


# --------------------------------------------------------------------------- checkpoints


def _rank_seed(seed: int, rank: int) -> int:
    # dropout masks must differ between ranks, and not depend on how the model was initialised
    return (seed * 1_000_003 + 7919 * (rank + 1)) % 2**63


def checkpoint_store(run_dir: str | os.PathLike, *, keep: int = 1) -> CheckpointStore:
    """The run's :class:`~bayeslayer.training.CheckpointStore` (``run_dir/checkpoints``)."""
    return CheckpointStore(Path(run_dir) / "checkpoints", keep=keep)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint directory of a run that passes its SHA-256 check, or ``None``.

    A damaged newest checkpoint is set aside with a warning when an older one verifies; when none
    does, :class:`~bayeslayer.training.CheckpointError` names the damaged file.
    """
    return checkpoint_store(run_dir).load()


def save_checkpoint(run_dir: Path, model, trainer_state: dict, *, keep: int = 1) -> Path:
    """Save ``checkpoints/step-XXXXXXXX`` crash-safely, point ``latest`` at it, drop older ones (rank 0)."""

    def write(directory: Path) -> None:
        save_model_dir(model, directory)
        save_state(directory, "trainer_state", trainer_state)

    return checkpoint_store(run_dir, keep=keep).save(trainer_state["step"], write)


def save_model_dir(model, directory: Path) -> None:
    """An HF model directory: ``config.json`` and ``model.safetensors`` (a tied head stored once).

    A failed write (a full disk) is an ``OSError`` naming the file."""
    model.config.save_pretrained(directory)
    write_safetensors(directory / "model.safetensors", model=model, metadata={"format": "pt"})


def load_model_weights(model, directory: Path) -> None:
    """Load ``model.safetensors`` of an HF model directory into ``model`` (strict, tied head allowed).

    A damaged file, a missing or extra tensor, or a shape that differs from ``model``'s (a config
    that disagrees with the weights) is one ``ValueError`` naming the file and the tensors."""
    from ..models.loading import check_state_dict

    path = Path(directory) / "model.safetensors"
    weights = read_safetensors(path)
    tied: set[str] = set()
    if model.config.tie_word_embeddings:  # safetensors stores a shared tensor under one of its names
        pairs = getattr(model, "_tied_weights_keys", None) or {}
        tied = set(pairs) | set(pairs.values()) if isinstance(pairs, dict) else set(pairs)
    check_state_dict(path, weights, model.state_dict(), optional=tied)
    model.load_state_dict(weights, strict=False)


# --------------------------------------------------------------------------- training


@dataclass
class LMTrainResult:
    """What one call of :func:`train_lm` did (losses cover the whole run, resumed parts included)."""

    run_dir: Path
    step: int = 0
    losses: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0  # training time of this call (excluding evaluations)
    tokens_per_second: float = 0.0  # over this call's steps, all ranks together
    finished: bool = False
    resumed_from: int | None = None
    summary: dict = field(default_factory=dict)


class _JsonLog:
    """``log.jsonl`` (rank 0 only): one JSON object per line, flushed as written."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        """Drop entries logged after ``step`` (a killed run logged past its last checkpoint)."""
        if not self.enabled or not self.path.exists():
            return
        kept, damaged, last = [], 0, -1
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:  # the half-written last line of a killed run, or a truncated/edited file
                damaged += 1
                continue
            if not isinstance(entry, dict):
                damaged += 1
            elif entry.get("step", 0) <= step:
                kept.append(line)
                last = max(last, int(entry.get("step", 0)) if isinstance(entry.get("step", 0), int) else -1)
        if damaged:
            warnings.warn(f"{self.path}: {damaged} damaged line(s) dropped (not JSON objects: a half-written last "
                          "line of a killed run, or a truncated or edited file)", RuntimeWarning, stacklevel=2)
        if step > 0 and last < step:
            warnings.warn(f"{self.path}: the log ends at step {max(last, 0)} but the run resumes from step {step}; "
                          f"the entries of steps {max(last, 0) + 1}..{step} are lost (the file was truncated)",
                          RuntimeWarning, stacklevel=2)
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, **entry) -> None:
        if self.enabled:
            with append_text(self.path) as fh:  # never through a link planted in the run folder
                fh.write(json.dumps(entry, allow_nan=True) + "\n")


def _check_resume_config(saved: dict, config: LMConfig, where: Path) -> None:
    current = config.to_json()
    saved = {k: v for k, v in saved.items() if k != "provenance"}  # who started the run, not what it is
    diff = sorted(k for k in set(saved) | set(current) if k not in _BOOKKEEPING and saved.get(k) != current.get(k))
    if diff:
        detail = ", ".join(f"{k}: {saved.get(k)!r} → {current.get(k)!r}" for k in diff)
        raise ValueError(f"{where} holds a run with a different configuration ({detail}); use another --out "
                         "or the same settings")


def _check_objective(run_dir: Path, objective: Objective, *, write: bool, device: Any = "cpu", seed: int = 0) -> None:
    """A run directory that holds another objective's run is an error; ``write``: record ``objective.json``."""
    path = run_dir / "objective.json"
    current = objective.describe()
    if path.exists():
        saved = read_json(path, what="the run's objective")
        if isinstance(saved, dict):
            saved = {k: v for k, v in saved.items() if k != "provenance"}
        if saved != current:
            raise ValueError(f"{run_dir} holds a run of another objective ({saved} → {current}); use another --out")
    elif (run_dir / "checkpoints" / "latest").exists() and current != Objective().describe():
        raise ValueError(f"{run_dir} holds a next-token run; objective {current['name']!r} needs another --out")
    if write:
        write_record(path, current, device=device, seeds=[seed], optimizer_groups=DECAY_POLICY)


def train_lm(
    config: LMConfig,
    run_dir: str | os.PathLike,
    *,
    device: str = "auto",
    cache_dir: str | None = None,
    stop_after: int | None = None,
    progress: bool = True,
    keep_checkpoints: int = 1,
    on_step: Callable[[int, float], None] | None = None,
    objective: Objective | None = None,
) -> LMTrainResult:
    """Train (or resume) the run in ``run_dir``; see the module docstring.

    Args:
        config: the run; a ``run_dir`` that already holds a run must have the same config
            (bookkeeping fields such as ``eval_every`` excepted).
        run_dir: output directory; resumes from ``checkpoints/latest`` when present.
        device: ``auto`` (``cuda:LOCAL_RANK`` when available, else CPU), ``cpu``, ``cuda:0``, ...
        cache_dir: token cache of :func:`bayeslayer.data.text.load_text_corpus`.
        stop_after: stop (with a checkpoint) once this many total steps are done — an interruption
            on purpose; ``train_lm`` again continues.
        progress: tqdm bar with loss and tokens/s on rank 0.
        keep_checkpoints: how many step checkpoints to keep (the newest).
        on_step: called as ``on_step(step, loss)`` after every optimiser step (all ranks).
        objective: what is trained (:class:`Objective`); default: next-token CE of a fresh
            :func:`build_model`.  Its :meth:`~Objective.describe` is part of the run's identity.

    Returns:
        :class:`LMTrainResult`; ``train_summary.json`` and ``final/`` once all steps are done.
    """
    if not isinstance(config, LMConfig):
        raise TypeError(f"config must be an LMConfig, got {type(config).__name__}")
    if stop_after is not None and (not isinstance(stop_after, int) or isinstance(stop_after, bool)
                                   or not 0 < stop_after <= config.steps):
        raise ValueError(f"stop_after must be an integer in [1, steps={config.steps}], got {stop_after!r}")
    check_int("keep_checkpoints", keep_checkpoints, minimum=1)
    objective = Objective() if objective is None else objective
    if not isinstance(objective, Objective):
        raise TypeError(f"objective must be an Objective, got {type(objective).__name__}")
    ctx = init_distributed(device)
    world = ctx.world_size
    if config.batch_size % (config.micro_batch_size * world) != 0:
        raise ValueError(f"batch_size ({config.batch_size}) must be a multiple of micro_batch_size × world size "
                         f"({config.micro_batch_size} × {world})")
    n_micro = config.batch_size // (config.micro_batch_size * world)
    autocast_dtype = resolve_precision(config.precision, ctx.device)
    run_dir = Path(run_dir)
    # one run per folder: the lock is taken (rank 0) before anything in the folder is read or written
    with OutputLock(run_dir) if ctx.is_main else contextlib.nullcontext():
        return _train_lm(config, run_dir, ctx, n_micro=n_micro, autocast_dtype=autocast_dtype, cache_dir=cache_dir,
                         stop_after=stop_after, progress=progress, keep_checkpoints=keep_checkpoints,
                         on_step=on_step, objective=objective)


class _LMCheckpoints(Checkpoints):
    """An LM run's checkpoints: HF model directories (``config.json``, ``model.safetensors``) with the
    trainer state, which records the :class:`LMConfig` (a resume must match it), the world size, the
    tokens and the training time so far."""

    def __init__(self, store: CheckpointStore, model, config: LMConfig, world_size: int) -> None:
        super().__init__(store)
        self.model, self.config, self.world_size = model, config, world_size
        self.seconds_before = 0.0  # training time of earlier calls (from the checkpoint)

    def accept(self, checkpoint: Path, state: dict) -> bool:
        _check_resume_config(json.loads(state["config"]), self.config, checkpoint)
        return True

    def write_weights(self, directory: Path) -> None:
        save_model_dir(self.model, directory)

    def read_weights(self, directory: Path) -> None:
        load_model_weights(self.model, directory)

    def extra_state(self, state: LoopState) -> dict:
        return {"train_seconds": self.seconds_before + state.seconds, "config": json.dumps(self.config.to_json()),
                "world_size": self.world_size, "tokens": state.step * self.config.tokens_per_step}

    def restore(self, trainer_state: dict) -> None:
        self.seconds_before = float(trainer_state["train_seconds"])


def _train_lm(config: LMConfig, run_dir: Path, ctx: DistContext, *, n_micro: int, autocast_dtype, cache_dir,
              stop_after, progress: bool, keep_checkpoints: int, on_step, objective: Objective) -> LMTrainResult:
    world = ctx.world_size
    config_path = run_dir / "config.json"
    store = checkpoint_store(run_dir, keep=keep_checkpoints)
    if ctx.is_main:
        remove_stale_temporaries(run_dir)  # left by a killed run; safe: this process holds the lock
        store.recover()
        if config_path.exists():
            _check_resume_config(read_json(config_path, what="the run's configuration"), config, run_dir)
        _check_objective(run_dir, objective, write=False)
    ctx.barrier()

    corpus = load_corpus(config, ctx, cache_dir=cache_dir, splits=("train", "validation"))
    train_windows = corpus.windows("train", config.seq_len)
    val_windows = corpus.windows("validation", config.seq_len)
    val_masks = corpus.annotate("validation", config.seq_len).masks(shifted=True)
    schedule = WindowSchedule(train_windows.shape[0], config.batch_size, config.seed)

    seed_everything(config.seed)
    trainee = objective.build(config, corpus, ctx.device)
    model = trainee.model
    groups = objective.param_groups(trainee, config)
    if not [p for g in groups for p in g["params"]]:
        raise ValueError(f"objective {objective.name!r} leaves no parameter to train")
    if ctx.is_main:  # the inputs are valid (corpus loaded, model built): record what this run is
        write_record(config_path, config.to_json(), device=ctx.device, seeds=[config.seed],
                     optimizer_groups=DECAY_POLICY)
        _check_objective(run_dir, objective, write=True, device=ctx.device, seed=config.seed)

    log = _JsonLog(run_dir / "log.jsonl", ctx.is_main)
    checkpoints = _LMCheckpoints(store, model, config, world)
    window_losses: list[float] = []

    def micro_batches(step: int) -> list[torch.Tensor]:
        mine = schedule.step_windows(step, ctx.rank, world)
        return [torch.from_numpy(np.asarray(train_windows[mine[i * config.micro_batch_size:
                                                                (i + 1) * config.micro_batch_size]],
                                            dtype=np.int64)).to(ctx.device)
                for i in range(n_micro)]

    def after_start(state: LoopState) -> None:
        if state.resumed_from is not None:
            log.truncate_after(state.step)
            log.write(event="resume", step=state.step, world_size=world, time=time.time())
        else:
            log.truncate_after(-1)
            log.write(event="start", step=0, world_size=world, device=str(ctx.device), time=time.time(),
                      parameters=_param_counts(model), config=config.to_json())

    def after_step(state: LoopState, info: StepInfo) -> None:
        window_losses.append(info.loss)
        if info.step % config.log_every == 0 or info.step == end:
            tokens_per_s = (info.step - start[0]) * config.tokens_per_step / max(state.seconds, 1e-9)
            log.write(event="train", step=info.step, loss=info.loss, loss_mean=float(np.mean(window_losses)),
                      lr=info.lr, grad_norm=info.grad_norm, tokens=info.step * config.tokens_per_step,
                      tokens_per_s=tokens_per_s, train_seconds=checkpoints.seconds_before + state.seconds,
                      **({"parts": info.parts} if info.parts else {}))
            window_losses.clear()
        if on_step is not None:
            on_step(info.step, info.loss)

    def evaluate(state: LoopState, final: bool) -> dict:
        windows, masks = val_windows, val_masks
        if not final and config.eval_windows:
            windows = windows[: config.eval_windows]
            masks = {k: m[: config.eval_windows] for k, m in masks.items()}
        groups = grouped_perplexity(model, windows, masks, batch_size=config.eval_batch_size, ctx=ctx,
                                    precision=config.precision)
        record = {"step": state.step, "split": "validation", "windows": int(windows.shape[0]),
                  "final": final, "groups": groups}
        log.write(event="eval", **record)
        return record

    end = config.steps if stop_after is None else stop_after
    start = [0]  # the step this call started from (tokens/s of this session)

    def started(state: LoopState) -> None:
        start[0] = state.step
        after_start(state)

    state = train_loop(
        trainee, micro_batches, lambda module, ids: module(ids), config.train_config(), groups=groups, ctx=ctx,
        autocast_dtype=autocast_dtype, checkpoints=checkpoints, evaluate=evaluate,
        final_eval_done=lambda s: bool(s.evals) and bool(s.evals[-1].get("final")), after_start=started,
        after_step=after_step, stop_after=stop_after, rank_seed=_rank_seed(config.seed, ctx.rank),
        find_unused_parameters=objective.find_unused_parameters, progress=progress,
        tokens_per_step=config.tokens_per_step, desc=f"lm {config.model_label}")
    result = LMTrainResult(run_dir=run_dir, step=state.step, losses=state.losses, evals=state.evals,
                           seconds=state.seconds, finished=state.finished, resumed_from=state.resumed_from)
    steps_done = result.step - start[0]
    result.tokens = result.step * config.tokens_per_step
    result.tokens_per_second = steps_done * config.tokens_per_step / result.seconds if steps_done else 0.0
    if result.finished:
        result.summary = _finish(run_dir, model, config, result, ctx, checkpoints.seconds_before,
                                 objective=objective, checks=objective.finish(trainee),
                                 tokenizer=corpus.tokenizer)
    ctx.barrier()
    return result


def _param_counts(model) -> dict:
    from ..models import count_parameters

    return count_parameters(model)._asdict()


def _finish(run_dir: Path, model, config: LMConfig, result: LMTrainResult, ctx: DistContext,
            seconds_before: float, *, objective: Objective, checks: dict, tokenizer=None) -> dict:
    """Write ``final/`` (HF model dir with ``tokenizer.json``) and ``train_summary.json``; check that
    all ranks agree."""
    digest = weights_digest(model)
    digests = [digest]
    if ctx.distributed:
        digests = [None] * ctx.world_size
        dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks ended with different weights (digests {digests}); DDP went out of sync")
    total_seconds = seconds_before + result.seconds
    n = len(result.losses)
    summary = {
        "label": config.model_label, "mixer": config.mixer, "preset": config.preset, "seed": config.seed,
        "match": config.model.match, "mixer_kwargs": config.mixer_kwargs,
        "steps": result.step, "tokens": result.tokens, "world_size": ctx.world_size, "device": str(ctx.device),
        "train_seconds": total_seconds, "tokens_per_second": result.tokens / total_seconds if total_seconds else 0.0,
        "parameters": _param_counts(model), "final_train_loss": float(np.mean(result.losses[-max(1, n // 10):])),
        "validation": result.evals[-1]["groups"] if result.evals else {}, "weights_sha256": digest,
        "rank_weights_sha256": digests, "objective": objective.describe(), **checks,
    }
    if ctx.is_main:
        _report_damaged_final(run_dir / "final")
        publish_directory(run_dir / "final", lambda tmp: _write_final(tmp, model, config, objective, tokenizer))
        write_record(run_dir / "train_summary.json", summary, device=ctx.device, seeds=[config.seed],
                     wall_seconds=total_seconds, optimizer_groups=DECAY_POLICY)
    return summary


def _report_damaged_final(final: Path) -> None:
    """Warn, naming the damage, when a finished run's ``final/`` is about to be rewritten because it is damaged."""
    from ..models.loading import read_model_config, verify_model_dir

    if not final.is_dir():
        return
    try:
        verify_model_dir(final)
        read_model_config(final)
        read_json(final / "lm_config.json", what="the run's configuration")
    except (OSError, ValueError) as exc:
        warnings.warn(f"{final} was damaged ({' '.join(str(exc).split())}); rewritten from the last checkpoint",
                      RuntimeWarning, stacklevel=3)
def write_tokenizer_config(tokenizer, directory: str | os.PathLike) -> None:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` beside ``tokenizer.json``: they name the
    end-of-text token, so ``AutoTokenizer.from_pretrained(directory)`` (and lm-eval's ``hf`` model) has an
    EOS.  ``tokenizer.json`` itself is left as written."""
    import tempfile

    from ..evaluation.tasks import hf_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        hf_tokenizer(tokenizer).save_pretrained(tmp)
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (Path(tmp) / name).is_file():
                (Path(directory) / name).write_bytes((Path(tmp) / name).read_bytes())


def _write_final(directory: Path, model, config: LMConfig, objective: Objective, tokenizer) -> None:
    save_model_dir(model, directory)
    (directory / "lm_config.json").write_text(json.dumps(config.to_json(), indent=1) + "\n")
    (directory / "objective.json").write_text(json.dumps(objective.describe(), indent=1) + "\n")
    if tokenizer is not None:  # the model directory is self-contained (NIAH, lm-eval, from_pretrained)
        tokenizer.save(str(directory / "tokenizer.json"))
        write_tokenizer_config(tokenizer, directory)
    from ..models.loading import write_model_manifest

    write_model_manifest(directory)  # last: every loader of the package verifies it


# --------------------------------------------------------------------------- evaluation of runs


def load_run(run_dir: str | os.PathLike, *, device: str | torch.device = "cpu"):
    """``(LMConfig, model)`` of a finished run (its ``final/`` directory), model in eval mode."""
    run_dir = Path(run_dir)
    final = run_dir / "final"
    if not (final / "model.safetensors").is_file() or not (final / "lm_config.json").is_file():
        raise FileNotFoundError(f"{run_dir} has no finished model (final/model.safetensors and "
                                "final/lm_config.json); train it to the end first")
    from ..models import BayesLayerConfig, BayesLayerForCausalLM
    from ..models.loading import check_finite, read_model_config, verify_model_dir

    if not verify_model_dir(final):
        warnings.warn(f"{final} has no manifest.json (written by an older bayeslayer): its files are not "
                      "verified", RuntimeWarning, stacklevel=2)
    config = LMConfig.from_json(read_json(final / "lm_config.json", what="the run's configuration"))
    raw = read_model_config(final, model_type=BayesLayerConfig.model_type)
    try:
        model_config = BayesLayerConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"model config {final / 'config.json'} is not a valid bayeslayer config "
                         f"({' '.join(str(exc).split())})") from exc
    model = BayesLayerForCausalLM(model_config)
    load_model_weights(model, final)
    check_finite(model, final)
    return config, model.to(device).eval()


def evaluate_run(run_dir: str | os.PathLike, *, split: str = "test", seq_len: int | None = None,
                 batch_size: int = 4, device: str = "auto", precision: str = "fp32",
                 cache_dir: str | None = None) -> dict:
    """Grouped PPL of one finished run on packed windows of ``split`` (cached in the run directory).

    Returns ``{"run_dir", "label", "mixer", "seed", "split", "seq_len", "windows", "groups"}``;
    ``groups`` maps each of :data:`GROUPS` to ``{"ppl", "mean_ce", "n_tokens"}``.
    """
    if split not in ("validation", "test"):
        raise ValueError(f"split must be 'validation' or 'test', got {split!r}")
    ctx = init_distributed(device)
    config, model = load_run(run_dir, device=ctx.device)
    seq_len = config.seq_len if seq_len is None else check_int("seq_len", seq_len, minimum=2)
    cache = Path(run_dir) / f"eval-{split}-L{seq_len}-{precision}.json"
    weights = sha256_file(Path(run_dir) / "final" / "model.safetensors")
    if cache.is_file():
        try:
            cached = read_json(cache, what="evaluation cache")
        except ValueError as err:  # derived data: recompute it
            warnings.warn(f"{err}; recomputing it", RuntimeWarning, stacklevel=2)
            cached = None
        if isinstance(cached, dict) and cached.get("weights_sha256") == weights:
            return cached
    corpus = load_corpus(config, ctx, cache_dir=cache_dir, splits=("train", split))
    windows = corpus.windows(split, seq_len)
    masks = corpus.annotate(split, seq_len).masks(shifted=True)
    groups = grouped_perplexity(model, windows, masks, batch_size=batch_size, ctx=ctx, precision=precision)
    record = {"run_dir": str(run_dir), "label": config.model_label, "mixer": config.mixer, "seed": config.seed,
              "preset": config.preset, "match": config.model.match,
              "split": split, "seq_len": seq_len, "windows": int(windows.shape[0]),
              "precision": precision, "source": config.source, "groups": groups, "weights_sha256": weights}
    if ctx.is_main:
        write_record(cache, record, device=ctx.device, seeds=[config.seed],
                     optimizer_groups=trained_with(run_dir))
        record = json.loads(cache.read_text())
    return record


def trained_with(run_dir: str | os.PathLike) -> str | None:
    """The optimiser grouping rule recorded in a run's ``train_summary.json`` (None when it records none)."""
    path = Path(run_dir) / "train_summary.json"
    try:
        prov = json.loads(path.read_text()).get("provenance")
    except (OSError, ValueError, AttributeError):
        return None
    return prov.get("optimizer_groups") if isinstance(prov, dict) else None


def summarize_runs(records: Sequence[dict]) -> dict:
    """Group per-run records by model label; mean ± std (ddof 1) of PPL per group over seeds.

    Returns the results layout of :func:`bayeslayer.experiments.harness.results_record` with
    ``models[label] = {"seeds": [records], "summary": {group: {"mean", "std", "values"}}}``.
    """
    if not records:
        raise ValueError("summarize_runs needs at least one run record")
    splits = {(r["split"], r["seq_len"]) for r in records}
    if len(splits) != 1:
        raise ValueError(f"runs were evaluated on different splits/lengths {sorted(splits)}; evaluate them alike")
    split, seq_len = splits.pop()
    models: dict[str, dict] = {}
    for rec in records:
        models.setdefault(rec["label"], {"seeds": [], "summary": {}})["seeds"].append(rec)
    for label, entry in models.items():
        seeds = [r["seed"] for r in entry["seeds"]]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"model {label!r} has repeated seeds {seeds}: pass each run once (or set --label)")
        entry["summary"] = {g: summarize([r["groups"][g]["ppl"] for r in entry["seeds"]])
                            for g in GROUPS if all(r["groups"].get(g, {}).get("n_tokens", 0) for r in entry["seeds"])}
    presets = sorted({r.get("preset", "?") for r in records})
    return results_record("lm", ",".join(presets), {"split": split, "seq_len": seq_len}, models,
                          groups=list(GROUPS), paper_table2=PAPER_TABLE2)


def _cell(stats: dict | None) -> str:
    if not stats:
        return "–"
    n = len(stats["values"])
    return f"{stats['mean']:.2f} ± {stats['std']:.2f}" if n > 1 else f"{stats['mean']:.2f}"


def markdown_table(record: dict) -> str:
    """Table 2's layout (model | all | AR-hit | other), then AR-hit PPL per distance bucket and token counts."""
    models = record.get("models")
    if not isinstance(models, dict) or not models:
        raise ValueError("record has no models; pass the JSON written by `bayeslayer lm eval`")
    cfg = record.get("config", {})
    n_seeds = {label: len(m["seeds"]) for label, m in models.items()}
    lines = [f"PPL on packed windows of length {cfg.get('seq_len')} of the {cfg.get('split')} split "
             f"(mean ± std over seeds; seeds per model: "
             + ", ".join(f"{k} {v}" for k, v in n_seeds.items()) + ").", "",
             "| model | all | AR-hit | other |", "|---|---|---|---|"]
    for label, m in models.items():
        lines.append(f"| {label} | " + " | ".join(_cell(m["summary"].get(g)) for g in GROUPS[:3]) + " |")
    lines += ["", "| model | " + " | ".join(GROUP_LABELS[g] for g in GROUPS[3:]) + " |", "|---|---|---|---|"]
    for label, m in models.items():
        lines.append(f"| {label} | " + " | ".join(_cell(m["summary"].get(g)) for g in GROUPS[3:]) + " |")
    first = next(iter(models.values()))["seeds"][0]["groups"]
    lines += ["", "Tokens per group: " + ", ".join(
        f"{GROUP_LABELS[g]} {first[g]['n_tokens']:,}" for g in GROUPS if g in first) + "."]
    return "\n".join(lines) + "\n"


def bar_plot(record: dict, path: str | os.PathLike) -> Path:
    """Grouped bars of PPL per group (log scale), one bar per model, error bars = std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = record["models"]
    groups = [g for g in GROUPS if any(g in m["summary"] for m in models.values())]
    width = 0.8 / max(1, len(models))
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    try:
        for i, (label, m) in enumerate(models.items()):
            xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(groups))]
            means = [m["summary"][g]["mean"] if g in m["summary"] else float("nan") for g in groups]
            stds = [m["summary"][g]["std"] if g in m["summary"] else 0.0 for g in groups]
            ax.bar(xs, means, width, yerr=stds, capsize=3, label=f"{label} ({len(m['seeds'])} seed(s))")
        ax.set_xticks(range(len(groups)), [GROUP_LABELS[g] for g in groups], rotation=15, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("perplexity (log scale)")
        cfg = record.get("config", {})
        ax.set_title(f"{cfg.get('split')} split, windows of {cfg.get('seq_len')} tokens", fontsize=10)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=8)
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def write_report(record: dict, out_dir: str | os.PathLike, name: str = "lm") -> dict[str, Path]:
    """Write ``<name>.json`` (unless it is the source), ``<name>.md`` and ``<name>.png`` from ``record``."""
    out_dir = Path(out_dir)
    check_file_name(name, option="name")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "table": out_dir / f"{name}.md", "plot": out_dir / f"{name}.png"}
    seeds = sorted({r["seed"] for m in record["models"].values() for r in m["seeds"]})
    groups = {(r.get("provenance") or {}).get("optimizer_groups") for m in record["models"].values()
              for r in m["seeds"]}
    devices = {str(d) for m in record["models"].values() for r in m["seeds"]
               if (d := (r.get("provenance") or {}).get("device"))} or {"cpu"}
    write_record(paths["json"], record, device=",".join(sorted(devices)),
                 seeds=seeds, optimizer_groups=groups.pop() if len(groups) == 1 else None)
    atomic_write_text(paths["table"], markdown_table(record))
    bar_plot(record, paths["plot"])
    return paths


# --------------------------------------------------------------------------- command line


def config_from_args(args: argparse.Namespace) -> LMConfig:
    """The preset named by ``--preset`` with the command line's overrides applied."""
    config = PRESETS[args.preset]
    overrides = {name: getattr(args, name) for name in (
        "mixer", "label", "seed", "steps", "batch_size", "micro_batch_size", "seq_len", "lr", "warmup_steps",
        "mlp_dropout", "hidden_size", "num_layers", "num_heads", "head_dim", "source", "tokenizer",
        "vocab_size", "precision", "eval_every", "eval_windows", "checkpoint_every", "log_every", "match")
        if getattr(args, name, None) is not None}
    if args.mixer_kwargs is not None:
        overrides["mixer_kwargs"] = parse_json_object("--mixer-kwargs", args.mixer_kwargs)
    return replace(config, **overrides)


def match_arg(text: str) -> str:
    """``--match``: one of :data:`MATCHES` (argparse reports the ValueError as a one-line usage error)."""
    if text not in MATCHES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(MATCHES)}, got {text!r}")
    return text


def parse_json_object(option: str, text: str) -> dict:
    """The value of a command-line option that takes a JSON object, e.g. ``--mixer-kwargs '{"p0": 1.0}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{option} must be a JSON object, got {text!r}: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a JSON object, got {text!r}")
    return value


def check_mixer_kwargs(mixer: str, kwargs: dict, *, hidden_size: int, num_heads: int, head_dim: int,
                       option: str = "--mixer-kwargs") -> None:
    """Build one ``mixer`` layer with ``kwargs`` so a misspelt or out-of-range argument fails now, not
    after the corpus is tokenized (on the ``meta`` device: no memory is allocated, whatever the sizes)."""
    from ..layers import build_mixer

    try:
        with torch.device("meta"):
            build_mixer(mixer, hidden_size, num_heads=num_heads, head_dim=head_dim, layer_idx=0, **kwargs)
    except (TypeError, ValueError) as err:  # an unknown keyword is a TypeError of the constructor
        raise UsageError(f"{option} {json.dumps(kwargs)}: {' '.join(str(err).split())}") from None


def training_memory(config: LMConfig) -> int:
    """A lower bound of the bytes one rank needs to train ``config``: weights, gradients and AdamW's two
    moments (16 bytes per fp32 parameter, counted on the ``meta`` device, which allocates nothing) and
    the logits of one micro-batch."""
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(config, config.vocab_size).parameters())
    return 16 * params + 4 * config.micro_batch_size * config.seq_len * config.vocab_size


def check_train_args(config: LMConfig, args: argparse.Namespace, out: str) -> None:
    """What ``lm train`` can check before it tokenizes a corpus or writes a file."""
    check_out_dir(out)
    check_source(config.source)
    if config.tokenizer is not None:
        check_tokenizer(config.tokenizer)
    check_mixer_kwargs(config.mixer, config.mixer_kwargs, hidden_size=config.hidden_size,
                       num_heads=config.num_heads, head_dim=config.head_dim)
    sizes = (f"hidden-size {config.hidden_size}, {config.num_layers} layers, {config.num_heads} heads of "
             f"head-dim {config.head_dim}, vocab-size {config.vocab_size}")
    check_memory(training_memory(config), what=f"training a model of {sizes}", device=resolve_device(args.device))


def _train_main(args) -> int:
    config = config_from_args(args)
    stem = f"{config.preset}-state" if config.model.match == "state" else config.preset
    out = args.out or os.path.join("runs", "lm", f"{stem}-{config.mixer}-seed{config.seed}")
    check_train_args(config, args, out)
    result = train_lm(config, out, device=args.device, cache_dir=args.cache_dir, stop_after=args.stop_after,
                      progress=not args.no_progress, keep_checkpoints=args.keep_checkpoints)
    if int(os.environ.get("RANK", "0")) == 0:
        state = "finished" if result.finished else f"stopped at step {result.step}/{config.steps}"
        print(f"lm train {config.model_label} seed {config.seed}: {state}; {result.tokens:,} tokens, "
              f"{result.tokens_per_second:,.0f} tokens/s this session; run dir {out}")
        if result.summary.get("validation"):
            v = result.summary["validation"]
            print("validation PPL: " + ", ".join(f"{GROUP_LABELS[g]} {v[g]['ppl']:.2f}" for g in GROUPS
                                                 if v.get(g, {}).get("ppl") is not None))
    if dist.is_initialized():
        dist.barrier()  # every rank is done (rank 0 wrote and printed) before any tears the group down
        dist.destroy_process_group()
    return 0


def _eval_main(args) -> int:
    out_dir = check_out_dir(args.out)
    check_file_name(args.name)
    # two evaluations into one folder would overwrite each other's files: one writer (rank 0) per folder
    # a refused command leaves no folder behind (remove_if_unused)
    with OutputLock(out_dir, remove_if_unused=True) if int(os.environ.get("RANK", "0")) == 0 \
            else contextlib.nullcontext():
        return _eval_locked(args, out_dir)


def _eval_locked(args, out_dir: Path) -> int:
    if args.plot_only:
        if args.runs:
            raise UsageError(f"--plot-only redraws from {out_dir / (args.name + '.json')}; it takes no run "
                             f"directories (got {args.runs})")
        record = plot_only_json(out_dir, args.name, experiment="lm")
        with redrawing(out_dir / f"{args.name}.json"):
            atomic_write_text(out_dir / f"{args.name}.md", markdown_table(record))
            bar_plot(record, out_dir / f"{args.name}.png")
            print(markdown_table(record))
        print(f"redrew {out_dir / (args.name + '.md')} and {args.name}.png")
        return 0
    if not args.runs:
        raise UsageError("give at least one run directory (or --plot-only to redraw from --out)")
    for run in args.runs:  # every run must be finished before the first is evaluated
        final = check_in_dir(run, option="run", what="run directory") / "final"
        if not (final / "model.safetensors").is_file() or not (final / "lm_config.json").is_file():
            raise UsageError(f"run {run} has no finished model (final/model.safetensors and "
                             "final/lm_config.json); train it to the end first")
    records = []
    for run in args.runs:
        rec = evaluate_run(run, split=args.split, seq_len=args.seq_len, batch_size=args.batch_size,
                           device=args.device, precision=args.precision, cache_dir=args.cache_dir)
        if args.label:
            rec = {**rec, "label": args.label}
        records.append(rec)
    record = summarize_runs(records)
    paths = write_report(record, args.out, args.name)
    print(markdown_table(record))
    print(f"wrote {paths['json']}, {paths['table']}, {paths['plot']}")
    return 0


def _train_threads(args: argparse.Namespace) -> int:
    """``lm train``'s thread default: one thread for the tiny preset's small matrices, else PyTorch's."""
    return SMALL if args.preset == "tiny" else TORCH_DEFAULT


def add_parser(sub) -> None:
    p = sub.add_parser("lm", help="language modelling with AR-hit evaluation (docs/theory.md §8.5)",
                       description="Train language models from scratch (lm train) and compare finished runs by "
                                   "perplexity over all tokens, over AR-hit tokens (a bigram seen earlier in the "
                                   "window) and over the rest (lm eval). Held-out perplexity per window length is "
                                   "bayeslayer heldout. The training loop, run folder and resume rules: python -m "
                                   "pydoc bayeslayer.experiments.lm.")
    lm_sub = p.add_subparsers(dest="lm_command", metavar="{train,eval}", required=True)

    t = lm_sub.add_parser("train", help="train (or resume) one language model run",
                          description="Train a BayesLayerForCausalLM; rerun the same command to resume. "
                                      "Distributed: torchrun --nproc_per_node N -m bayeslayer.cli lm train ...")
    t.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                   help="'paper' = the paper's settings (docs/theory.md §8.5; WikiText-103, 520M tokens); "
                        "'cpu' ≈ 30 min per model on an idle "
                        "2-core CPU on the python-docs corpus; 'tiny' = a smoke test of seconds on the "
                        "python-docstrings corpus, which every Python installation has")
    t.add_argument("--mixer", help="token mixer of every layer (bayesian, gated_deltanet, mamba2, ...) "
                                   f"(default: {PRESETS['cpu'].mixer})")
    t.add_argument("--mixer-kwargs", help='JSON object of extra mixer arguments, e.g. \'{"p0": 1.0}\'')
    t.add_argument("--match", type=match_arg, default=None,
                   help="'params' (default): every mixer gets the preset's head shape, so BL (mean plus covariance) "
                        "carries more recurrent state than the others (1.5× Gated DeltaNet's); 'state': the "
                        "state-budget solver widens the mixer's value dim so its state equals the default BL's")
    t.add_argument("--label", help="the model's name in tables (default: from the mixer)")
    t.add_argument("--seed", type=int_arg, help=f"random seed (default: {PRESETS['cpu'].seed})")
    for name, kind, what in (
            ("steps", int_arg, "optimiser steps"), ("batch-size", int_arg, "windows per optimiser step"),
            ("micro-batch-size", int_arg, "windows per forward pass"), ("seq-len", int_arg, "window length in tokens"),
            ("lr", float, "peak learning rate"), ("warmup-steps", int_arg, "learning-rate warmup steps"),
            ("mlp-dropout", float, "dropout in the MLPs"), ("hidden-size", int_arg, "model width"),
            ("num-layers", int_arg, "blocks"), ("num-heads", int_arg, "heads per mixer"),
            ("head-dim", int_arg, "head dimension"),
            ("vocab-size", int_arg, "size of the BPE trained when no --tokenizer is given"),
            ("eval-every", int_arg, "steps between validation evaluations"),
            ("eval-windows", int_arg, "validation windows per periodic evaluation (0: all)"),
            ("checkpoint-every", int_arg, "steps between checkpoints"),
            ("log-every", int_arg, "steps between log lines")):
        t.add_argument(f"--{name}", type=kind, help=override_help(PRESETS, name.replace("-", "_"), what))
    t.add_argument("--source", help=f"corpus: {SOURCE_HELP} (default: the preset's: "
                                    f"{preset_values(PRESETS, 'source')})")
    t.add_argument("--tokenizer", help="tokenizer.json (or a directory holding one); default: train a BPE")
    t.add_argument("--precision", choices=PRECISIONS, help="autocast: auto = bf16 on a capable GPU, else fp32")
    t.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    t.add_argument("--cache-dir", type=cache_dir_arg, default=None,
                       help="token cache directory (default $BAYESLAYER_CACHE)")
    t.add_argument("--out", default=None, help="run directory (default runs/lm/<preset>-<mixer>-seed<seed>)")
    t.add_argument("--stop-after", type=positive_int_arg, default=None,
                   help="stop (checkpointed) after this many total steps")
    t.add_argument("--keep-checkpoints", type=positive_int_arg, default=1, help="newest step checkpoints to keep")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_threads_option(t, _train_threads, default_text="1 with --preset tiny (small matrices), else PyTorch's")
    t.set_defaults(func=_train_main)

    e = lm_sub.add_parser("eval", help="grouped PPL of finished runs (Table 2)",
                          description="Table 2: evaluate finished runs; runs sharing a label (default: the mixer) "
                                      "are seeds of one model. Writes <out>/<name>.json, .md, .png. Held-out PPL "
                                      "per length (Table 7, formerly `lm eval --lengths ...`) is `bayeslayer heldout`.")
    e.add_argument("runs", nargs="*", help="run directories (each with final/)")
    e.add_argument("--split", choices=("validation", "test"), default="test")
    e.add_argument("--seq-len", type=positive_int_arg, default=None,
                   help="window length (default: each run's training length)")
    e.add_argument("--batch-size", type=positive_int_arg, default=4)
    e.add_argument("--precision", choices=PRECISIONS, default="fp32")
    e.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    e.add_argument("--cache-dir", type=cache_dir_arg, default=None)
    e.add_argument("--label", default=None, help="override the model label of every run given")
    e.add_argument("--out", default="results/lm", help="output directory")
    e.add_argument("--name", default="lm", help="file name stem of the outputs")
    e.add_argument("--plot-only", action="store_true", help=PLOT_ONLY_HELP + " (<out>/<name>.json)")
    add_threads_option(e, TORCH_DEFAULT)
    e.set_defaults(func=_eval_main)
