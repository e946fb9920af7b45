"""Training a causal language model on windows of tokens, with data and context parallelism.

The pieces every LM training of the package is made of (``lm train`` and the retrofit's stages through
the run folder of :mod:`bayeslayer.experiments.common.lm_run`, and any script of yours):

* a **trainee**: an ``nn.Module`` whose ``forward(input_ids [b, L])`` is the loss and whose ``.model``
  is the causal LM being trained; :class:`NextTokenTrainee` is next-token cross-entropy,
  ``loss = mean_t CE(logits_t, x_{t+1})`` over the ``L − 1`` predictions of each window;
* :func:`train_on_windows`: :func:`~bayeslayer.training.loop.train_loop` over the rows of a window array.
  The global batch is ``batch_size`` windows; with ``W`` data-parallel replicas each rank runs
  ``batch_size / (W · micro_batch_size)`` micro-batches (:func:`micro_batches_per_step`) and accumulates
  gradients, so the update does not depend on ``W``.  Window order is a fixed permutation per epoch drawn
  from ``(seed, epoch)`` (:class:`~bayeslayer.data.text.windows.WindowSchedule`) and the step-``s`` batch
  is the global sample indices ``[s·B, (s+1)·B)`` of that sequence (:func:`rank_micro_batches`), so the
  data position is a pure function of the step and a resumed run reads exactly the windows an
  uninterrupted one would;
* context parallelism (docs/context_parallel.md): with a
  :class:`~bayeslayer.training.distributed.DistContext` of ``C``-rank groups
  (``init_distributed(..., context_parallel=C)``), :func:`context_parallel` makes the trainee run this
  rank's slice of each window (:func:`cp_window_slice`: its slice and the token after it) and return its
  share of the window's loss; the groups are data-parallel replicas of one another;
* an :class:`Objective`: what a run folder trains (the trainee it builds, its parameter groups, a check
  at the end); the default is from-scratch next-token training of :func:`build_model`, and
  :mod:`bayeslayer.training.distillation` adds the retrofit's stages.

A run's configuration is :class:`~bayeslayer.training.lm_config.LMConfig`; :func:`load_corpus` and
:func:`build_model` turn it into the tokenized corpus and the fresh model, and :func:`load_run` reads a finished
run's model back.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..checks import check_int
from ..data.text.windows import WindowSchedule
from ..files import read_json
from .distributed import DistContext
from .lm_config import LMConfig
from .loop import LoopState, TrainConfig, train_loop

SINGLE_PROCESS = DistContext()  # the default context: one process on the CPU


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


def build_model(config: LMConfig, vocab_size: int, eos_id: int | None = None):
    """A freshly initialised :class:`BayesLayerForCausalLM` for ``config`` (seed torch first).

    Its config keeps ``use_cache=True`` (the default), so ``generate()`` on the saved model decodes on the
    recurrent cache; training is not affected (a model in training mode keeps no cache unless asked)."""
    from ..models import BayesLayerConfig, BayesLayerForCausalLM

    mixer_kwargs = {config.mixer: dict(config.mixer_kwargs)} if config.mixer_kwargs else None
    model_config = BayesLayerConfig(
        vocab_size=vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_heads=config.num_heads, head_dim=config.head_dim, mixer=config.mixer, mixer_kwargs=mixer_kwargs,
        mlp_dropout=config.mlp_dropout, bos_token_id=None, eos_token_id=eos_id, pad_token_id=None,
    )
    return BayesLayerForCausalLM(model_config)


class NextTokenTrainee(torch.nn.Module):
    """Wraps a causal LM so that ``forward(input_ids)`` is the training loss (what DDP wraps).

    ``loss = mean_t CE(logits_t, x_{t+1})``; ``.model`` is the part that is checkpointed.

    With a ``cp_context`` (:func:`bayeslayer.ops.build_cp_context` over windows of ``T`` tokens) the
    trainee runs this rank's slice of each window (:func:`cp_window_slice` gives it: the slice and the
    token after it) and returns this rank's share of the loss: the summed cross-entropy of the slice's
    predictions divided by the global count ``b·(T − 1)``, so the shares of the group's ranks add up to
    the one-process loss.  The windows of a micro-batch run one after another (the context holds one
    sequence).
    """

    def __init__(self, model: torch.nn.Module, cp_context=None) -> None:
        super().__init__()
        self.model = model
        if cp_context is not None:
            from ..ops import CPContext

            if not isinstance(cp_context, CPContext):
                raise TypeError(f"cp_context must be a CPContext (from build_cp_context), got "
                                f"{type(cp_context).__name__}")
            if len(cp_context.cu) != 2:
                raise ValueError("cp_context must hold one sequence (a window): build it with total_len=seq_len")
        self.cp_context = cp_context

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.cp_context is None:
            return self.model(input_ids=input_ids, labels=input_ids).loss
        return self._cp_loss(input_ids)

    def _cp_loss(self, ids: torch.Tensor) -> torch.Tensor:
        from ..models.modeling import loss_dtype

        cp = self.cp_context
        n_in, T = cp.local_len, cp.bounds[-1]
        n_out = min(cp.bounds[cp.rank + 1], T - 1) - cp.start  # this slice's positions that have a next token
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != n_out + 1:
            raise ValueError(f"input_ids must be [b, {n_out + 1}] (rank {cp.rank}'s slice of a {T}-token window "
                             f"and the token after it, from cp_window_slice), got "
                             f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        total = None
        for window in ids:
            logits = self.model(input_ids=window[None, :n_in], cp_context=cp).logits
            ce = torch.nn.functional.cross_entropy(logits[0, :n_out].to(loss_dtype(logits.dtype)),
                                                   window[1:n_out + 1], reduction="sum")
            total = ce if total is None else total + ce
        return total / (ids.shape[0] * (T - 1))


def cp_window_slice(windows: torch.Tensor, cp_context) -> torch.Tensor:
    """This rank's part of whole windows ``[b, T]`` for a context-parallel :class:`NextTokenTrainee`: its
    slice ``bounds[r] .. bounds[r+1] − 1`` and the token after it (the last rank has none)."""
    from ..ops import CPContext

    if not isinstance(cp_context, CPContext):
        raise TypeError(f"cp_context must be a CPContext (from build_cp_context), got {type(cp_context).__name__}")
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.shape[1] != cp_context.bounds[-1]:
        raise ValueError(f"windows must be [b, {cp_context.bounds[-1]}] (the context's length), got "
                         f"{tuple(windows.shape) if isinstance(windows, torch.Tensor) else type(windows).__name__}")
    a, b = cp_context.start, cp_context.bounds[cp_context.rank + 1]
    return windows[:, a:b + 1]


def rank_micro_batches(windows, schedule: WindowSchedule, step: int, ctx: DistContext, micro_batch_size: int,
                       n_micro: int, cp_context=None) -> list[torch.Tensor]:
    """This rank's ``n_micro`` micro-batches of optimiser step ``step``: the windows ``schedule`` gives its
    data-parallel replica (``ctx.dp_rank`` of ``ctx.dp_size``), ``micro_batch_size`` per micro-batch, on
    ``ctx.device``; with a ``cp_context``, this rank's slice of each (:func:`cp_window_slice`)."""
    if not isinstance(schedule, WindowSchedule):
        raise TypeError(f"schedule must be a WindowSchedule, got {type(schedule).__name__}")
    if not isinstance(ctx, DistContext):
        raise TypeError(f"ctx must be a DistContext, got {type(ctx).__name__}")
    check_int("step", step, minimum=0)
    check_int("micro_batch_size", micro_batch_size, minimum=1)
    check_int("n_micro", n_micro, minimum=1)
    if n_micro * micro_batch_size * ctx.dp_size != schedule.batch_size:
        raise ValueError(f"n_micro × micro_batch_size × ctx.dp_size ({n_micro} × {micro_batch_size} × {ctx.dp_size}) "
                         f"must be the schedule's batch_size ({schedule.batch_size})")
    mine = schedule.step_windows(step, ctx.dp_rank, ctx.dp_size)
    batches = [torch.from_numpy(np.asarray(windows[mine[i * micro_batch_size:(i + 1) * micro_batch_size]],
                                           dtype=np.int64)).to(ctx.device)
               for i in range(n_micro)]
    return batches if cp_context is None else [cp_window_slice(b, cp_context) for b in batches]



def _has_context_parallel_path(trainee) -> bool:
    return type(trainee) is NextTokenTrainee and hasattr(trainee.model, "context_parallel_conv_size")


def context_parallel(trainee: torch.nn.Module, seq_len: int, ctx: DistContext) -> NextTokenTrainee:
    """``trainee`` for this rank's slice of each ``seq_len``-token window of ``ctx``'s context-parallel group.

    Call it on every rank of the job, before training starts.  Only a :class:`NextTokenTrainee` whose model
    has a context-parallel path (:meth:`~bayeslayer.models.BayesLayerForCausalLM.context_parallel_conv_size`,
    which refuses other mixers by name) has one: it is rebuilt around the same model with a
    :func:`~bayeslayer.ops.build_cp_context` over windows of ``seq_len`` tokens.
    """
    from ..ops import build_cp_context

    if not isinstance(ctx, DistContext) or not ctx.context_parallel:
        raise ValueError("ctx must be a DistContext with a context-parallel group (cp_size > 1, from "
                         "init_distributed(..., context_parallel=C))")
    seq_len = check_int("seq_len", seq_len, minimum=2)
    if not _has_context_parallel_path(trainee):
        raise ValueError(f"trainee must be a NextTokenTrainee of a BayesLayerForCausalLM (the one trainee with a "
                         f"context-parallel path), got {type(trainee).__name__}")
    width = trainee.model.context_parallel_conv_size()
    cp = build_cp_context(total_len=seq_len, group=ctx.cp_group, conv1d_kernel_size=width)
    return NextTokenTrainee(trainee.model, cp)


def micro_batches_per_step(batch_size: int, micro_batch_size: int, ctx: DistContext) -> int:
    """How many micro-batches of ``micro_batch_size`` windows each rank runs per optimiser step of
    ``batch_size`` windows (all data-parallel replicas of ``ctx`` together)."""
    if not isinstance(ctx, DistContext):
        raise TypeError(f"ctx must be a DistContext, got {type(ctx).__name__}")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    micro_batch_size = check_int("micro_batch_size", micro_batch_size, minimum=1)
    replicas = ctx.dp_size
    if batch_size % (micro_batch_size * replicas) != 0:
        what = "world size" if not ctx.context_parallel else "data-parallel replicas (world size / context_parallel)"
        raise ValueError(f"batch_size ({batch_size}) must be a multiple of micro_batch_size × {what} "
                         f"({micro_batch_size} × {replicas})")
    return batch_size // (micro_batch_size * replicas)


def train_on_windows(trainee: torch.nn.Module, windows: np.ndarray, config: TrainConfig, *,
                     ctx: DistContext | None = None, micro_batch_size: int = 1, **loop_options) -> LoopState:
    """Train ``trainee`` on the rows of ``windows [N, L]`` (integer token ids) for ``config.steps`` steps.

    Every step takes ``config.batch_size`` windows of the epoch's permutation (module docstring), shares
    them out over ``ctx``'s data-parallel replicas in micro-batches of ``micro_batch_size`` and, for a
    context-parallel trainee (:func:`context_parallel`), gives each rank its slice of every window.  Every
    rank of the job calls it with the same ``windows``.  ``loop_options`` are
    :func:`~bayeslayer.training.loop.train_loop`'s keyword arguments (``groups``, ``autocast_dtype``,
    ``checkpoints``, ``evaluate``, ``progress``, ...).  Returns the loop's
    :class:`~bayeslayer.training.loop.LoopState`.
    """
    ctx = SINGLE_PROCESS if ctx is None else ctx
    if not isinstance(windows, np.ndarray) or windows.ndim != 2 or not np.issubdtype(windows.dtype, np.integer):
        raise ValueError(f"windows must be a 2-D integer numpy array [N, L], got "
                         f"{getattr(windows, 'dtype', type(windows).__name__)} {getattr(windows, 'shape', '')}")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    n_micro = micro_batches_per_step(config.batch_size, micro_batch_size, ctx)
    cp = getattr(trainee, "cp_context", None)
    if ctx.context_parallel and cp is None:
        raise ValueError("ctx has a context-parallel group: give the trainee context_parallel(trainee, seq_len, ctx)")
    schedule = WindowSchedule(windows.shape[0], config.batch_size, config.seed)
    return train_loop(trainee, lambda step: rank_micro_batches(windows, schedule, step, ctx, micro_batch_size, n_micro,
                                                                cp),
                      lambda module, ids: module(ids), config, ctx=ctx, **loop_options)


class Objective:
    """What a run folder trains (:func:`bayeslayer.experiments.common.lm_run.train_lm`): its loop is the same
    for every objective.

    An objective builds the *trainee*, an ``nn.Module`` whose ``forward(input_ids [b, L])``
    returns the loss (or ``(loss, {name: float})`` with parts to log) and whose ``.model``
    is the causal LM that is checkpointed, evaluated and saved in ``final/``; it names the
    optimiser's parameter groups; it may check the trained model at the end
    (:meth:`finish`).  This default is from-scratch next-token training of
    :func:`build_model`; :mod:`bayeslayer.training.distillation` adds the retrofit's Phase A,
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

    def context_parallel(self, trainee: torch.nn.Module, config: LMConfig, ctx: DistContext) -> torch.nn.Module:
        """``trainee`` for this rank's slice of each window of ``ctx``'s context-parallel group (called on
        every rank of the job, before training starts).  A next-token trainee whose model has a
        context-parallel path (:meth:`~bayeslayer.models.BayesLayerForCausalLM.context_parallel_conv_size`,
        which refuses other mixers by name) is rebuilt with a context; other trainees are refused."""
        if isinstance(ctx, DistContext) and ctx.context_parallel and not _has_context_parallel_path(trainee):
            raise ValueError(f"objective {self.name!r} has no context-parallel path (only next-token training of "
                             "a BayesLayerForCausalLM has one); run it without --context-parallel")
        return context_parallel(trainee, config.seq_len, ctx)

    def finish(self, trainee: torch.nn.Module) -> dict:
        """Checks of the trained model (raise on failure) and facts for ``train_summary.json``."""
        return {}

    def shard_unsupported(self) -> str | None:
        """Why this objective cannot train sharded (``shard="fsdp"``), or ``None``: its trainee must run its
        models only through their forward passes, where FSDP gathers each block's parameters."""
        return None



def load_run(run_dir: str | os.PathLike, *, device: str | torch.device = "cpu"):
    """``(LMConfig, model)`` of a finished LM run (its ``final/`` folder: an HF model folder and the run's
    ``lm_config.json``, written by :func:`bayeslayer.experiments.common.lm_run.train_lm`), model in eval mode."""
    from ..models.loading import naming_config, refuse_pickle_weights

    run_dir = Path(run_dir)
    final = run_dir / "final"
    refuse_pickle_weights(final)
    if not (final / "model.safetensors").is_file() or not (final / "lm_config.json").is_file():
        raise FileNotFoundError(f"{run_dir} has no finished model (final/model.safetensors and "
                                "final/lm_config.json); train it to the end first")
    from ..models import BayesLayerConfig, BayesLayerForCausalLM
    from ..models.loading import check_finite, load_model_weights, read_model_config, verify_model_dir

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
    with naming_config(final):
        model = BayesLayerForCausalLM(model_config)
    load_model_weights(model, final)
    check_finite(model, final)
    return config, model.to(device).eval()

__all__ = ["SINGLE_PROCESS", "NextTokenTrainee", "Objective", "build_model", "context_parallel", "cp_window_slice",
           "load_corpus", "load_run", "micro_batches_per_step", "rank_micro_batches", "train_on_windows"]
