"""An LM run directory: train a causal LM into it (:func:`train_lm`, resumable) and read its model back
(:func:`load_run`).  ``lm train`` and ``distill train`` (with its own :class:`Objective`) both train here.

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
``gloo`` backend is used on CPU, ``nccl`` on CUDA.  With ``--context-parallel C`` (``context_parallel=``)
each window is split along T over ``C`` consecutive ranks (docs/context_parallel.md): every rank reads
its slice of the window and the token after it, its loss is its share of the window's loss, and the
``N / C`` groups are data-parallel replicas of one another.  Evaluation runs whole windows on every rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...checks import check_int
from ...data.text.windows import WindowSchedule
from ...files import append_text, atomic_write_text, publish_directory, read_json, remove_stale_temporaries
from ...training import CheckpointStore, OutputLock
from ...training.distributed import DistContext, init_distributed, resolve_precision
from ...training.loop import Checkpoints, LoopState, StepInfo, train_loop
from ...training.optim import DECAY_POLICY
from .harness import seed_everything, weights_digest
from .lm_config import LMConfig
from .provenance import write_record

# Fields that may change when a run is resumed: they never change the loss trajectory.
_BOOKKEEPING = frozenset({"eval_every", "eval_windows", "eval_batch_size", "checkpoint_every", "log_every"})
SINGLE_PROCESS = DistContext()  # the default context: one process on the CPU

def load_corpus(config: LMConfig, ctx: DistContext = SINGLE_PROCESS, *, cache_dir: str | None = None,
                splits: Sequence[str] = ("train", "validation", "test")):
    """The run's tokenized corpus; rank 0 tokenizes (or finds the cache) first, then every rank reads it."""
    from ...data.text import load_text_corpus

    def load():
        return load_text_corpus(config.source, tokenizer=config.tokenizer, vocab_size=config.vocab_size,
                                cache_dir=cache_dir, splits=splits)

    if ctx.distributed:
        if ctx.is_main:
            load()
        ctx.barrier()
    return load()

def build_model(config: LMConfig, vocab_size: int, eos_id: int | None = None):
    """A freshly initialised :class:`BayesLayerForCausalLM` for ``config`` (seed torch first)."""
    from ...models import BayesLayerConfig, BayesLayerForCausalLM

    mixer_kwargs = {config.mixer: dict(config.mixer_kwargs)} if config.mixer_kwargs else None
    model_config = BayesLayerConfig(
        vocab_size=vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_heads=config.num_heads, head_dim=config.head_dim, mixer=config.mixer, mixer_kwargs=mixer_kwargs,
        mlp_dropout=config.mlp_dropout, bos_token_id=None, eos_token_id=eos_id, pad_token_id=None,
        use_cache=False,
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
            from ...ops import CPContext

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
        from ...models.modeling import loss_dtype

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
    from ...ops import CPContext

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

    def context_parallel(self, trainee: torch.nn.Module, config: LMConfig, ctx: DistContext) -> torch.nn.Module:
        """``trainee`` for this rank's slice of each window of ``ctx``'s context-parallel group (called on
        every rank of the job, before training starts).  A next-token trainee whose model has a
        context-parallel path (:meth:`~bayeslayer.models.BayesLayerForCausalLM.context_parallel_conv_size`,
        which refuses other mixers by name) is rebuilt with a context; other trainees are refused."""
        from ...ops import build_cp_context

        if not isinstance(ctx, DistContext) or not ctx.context_parallel:
            raise ValueError("ctx must be a DistContext with a context-parallel group (cp_size > 1, from "
                             "init_distributed(..., context_parallel=C))")
        if type(trainee) is not NextTokenTrainee or not hasattr(trainee.model, "context_parallel_conv_size"):
            raise ValueError(f"objective {self.name!r} has no context-parallel path (only next-token training of "
                             "a BayesLayerForCausalLM has one); run it without --context-parallel")
        width = trainee.model.context_parallel_conv_size()
        cp = build_cp_context(total_len=config.seq_len, group=ctx.cp_group, conv1d_kernel_size=width)
        return NextTokenTrainee(trainee.model, cp)

    def finish(self, trainee: torch.nn.Module) -> dict:
        """Checks of the trained model (raise on failure) and facts for ``train_summary.json``."""
        return {}

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
    context_parallel: int = 1,
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
        context_parallel: ranks that share each window, split along T (1: none; docs/context_parallel.md).
            The job's ranks form groups of this many consecutive ranks; the groups are data-parallel
            replicas (``batch_size`` must be a multiple of ``micro_batch_size`` × the number of groups).
            Every mixer must have a context-parallel path: others are refused by name before training.

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
    check_int("context_parallel", context_parallel, minimum=1)
    ctx = init_distributed(device, context_parallel=context_parallel)
    replicas = ctx.dp_size
    if config.batch_size % (config.micro_batch_size * replicas) != 0:
        what = "world size" if not ctx.context_parallel else "data-parallel replicas (world size / context_parallel)"
        raise ValueError(f"batch_size ({config.batch_size}) must be a multiple of micro_batch_size × {what} "
                         f"({config.micro_batch_size} × {replicas})")
    n_micro = config.batch_size // (config.micro_batch_size * replicas)
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
        self.context_parallel = 1
        self.seconds_before = 0.0  # training time of earlier calls (from the checkpoint)

    def accept(self, checkpoint: Path, state: dict) -> bool:
        _check_resume_config(json.loads(state["config"]), self.config, checkpoint)
        return True

    def write_weights(self, directory: Path) -> None:
        from ...models.loading import save_model_dir

        save_model_dir(self.model, directory)

    def read_weights(self, directory: Path) -> None:
        from ...models.loading import load_model_weights

        load_model_weights(self.model, directory)

    def extra_state(self, state: LoopState) -> dict:
        return {"train_seconds": self.seconds_before + state.seconds, "config": json.dumps(self.config.to_json()),
                "world_size": self.world_size, "context_parallel": self.context_parallel,
                "tokens": state.step * self.config.tokens_per_step}

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
    if ctx.context_parallel:  # refuses a mixer without a context-parallel path before anything is written
        trainee = objective.context_parallel(trainee, config, ctx)
    if ctx.is_main:  # the inputs are valid (corpus loaded, model built): record what this run is
        write_record(config_path, config.to_json(), device=ctx.device, seeds=[config.seed],
                     optimizer_groups=DECAY_POLICY)
        _check_objective(run_dir, objective, write=True, device=ctx.device, seed=config.seed)

    log = _JsonLog(run_dir / "log.jsonl", ctx.is_main)
    checkpoints = _LMCheckpoints(store, model, config, world)
    checkpoints.context_parallel = ctx.cp_size
    cp = getattr(trainee, "cp_context", None)
    window_losses: list[float] = []

    def micro_batches(step: int) -> list[torch.Tensor]:
        return rank_micro_batches(train_windows, schedule, step, ctx, config.micro_batch_size, n_micro, cp)

    def after_start(state: LoopState) -> None:
        if state.resumed_from is not None:
            log.truncate_after(state.step)
            log.write(event="resume", step=state.step, world_size=world, time=time.time())
        else:
            log.truncate_after(-1)
            log.write(event="start", step=0, world_size=world, context_parallel=ctx.cp_size, device=str(ctx.device),
                      time=time.time(), parameters=_param_counts(model), config=config.to_json())

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
        from ...evaluation.perplexity import grouped_perplexity

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
    from ...models import count_parameters

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
        "steps": result.step, "tokens": result.tokens, "world_size": ctx.world_size,
        "context_parallel": ctx.cp_size, "device": str(ctx.device),
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
    from ...models.loading import read_model_config, verify_model_dir

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

    from ...evaluation.tasks import hf_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        hf_tokenizer(tokenizer).save_pretrained(tmp)
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (Path(tmp) / name).is_file():
                (Path(directory) / name).write_bytes((Path(tmp) / name).read_bytes())

def _write_final(directory: Path, model, config: LMConfig, objective: Objective, tokenizer) -> None:
    from ...models.loading import save_model_dir

    save_model_dir(model, directory)
    (directory / "lm_config.json").write_text(json.dumps(config.to_json(), indent=1) + "\n")
    (directory / "objective.json").write_text(json.dumps(objective.describe(), indent=1) + "\n")
    if tokenizer is not None:  # the model directory is self-contained (NIAH, lm-eval, from_pretrained)
        tokenizer.save(str(directory / "tokenizer.json"))
        write_tokenizer_config(tokenizer, directory)
    from ...models.loading import write_model_manifest

    write_model_manifest(directory)  # last: every loader of the package verifies it

def load_run(run_dir: str | os.PathLike, *, device: str | torch.device = "cpu"):
    """``(LMConfig, model)`` of a finished run (its ``final/`` directory), model in eval mode."""
    run_dir = Path(run_dir)
    final = run_dir / "final"
    if not (final / "model.safetensors").is_file() or not (final / "lm_config.json").is_file():
        raise FileNotFoundError(f"{run_dir} has no finished model (final/model.safetensors and "
                                "final/lm_config.json); train it to the end first")
    from ...models import BayesLayerConfig, BayesLayerForCausalLM
    from ...models.loading import check_finite, load_model_weights, read_model_config, verify_model_dir

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


__all__ = ["SINGLE_PROCESS", "LMTrainResult", "NextTokenTrainee", "Objective", "build_model", "checkpoint_store",
           "cp_window_slice", "latest_checkpoint", "load_corpus", "load_run", "rank_micro_batches",
           "train_lm", "write_tokenizer_config"]
