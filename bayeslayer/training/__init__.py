"""How the package trains: the one loop and what it keeps on disk.

Its files are written with :mod:`bayeslayer.files`, the package's one atomic, durable writer.

* :mod:`~bayeslayer.training.loop` — :func:`~bayeslayer.training.loop.train_loop`, the one training loop
  (objective, parameter groups, schedule, accumulation, precision, clipping, evaluation hook,
  checkpoints, Ctrl-C, DDP) that every experiment's training calls, and its :class:`TrainConfig`;
* :mod:`~bayeslayer.training.distributed` — the distributed context (the job's ``(dp, cp)`` DeviceMesh) and the
  autocast precision;
* :mod:`~bayeslayer.training.parallel` — sharding with FSDP2 (:func:`~bayeslayer.training.parallel.shard_model`)
  and its mixed precision, and :mod:`~bayeslayer.training.sharded_state` the sharded checkpoints
  (``torch.distributed.checkpoint`` in safetensors) that load on any number of ranks;
* :mod:`~bayeslayer.training.titan` — torchtitan's model spec for bayeslayer models (optional torchtitan);
* :mod:`~bayeslayer.training.optim` — AdamW parameter groups (what weight decay may touch);
* :mod:`~bayeslayer.training.state` — training state as JSON + safetensors (no pickle), the
  RNG states of Python, NumPy and torch, seeding and a model's weights digest;
* :mod:`~bayeslayer.training.checkpoint` — crash-safe checkpoint folders with a SHA-256 manifest,
  verified on load, falling back to an older checkpoint when the newest is damaged;
* :mod:`~bayeslayer.training.lock` — one writer per output folder (``fcntl`` lock naming the holder), taken by
  every command that writes (:func:`~bayeslayer.training.lock.lock_output`);
* :mod:`~bayeslayer.training.interrupt` — Ctrl-C stops after the step with a checkpoint;
* :mod:`~bayeslayer.training.lm` — causal-LM training on windows of tokens with data and context parallelism
  (:func:`~bayeslayer.training.lm.train_on_windows`, the trainees and objectives), and
  :mod:`~bayeslayer.training.lm_config` its run configuration;
* :mod:`~bayeslayer.training.distillation` — the retrofit's losses, trainees, objective and teacher.
"""

from .checkpoint import CheckpointError, CheckpointStore, verify_checkpoint
from .interrupt import StopRequest, TrainingInterrupted, stop_on_interrupt
from .lock import FolderBusyError, OutputLock, lock_output
from .state import decode_state, encode_state, load_state, rng_state, save_state, set_rng_state

__all__ = [
    "CheckpointError", "CheckpointStore", "FolderBusyError", "OutputLock", "StopRequest", "TrainingInterrupted",
    "decode_state", "encode_state", "load_state", "lock_output", "rng_state", "save_state", "set_rng_state",
    "stop_on_interrupt", "verify_checkpoint",
]
