"""One rank of a torchtitan job on the bayeslayer model spec (``bayeslayer.training.titan``), on gloo.

``python -m torch.distributed.run --standalone --nproc_per_node N -m tests.training.titan_worker OUT``: builds the
``bayeslayer_debug`` trainer config (a small flavor, fp32), the model on the meta device, torchtitan's
``ParallelDims`` and meshes, the spec's ``parallelize_fn``, the weights (``init_weights``), torchtitan's AdamW and
its cross-entropy loss normalised by the batch's tokens, as torchtitan's ``Trainer`` does; then trains
:data:`STEPS` steps on the same global batches whatever ``N`` (each rank its slice).  torchtitan's ``Trainer``
itself needs an accelerator (it calls ``torch.cuda.set_device``), and torchtitan builds its meshes on ``cuda``
when it finds none: the meshes are built on the CPU here, the only change to torchtitan.  Rank 0 writes
``OUT/record.json`` (losses, the FSDP units, the bytes each rank holds) and ``OUT/final`` (the trained model
through the spec's state-dict adapter, saved with ``save_pretrained``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

STEPS = 4
BATCH, SEQ = 4, 32
SMALL = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 16}


def main(out: str) -> None:
    import torch
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as titan_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.parallel_dims import ParallelDims

    from bayeslayer.models import BayesLayerForCausalLM
    from bayeslayer.training import titan
    from bayeslayer.training.parallel import full_state_dict, local_bytes

    titan_dims.device_type = "cpu"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    config = titan.bayeslayer_debug()
    config.model_spec = titan.model_spec("debugmodel", **SMALL)
    config.training.mixed_precision_param = "float32"
    spec = config.model_spec
    dims = ParallelDims.from_config(config.parallelism, world)
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
                                compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder=out)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = config.optimizer.build(model_parts=[model])
    loss_fn = config.loss.build(compile_config=config.compile)

    data = torch.Generator().manual_seed(1)
    losses = []
    local = BATCH // world
    for _ in range(STEPS):
        window = torch.randint(0, SMALL["vocab_size"], (BATCH, SEQ + 1), generator=data)
        inputs, labels = window[:, :-1], window[:, 1:]
        mine = slice(rank * local, (rank + 1) * local)
        loss, _ = loss_fn(model(inputs[mine]), labels[mine], global_valid_tokens=torch.tensor(labels.numel()))
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # each rank's share of the batch mean
        losses.append(total.item())

    params = list(model.parameters())
    moments = [t for state in optimizers.optimizers[0].state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0]
    record = {
        "world": world, "losses": losses,
        "fsdp_units": [n for n, m in model.named_modules() if isinstance(m, FSDPModule)],
        "param_bytes": local_bytes(params), "adam_bytes": local_bytes(moments),
        "full_param_bytes": sum(p.numel() * p.element_size() for p in params),
        "gradient_checkpointing": model.lm.is_gradient_checkpointing,
    }
    state = full_state_dict(model)  # gathered on every rank, kept on rank 0
    if rank == 0:
        adapter = spec.state_dict_adapter(spec.model, None)
        hf = adapter.to_hf(state)
        final = BayesLayerForCausalLM(model.lm.config)
        final.load_state_dict(hf, strict=not final.config.tie_word_embeddings)
        final.save_pretrained(Path(out, "final"))
        Path(out, "record.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
