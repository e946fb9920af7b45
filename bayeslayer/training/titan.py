"""torchtitan's route for bayeslayer models: a model spec, its parallelisation function and its state-dict adapter.

torchtitan (0.3) finds a model by the module named with ``--module`` and a function of it named with ``--config``
that returns its ``Trainer.Config``; this module is such a registry::

    torchrun --nproc-per-node 8 -m torchtitan.train --module bayeslayer.training.titan --config bayeslayer_debug

* :func:`model_spec` — the ``ModelSpec``: a :class:`BayesLayerForCausalLM` inside torchtitan's ``BaseModel``
  protocol (built on the meta device, its weights initialised after sharding), the parallelisation function
  :func:`parallelize_bayeslayer` and the state-dict adapter.
* :func:`parallelize_bayeslayer` — FSDP2 on torchtitan's ``fsdp`` mesh through the package's one parallelisation
  function, :func:`bayeslayer.training.parallel.shard_model` (each ``BayesLayerBlock`` one unit; bf16 or fp32
  parameters in compute as ``training.mixed_precision_param`` says, fp32 gradient reduction, the gradients
  summed over the ranks as torchtitan's token-normalised losses need); activation
  checkpointing ``full`` is the blocks' own recompute.  Tensor, pipeline, context and expert parallelism and
  torch.compile are refused by name: the model has no plan for them in torchtitan (the package's own context
  parallelism is ``lm train --context-parallel``).
* the adapter maps the model's state dict to the layout of ``BayesLayerForCausalLM.save_pretrained`` (the keys
  ``from_pretrained`` reads) and back.

torchtitan is an optional dependency (Python >= 3.11): this module imports without it, and everything that needs
it raises ``ImportError`` naming how to install it.  What has been run and what has not: docs/distributed.md.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..models import BayesLayerConfig, BayesLayerForCausalLM
from .parallel import mixed_precision, shard_model

INSTALL = "pip install torchtitan==0.3.0 (Python >= 3.11; docs/distributed.md, 'torchtitan')"

#: the model shapes :func:`model_spec` knows (``BayesLayerConfig`` keyword arguments; any other shape is
#: ``debugmodel`` with overrides).  ``debugmodel``'s vocabulary is that of torchtitan's test tokenizer.
FLAVORS: dict[str, dict[str, Any]] = {
    "debugmodel": {"vocab_size": 2048, "hidden_size": 256, "num_hidden_layers": 4, "num_heads": 4, "head_dim": 64,
                   "mixer": "bayesian"},
}


def _require_torchtitan():
    try:
        import torchtitan
    except ImportError as exc:
        raise ImportError(f"the torchtitan route needs torchtitan: {INSTALL}") from exc
    return torchtitan


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Write the whole tensor ``full`` into ``target``, a plain tensor or this rank's shard of a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        # every rank holds the same ``full``: each keeps its own shard, no communication
        full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
    target.copy_(full)


@functools.cache
def _classes():
    """The classes that subclass torchtitan's protocols (defined once torchtitan is importable)."""
    _require_torchtitan()
    from dataclasses import dataclass, field

    from torchtitan.protocols import BaseModel, StateDictAdapter

    class BayesLayerTitanModel(BaseModel):
        """A :class:`BayesLayerForCausalLM` (attribute ``lm``) in torchtitan's model protocol: ``forward(tokens)``
        returns the logits ``[B, T, V]`` (torchtitan's loss shifts nothing: its labels are the next tokens)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseModel.Config):
            hf_config: dict = field(default_factory=dict)
            """``BayesLayerConfig`` keyword arguments."""

            def update_from_config(self, *, config, **kwargs) -> None:
                BayesLayerConfig(**self.hf_config)  # its own checks, by argument name
                vocab = self.hf_config.get("vocab_size")
                tokenizer_vocab = getattr(getattr(config, "tokenizer", None), "vocab_size", None)
                if isinstance(tokenizer_vocab, int) and isinstance(vocab, int) and tokenizer_vocab > vocab:
                    raise ValueError(f"hf_config['vocab_size'] ({vocab}) is smaller than the tokenizer's "
                                     f"({tokenizer_vocab})")

            def get_nparams_and_flops(self, model, seq_len: int) -> tuple[int, int]:
                lm = model.lm
                params = sum(p.numel() for p in lm.parameters())
                return params, lm.flops(1, seq_len).total // seq_len

        def __init__(self, config: BayesLayerTitanModel.Config) -> None:
            super().__init__()
            self.lm = BayesLayerForCausalLM(BayesLayerConfig(**config.hf_config))

        def forward(self, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
            if kwargs:
                raise ValueError(f"BayesLayerTitanModel takes the token ids only, got {sorted(kwargs)}")
            return self.lm(input_ids=tokens).logits

        def verify_module_protocol(self) -> None:
            """The blocks are Hugging Face modules, not torchtitan ``Module``\\ s: torchtitan's own sharding
            protocol does not apply to them (:func:`parallelize_bayeslayer` shards them with FSDP2 instead)."""

        def init_states(self, *, buffer_device: torch.device | None = None) -> None:
            """The weights ``BayesLayerForCausalLM(config)`` draws from the current random state (the mixers'
            own initialisation included), written into this rank's shards: the same model on any number of
            ranks.  Every rank builds the whole model once, on the CPU."""
            with torch.device("cpu"):
                reference = BayesLayerForCausalLM(self.lm.config)
            full = dict(reference.named_parameters())
            full.update(reference.named_buffers())
            with torch.no_grad():
                for name, tensor in [*self.lm.named_parameters(), *self.lm.named_buffers()]:
                    _copy_into(tensor, full[name].to(dtype=tensor.dtype))

    class BayesLayerStateDictAdapter(StateDictAdapter):
        """torchtitan's state dict of :class:`BayesLayerTitanModel` (keys ``lm.<name>``) to and from the layout
        of ``BayesLayerForCausalLM.save_pretrained`` (``<name>``; the head left out when it is tied to the
        embedding, as Hugging Face saves it)."""

        def _tied(self) -> bool:
            return bool(self.model_config.hf_config.get("tie_word_embeddings", False))

        def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            bad = [k for k in state_dict if not k.startswith("lm.")]
            if bad:
                raise ValueError(f"state_dict has keys outside the model 'lm.': {bad[:3]}")
            hf = {k[len("lm."):]: v for k, v in state_dict.items()}
            if self._tied():
                hf.pop("lm_head.weight", None)
            return hf

        def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            native = {f"lm.{k}": v for k, v in hf_state_dict.items()}
            if self._tied() and "lm.lm_head.weight" not in native and "lm.model.embeddings.weight" in native:
                native["lm.lm_head.weight"] = native["lm.model.embeddings.weight"]
            return native

    return BayesLayerTitanModel, BayesLayerStateDictAdapter


def __getattr__(name: str):
    if name in ("BayesLayerTitanModel", "BayesLayerStateDictAdapter"):
        model, adapter = _classes()
        return model if name == "BayesLayerTitanModel" else adapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parallelize_bayeslayer(model, *, parallel_dims, training, parallelism, compile_config, ac_config,
                           dump_folder: str = ""):
    """torchtitan's ``parallelize_fn`` for :class:`BayesLayerTitanModel`: FSDP2 over the ``fsdp`` mesh by
    :func:`~bayeslayer.training.parallel.shard_model`; returns ``model``."""
    _require_torchtitan()
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.activation_checkpoint import FullAC

    model_cls, _ = _classes()
    if not isinstance(model, model_cls):
        raise TypeError(f"model must be a BayesLayerTitanModel, got {type(model).__name__}")
    refused = {name: degree for name, degree in (
        ("tensor_parallel_degree", parallel_dims.tp), ("pipeline_parallel_degree", parallel_dims.pp),
        ("context_parallel_degree", parallel_dims.cp), ("expert_parallel_degree", parallel_dims.ep),
        ("data_parallel_replicate_degree", parallel_dims.dp_replicate)) if degree > 1}
    if refused:
        raise ValueError(f"bayeslayer models shard with FSDP only under torchtitan; parallelism {refused} is not "
                         f"supported (context parallelism: bayeslayer lm train --context-parallel)")
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(f"parallelism.spmd_backend must be 'partial_dtensor' for bayeslayer models (FSDP2 through "
                         f"fully_shard), got {parallelism.spmd_backend!r}")
    if compile_config.enable:
        raise ValueError("compile.enable: torch.compile is not wired for bayeslayer models under torchtitan")
    if ac_config is not None:
        if not isinstance(ac_config, FullAC.Config):
            raise ValueError(f"activation_checkpoint must be 'full' or 'none' for bayeslayer models (each block "
                             f"recomputed in the backward), got {type(ac_config).__qualname__}")
        model.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    policy = mixed_precision(dtypes[training.mixed_precision_param])
    reshard = {"default": True, "always": True, "never": False}[parallelism.fsdp_reshard_after_forward]
    shard_model(model.lm, parallel_dims.get_mesh("fsdp"), mp_policy=policy, reshard_after_forward=reshard)
    # torchtitan's losses are sums over a rank's tokens divided by the tokens of the whole batch: the gradients are
    # summed over the ranks, not averaged (a plain SUM, which every backend has: gloo has no PREMUL_SUM)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def model_spec(flavor: str = "debugmodel", **overrides):
    """torchtitan's ``ModelSpec`` for the bayeslayer model ``flavor`` (a key of :data:`FLAVORS`), its
    ``BayesLayerConfig`` arguments updated by ``overrides``."""
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {sorted(FLAVORS)}, got {flavor!r}")
    hf_config = {**FLAVORS[flavor], **overrides}
    BayesLayerConfig(**hf_config)
    _require_torchtitan()
    from torchtitan.protocols import ModelSpec

    model_cls, adapter = _classes()
    return ModelSpec(name="bayeslayer", flavor=flavor, model=model_cls.Config(hf_config=hf_config),
                     parallelize_fn=parallelize_bayeslayer, pipelining_fn=None, post_optimizer_build_fn=None,
                     state_dict_adapter=adapter)


def bayeslayer_debug():
    """``--config bayeslayer_debug``: torchtitan's ``Trainer.Config`` for the ``debugmodel`` flavor (AdamW,
    fp32 master weights, FSDP2 over every rank, the blocks recomputed in the backward, torchtitan's own
    test tokenizer and data set names: point ``--hf_assets_path`` and ``--dataloader.dataset`` at yours)."""
    _require_torchtitan()
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.trainer import Trainer

    spec = model_spec("debugmodel")
    return Trainer.Config(
        loss=CrossEntropyLoss.Config(global_vocab_size=spec.model.hf_config["vocab_size"]),
        hf_assets_path="./tests/assets/tokenizer",
        model_spec=spec,
        optimizer=default_adamw(lr=8e-4),
        training=TrainingConfig(local_batch_size=8, seq_len=2048, steps=10),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        activation_checkpoint=FullAC.Config(),
    )
