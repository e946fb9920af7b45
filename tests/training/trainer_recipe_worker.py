"""One rank of docs/distributed.md's Hugging Face Trainer recipe (``<!-- recipe: trainer-fsdp -->``), run as written.

``python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.training.trainer_recipe_worker OUT ENGINE``
in the folder the recipe's ``runs/`` goes to; ``ENGINE`` is ``fsdp`` (Accelerate's FSDP path, which it takes on
the CPU only with :func:`~tests.training.accelerate_cpu.take_fsdp_path_on_cpu`) or ``accelerate-cpu``
(Accelerate as it is on the CPU: DDP).  Each rank writes ``OUT/rank<r>.json``: what Accelerate did with the
model, the logged losses and the bytes of parameters and AdamW state this rank holds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
ENGINES = ("fsdp", "accelerate-cpu")


def main(out: str, engine: str) -> None:
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from bayeslayer.training.parallel import local_bytes
    from tests.test_contributing import recipe

    from .accelerate_cpu import take_fsdp_path_on_cpu

    if engine not in ENGINES:
        raise SystemExit(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "fsdp":
        take_fsdp_path_on_cpu()
    namespace = {"__name__": "bayeslayer_recipe_trainer_fsdp"}
    exec(compile(recipe("trainer-fsdp", DOC), "<docs/distributed.md recipe trainer-fsdp>", "exec"), namespace)
    trainer = namespace["trainer"]
    wrapped = trainer.model_wrapped
    params = list(wrapped.parameters())
    moments = [t for state in trainer.optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0]  # exp_avg, exp_avg_sq (not the step counts)
    result = {
        "rank": int(os.environ["RANK"]),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "wrapper": type(wrapped).__name__,
        "fsdp_units": [name for name, m in wrapped.named_modules() if isinstance(m, FSDPModule)],
        "dtensor_params": sum(isinstance(p, DTensor) for p in params),
        "params": len(params),
        "param_bytes": local_bytes(params),
        "full_param_bytes": sum(p.numel() * p.element_size() for p in params),
        "adam_bytes": local_bytes(moments),
        "losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
        "steps": trainer.state.global_step,
    }
    Path(out, f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
