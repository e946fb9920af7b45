"""What an MQAR run is made of: presets, the model each mixer gets, the training data and schedule.

:mod:`bayeslayer.experiments.mqar` sweeps these; :mod:`bayeslayer.experiments.variance` re-trains its
Update model from them.  Each mixer comes from the registry (:func:`bayeslayer.layers.build_mixer`) with
its head configuration from the state-budget solver
(:func:`~bayeslayer.models.state_budget.solve_state_budget`), inside
:class:`~bayeslayer.models.mqar_model.MQARModel`.

The output gate (``gate``): Zoology runs its GDN and DeltaNet with ``use_gate=False`` (no output gate);
``default`` keeps each layer's own default in the stacked layout and turns the gate off for every mixer
that has one (BL, GDN, DeltaNet, linear attention) in the hybrid layout; ``on`` / ``off`` force it.
Mamba-2's SiLU(z) gate is part of its SSD block and is never changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...checks import check_int
from ...data.mqar import MQARDataset, MQARTask
from ...layers import MIXER_LABELS, MIXER_REGISTRY, MIXERS, QKVMixer
from ...models.mqar_model import LAYOUTS, MQARModel, MQARModelConfig
from ...models.state_budget import HeadConfig, budget_rule, solve_state_budget
from .harness import TrainConfig
from .options import check_seeds

TASK_NAMES = ("base", "update", "block")
# variants MQAR builds as their base layer with the variant's keywords (the spelling of their records'
# model_config); the registry's gated_deltanet_noconv was a layer name of its own when those records were made
_BUILT_AS_BASE = ("bayesian", "deltanet")
# the low-rank-plus-diagonal BL (bayeslayer.ops.bayesian_layer.lowrank) of rank r, sized by the state-budget rule for
# "bayesian_lowrank" and built as the registry's "bayesian" with covariance="lowrank"; not a default
LOWRANK_PREFIX = "bayesian_lowrank"
LOWRANK_MIXERS = tuple(f"{LOWRANK_PREFIX}{r}" for r in (0, 1, 2, 4, 8, 16, 32))
GATES = ("default", "on", "off")
# Zoology's MQAR learning-rate sweep: np.logspace(-4, -2, 4).
ZOOLOGY_LRS = (1e-4, 4.6415888e-4, 2.1544347e-3, 1e-2)


# -- presets -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MQARPreset:
    """Everything an MQAR run depends on; ``paper`` is the paper's setting (docs/theory.md §8.4).

    Pools (``pool_*``) are the total sequences generated for training + validation; the test sets
    (``test_examples`` per sweep point) are generated separately from ``test_seed``.
    """

    name: str
    vocab_size: int
    pool_base: int
    pool_update: int
    pool_block: int
    epochs: int
    batch_size: int
    lrs: tuple[float, ...]
    seeds: int
    budget: int
    width: int  # update and block
    base_widths: tuple[int, ...]
    base_seq_len: int  # the Base test length and number of pairs
    base_num_pairs: int
    test_examples: int
    base_train: tuple[tuple[int, int], ...] | None = None  # (seq_len, pairs) mixture; None: the test task
    num_layers: int = 2
    mlp_mult: int = 0
    warmup_steps: int | None = None  # None: warmup_fraction of the steps
    warmup_fraction: float = 0.05
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    val_fraction: float = 0.1
    update_train: tuple[tuple[int, int, tuple[int, ...]], ...] = (
        (64, 4, (0, 1, 2, 4)), (128, 16, (0, 2, 4, 8, 16)))  # (seq_len, pairs, update counts)
    update_test_seq_len: int = 128
    update_test_pairs: int = 16
    update_test_updates: tuple[int, ...] = (0, 1, 2, 4, 6, 8, 10, 12, 14, 16)
    block_size: int = 2
    block_seq_len: int = 128
    block_train_pairs: tuple[int, ...] = (2, 4, 6, 8)
    block_test_pairs: tuple[int, ...] = (2, 4, 6, 8, 10, 12, 14, 16)
    random_non_queries: bool = True  # Zoology's default: random tokens between the queries
    chunk_size: int = 64
    eval_batch: int = 128
    data_seed: int = 0
    test_seed: int = 10_000
    checkpoint_every: int = 100
    layout: str = "stacked"  # bayeslayer.models.mqar_model; "hybrid" = Zoology's conv-block + mixer-block model
    gate: str = "default"  # output gate of the mixers that have one: layout's default, "on" or "off"
    hybrid_conv_size: int = 3  # Zoology's BaseConv kernel
    max_steps: int | None = None  # cap on the training steps (epochs × batches per epoch); None: no cap

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {self.gate!r}")
        if self.max_steps is not None:
            check_int("max_steps", self.max_steps, minimum=1)
        check_seeds(check_int("seeds", self.seeds, minimum=1), name="seeds")
        if self.layout == "hybrid" and self.num_layers < 2:
            raise ValueError(f"the hybrid layout alternates a conv block and a mixer block and needs "
                             f"num_layers >= 2, got {self.num_layers}")

    def pool_size(self, task: str) -> int:
        return {"base": self.pool_base, "update": self.pool_update, "block": self.pool_block}[task]


PRESETS: dict[str, MQARPreset] = {
    # docs/theory.md §8.4.  The paper names no widths for Base; these are Zoology's.
    "paper": MQARPreset(
        "paper", vocab_size=8192, pool_base=100_000, pool_update=160_000, pool_block=120_000, epochs=40,
        batch_size=256, lrs=ZOOLOGY_LRS, seeds=1, budget=8192, width=128, base_widths=(64, 128, 256, 512),
        base_seq_len=512, base_num_pairs=64, test_examples=3000, warmup_steps=1024, checkpoint_every=500,
    ),
    # Sized from step times measured on the 2-core CPU (docs/experiments.md): the five default mixers,
    # one seed, one learning rate (1e-2), about 20 minutes per task when the machine is idle.  Same
    # task structure and sweeps; smaller vocabulary (64, about the least Update's 16 keys + 32 values
    # allow), pools, widths and state budget; Base at length 128 with 16 pairs (the paper's 512/64 has
    # the same 1:8 ratio); non-query positions hold token 0 instead of random tokens, because with
    # random fillers no mixer left chance level within a CPU budget (measured, docs/experiments.md).
    # Base trains on a Zoology-style mixture of easier and test-sized sequences: trained on 128/16
    # alone, BL stayed at chance (0.019) after 504 steps.
    "default": MQARPreset(
        "default", vocab_size=64, pool_base=6_000, pool_update=12_000, pool_block=12_000, epochs=3,
        batch_size=32, lrs=(1e-2,), seeds=1, budget=4096, width=64, base_widths=(16, 32, 64),
        base_seq_len=128, base_num_pairs=16, test_examples=256, chunk_size=32, random_non_queries=False,
        base_train=((64, 4), (128, 8), (128, 16)),
    ),
    # The CPU preset on the paper's data: vocabulary 8,192 and Zoology's random fillers (everything else
    # as "default").  It shows how far a CPU gets on Update at 16 updates.
    "cpu-paper-data": MQARPreset(
        "cpu-paper-data", vocab_size=8192, pool_base=6_000, pool_update=12_000, pool_block=12_000, epochs=3,
        batch_size=32, lrs=(1e-2,), seeds=1, budget=4096, width=64, base_widths=(16, 32, 64),
        base_seq_len=128, base_num_pairs=16, test_examples=256, chunk_size=32, random_non_queries=True,
        base_train=((64, 4), (128, 8), (128, 16)),
    ),
    # Seconds-long smoke run (tests, trying the command out).
    "tiny": MQARPreset(
        "tiny", vocab_size=32, pool_base=64, pool_update=80, pool_block=64, epochs=1, batch_size=16,
        lrs=(3e-3,), seeds=1, budget=256, width=16, base_widths=(16, 32), base_seq_len=32, base_num_pairs=4,
        test_examples=16, update_train=((32, 4, (0, 2)),), update_test_seq_len=32, update_test_pairs=4,
        update_test_updates=(0, 2, 4), block_seq_len=32, block_train_pairs=(2, 4), block_test_pairs=(2, 4, 6),
        chunk_size=16, eval_batch=16, checkpoint_every=0,
    ),
}


# -- the model ---------------------------------------------------------------------------------------
def mixer_kwargs(head: HeadConfig) -> dict[str, Any]:
    """Constructor keywords of the registry mixer ``head.mixer`` for a solved head configuration."""
    if head.form == "ssd":
        return {"num_heads": head.num_heads, "head_dim": head.value_dim, "state_size": head.key_dim}
    kwargs = {"num_heads": head.num_heads, "head_dim": head.key_dim, "expand_v": head.value_dim / head.key_dim}
    if head.form in ("bayes", "diagonal", "lowrank") and head.groups != 1:
        kwargs["groups"] = head.groups
    if head.form == "lowrank":
        kwargs.update(covariance="lowrank", rank=head.rank)
    return kwargs


def lowrank_rank(mixer: str) -> int | None:
    """``r`` of a ``bayesian_lowrank<r>`` name, else ``None``."""
    if isinstance(mixer, str) and mixer.startswith(LOWRANK_PREFIX) and mixer[len(LOWRANK_PREFIX):].isdigit():
        return int(mixer[len(LOWRANK_PREFIX):])
    return None


def mixer_label(mixer: str) -> str:
    """A mixer's name in tables and legends: the registry's label, a variant's or a low-rank BL's."""
    rank = lowrank_rank(mixer)
    if rank is not None:
        return f"BL low-rank r={rank}"
    return MIXER_LABELS.get(mixer, mixer)



def resolve_mixer(mixer: str) -> tuple[str, dict[str, Any]]:
    """``(registry layer, extra constructor keywords)`` of an MQAR mixer name: the BL and DeltaNet variants
    (``bayesian_noconv``, ``deltanet_noconv``) are built as their base layer with the variant's keywords,
    as the MQAR records spell them; every other name (``gated_deltanet_noconv`` included) as itself."""
    entry = MIXER_REGISTRY.get(mixer)
    if entry is not None and entry.base is not None and entry.base in _BUILT_AS_BASE:
        return entry.base, dict(entry.defaults)
    return mixer, {}


def gate_kwargs(layer: str, gate: str, layout: str) -> dict[str, Any]:
    """The ``use_gate`` keyword for ``layer`` under the ``gate`` setting (module docstring); ``{}``: the default."""
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not issubclass(MIXERS[layer], QKVMixer):  # Mamba-2: its gate belongs to the SSD block
        return {}
    if gate == "default":
        return {"use_gate": False} if layout == "hybrid" else {}
    return {"use_gate": gate == "on"}


def model_config(mixer: str, preset: MQARPreset, width: int) -> tuple[MQARModelConfig, HeadConfig]:
    """The model of ``mixer`` at ``width`` whose per-layer state fills ``preset.budget`` (solver's rule)."""
    rank = lowrank_rank(mixer)
    if rank is not None:
        layer, extra = "bayesian", {}
        head = solve_state_budget(preset.budget, width, LOWRANK_PREFIX, rank=rank)
    else:
        layer, extra = resolve_mixer(mixer)
        if budget_rule(layer) is None or layer not in MIXERS:
            raise ValueError(f"mixer {mixer!r} has no state-budget rule or no layer; use one of {known_mixers()} "
                             f"or {LOWRANK_PREFIX}<r>")
        head = solve_state_budget(preset.budget, width, layer)
    kwargs = {**mixer_kwargs(head), "chunk_size": preset.chunk_size, **extra,
              **gate_kwargs(layer, preset.gate, preset.layout)}
    cfg = MQARModelConfig(layer, preset.vocab_size, width, preset.num_layers, preset.mlp_mult, kwargs,
                          layout=preset.layout, conv_size=preset.hybrid_conv_size)
    return cfg, head


def build_model(mixer: str, preset: MQARPreset, width: int) -> MQARModel:
    """:func:`model_config` → :class:`MQARModel`, checking the built mixer carries the solved state."""
    cfg, head = model_config(mixer, preset, width)
    model = MQARModel(cfg)
    if model.state_size_per_layer() != head.state_size:
        raise RuntimeError(f"{mixer}: built layer carries {model.state_size_per_layer()} state floats but the "
                           f"solver counted {head.state_size} ({head.summary()})")
    return model


def known_mixers() -> list[str]:
    """Every name ``bayeslayer mqar --mixers`` takes: the registry mixers with a state-budget rule (the
    conv-free variants included)."""
    return sorted(n for n, entry in MIXER_REGISTRY.items() if entry.budget is not None)


# -- data and schedule -------------------------------------------------------------------------------
def train_tasks(task: str, preset: MQARPreset) -> list[MQARTask]:
    """The training mixture of ``task`` (each entry one pool segment of equal size)."""
    if task == "base":
        mixture = preset.base_train or ((preset.base_seq_len, preset.base_num_pairs),)
        return [MQARTask("base", seq_len, pairs) for seq_len, pairs in mixture]
    if task == "update":
        return [MQARTask("update", seq_len, pairs, u)
                for seq_len, pairs, updates in preset.update_train for u in updates]
    if task == "block":
        return [MQARTask("block", preset.block_seq_len, n, block_size=preset.block_size)
                for n in preset.block_train_pairs]
    raise ValueError(f"task must be one of {TASK_NAMES}, got {task!r}")


def epoch_sampler(train: MQARDataset, batch_size: int, data_seed: int, device: torch.device | str = "cpu"):
    """``sample_batch(step, batch_size, generator)`` for the harness: step ``s`` is a pure function of ``s``.

    Epoch ``e = s // n`` (``n`` full batches per epoch) shuffles the pool with seed ``(data_seed, e)``
    and step ``s`` takes its ``s mod n``-th batch, so a resumed run sees exactly the batches it would
    have seen (the harness's generator is not needed).  Batches are moved to ``device`` once per epoch.
    """
    per_epoch = train.num_batches(batch_size, drop_last=True)
    if per_epoch == 0:
        raise ValueError(f"batch_size={batch_size} is larger than every training segment "
                         f"({[len(s) for s in train.segments]} sequences)")
    cache: dict[int, list] = {}

    def sample_batch(step: int, size: int, generator: torch.Generator):
        if size != batch_size:
            raise ValueError(f"sampler built for batch_size={batch_size}, asked for {size}")
        epoch = step // per_epoch
        if epoch not in cache:
            cache.clear()
            cache[epoch] = [b.to(device) for b in train.batches(batch_size, shuffle=True,
                                                                seed=data_seed * 100_003 + epoch, drop_last=True)]
        return cache[epoch][step % per_epoch]

    sample_batch.steps_per_epoch = per_epoch
    return sample_batch


def train_config(preset: MQARPreset, steps: int) -> TrainConfig:
    warmup = preset.warmup_steps if preset.warmup_steps is not None else int(preset.warmup_fraction * steps)
    if preset.max_steps is not None and steps == preset.max_steps:  # capped: keep the warmup a fraction
        warmup = min(warmup, int(preset.warmup_fraction * steps))
    warmup = min(warmup, steps - 1) if steps > 1 else 0
    return TrainConfig(steps=steps, batch_size=preset.batch_size, lr=preset.lrs[0], betas=preset.betas,
                       weight_decay=preset.weight_decay, grad_clip=preset.grad_clip, warmup_steps=warmup,
                       checkpoint_every=preset.checkpoint_every)


def __getattr__(name: str):
    # the variant tables this module had: the mixer registry carries variants and labels now
    if name in ("MIXER_VARIANTS", "VARIANT_LABELS"):
        import warnings

        warnings.warn(f"{name} is deprecated; the variants are entries of bayeslayer.layers.MIXER_REGISTRY "
                      "(base, defaults, label)", DeprecationWarning, stacklevel=2)
        variants = {n: e for n, e in MIXER_REGISTRY.items() if e.base in _BUILT_AS_BASE}
        if name == "MIXER_VARIANTS":
            return {n: (e.base, dict(e.defaults)) for n, e in variants.items()}
        return {n: e.label for n, e in variants.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
