"""The end of an LM run (:func:`bayeslayer.experiments.common.lm_run.train_lm`): :func:`finish_run` checks that
every rank ended with the same weights (or gathers the shards), writes ``final/`` (a Hugging Face model folder with
the tokenizer, the run's ``lm_config.json`` and ``objective.json`` and a manifest, published atomically) and
``train_summary.json``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch.distributed as dist

from ...evaluation.tasks import write_tokenizer_config
from ...files import publish_directory, read_json
from ...training.distributed import DistContext
from ...training.lm import Objective
from ...training.lm_config import LMConfig
from ...training.optim import DECAY_POLICY
from ...training.parallel import local_bytes, unsharded_copy
from ...training.state import weights_digest
from .provenance import write_record


def param_counts(model) -> dict:
    """The model's parameter counts (:func:`bayeslayer.models.count_parameters`) as a dict."""
    from ...models import count_parameters

    return count_parameters(model)._asdict()

def finish_run(run_dir: Path, model, config: LMConfig, result, ctx: DistContext,
                  seconds_before: float, *, objective: Objective, checks: dict, tokenizer=None,
               compute: dict | None = None, shard: str = "none") -> dict:
    """Write ``final/`` (HF model dir with ``tokenizer.json``) and ``train_summary.json`` of the finished run whose
    :class:`~bayeslayer.experiments.common.lm_run.LMTrainResult` is ``result``; check that all ranks agree
    (replicated weights) or gather the shards (``shard="fsdp"``: rank 0 writes the whole model)."""
    stored = local_bytes(model.parameters())  # this rank's parameter storage (its shards, when sharded)
    per_rank = [stored]
    if ctx.distributed:
        per_rank = [None] * ctx.world_size
        dist.all_gather_object(per_rank, stored)
    whole = unsharded_copy(model)  # collective when sharded; None on the other ranks
    digest = weights_digest(whole) if whole is not None else None
    digests = [digest]
    if ctx.distributed:
        digests = [None] * ctx.world_size
        dist.all_gather_object(digests, digest)
    if shard == "fsdp" and ctx.distributed:
        digest, digests = digests[0], [digests[0]]  # one copy of the weights, gathered on rank 0
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks ended with different weights (digests {digests}); DDP went out of sync")
    total_seconds = seconds_before + result.seconds
    n = len(result.losses)
    summary = {
        "label": config.model_label, "mixer": config.mixer, "preset": config.preset, "seed": config.seed,
        "match": config.model.match, "mixer_kwargs": config.mixer_kwargs,
        "steps": result.step, "tokens": result.tokens, "world_size": ctx.world_size,
        "context_parallel": ctx.cp_size, "shard": shard, "parameter_bytes_per_rank": per_rank,
        "device": str(ctx.device),
        "train_seconds": total_seconds, "train_cpu_seconds": result.step_cpu_seconds,
        "tokens_per_second": result.tokens / total_seconds if total_seconds else 0.0,
        "parameters": param_counts(model), "final_train_loss": float(np.mean(result.losses[-max(1, n // 10):])),
        "validation": result.evals[-1]["groups"] if result.evals else {}, "weights_sha256": digest,
        "rank_weights_sha256": digests, "objective": objective.describe(), **checks,
    }
    if config.compute_match != "steps":
        summary["compute_match"] = config.compute_match
        summary["compute"] = {**(compute or {}), "cpu_seconds": result.step_cpu_seconds, "wall_seconds": total_seconds}
    if ctx.is_main:
        _report_damaged_final(run_dir / "final")
        publish_directory(run_dir / "final", lambda tmp: _write_final(tmp, whole, config, objective, tokenizer))
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

