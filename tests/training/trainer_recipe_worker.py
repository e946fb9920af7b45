"""One rank of docs/distributed.md's Hugging Face Trainer recipes (``<!-- recipe: trainer-fsdp -->`` and
``<!-- recipe: trainer-fsdp-packed -->``), run as written.

``python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.training.trainer_recipe_worker OUT ENGINE
RECIPE...`` in the folder the recipes' ``runs/`` go to; ``ENGINE`` is ``fsdp`` (Accelerate's FSDP path, which it
takes on the CPU only with :func:`~tests.training.accelerate_cpu.take_fsdp_path_on_cpu`) or ``accelerate-cpu``
(Accelerate as it is on the CPU: DDP).  The recipes run one after the other in the same processes.  For each,
every rank writes ``OUT/<recipe>-rank<r>.json``: what Accelerate did with the model, the logged losses, the bytes
of parameters and AdamW state this rank holds, and what the model's first forward pass (the initial weights)
received and returned: the batch the collator built, the loss, the logits.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
ENGINES = ("fsdp", "accelerate-cpu")
RECIPES = ("trainer-fsdp", "trainer-fsdp-packed")


def main(out: str, engine: str, *names: str) -> None:
    if engine not in ENGINES:
        raise SystemExit(f"engine must be one of {ENGINES}, got {engine!r}")
    if not names or not set(names) <= set(RECIPES):
        raise SystemExit(f"recipes must be some of {RECIPES}, got {names!r}")
    if engine == "fsdp":
        from .accelerate_cpu import take_fsdp_path_on_cpu

        take_fsdp_path_on_cpu()
    for name in names:
        run(out, name)


def run(out: str, name: str) -> None:
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from bayeslayer.models import BayesLayerForCausalLM
    from bayeslayer.training.parallel import local_bytes
    from tests.test_contributing import recipe

    first = {}

    def record_first_forward(module, args, kwargs, output):
        if isinstance(module, BayesLayerForCausalLM) and not first:
            first.update({key: kwargs[key].tolist() for key in ("input_ids", "labels", "position_ids")
                          if key in kwargs})
            items = kwargs.get("num_items_in_batch")
            first["num_items_in_batch"] = None if items is None else int(items)
            first["loss"] = float(output.loss)
            first["logits"] = output.logits.detach().float().tolist()

    hook = torch.nn.modules.module.register_module_forward_hook(record_first_forward, with_kwargs=True)
    namespace = {"__name__": f"bayeslayer_recipe_{name.replace('-', '_')}"}
    try:
        exec(compile(recipe(name, DOC), f"<docs/distributed.md recipe {name}>", "exec"), namespace)
    finally:
        hook.remove()
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
        "first_forward": first,
    }
    Path(out, f"{name}-rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
