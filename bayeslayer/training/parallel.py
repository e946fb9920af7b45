"""Sharded training on PyTorch's own engine: FSDP2 (``torch.distributed.fsdp.fully_shard``) on a DeviceMesh.

Data parallelism comes in two kinds (:data:`SHARDINGS`):

* ``none`` — DDP: every rank holds the whole model, its gradients and AdamW's two moments (16 bytes per
  fp32 parameter on every rank);
* ``fsdp`` — FSDP2: every rank holds ``1/N`` of each parameter, of its gradient and of the optimiser state
  (``N`` = the ranks of the shard mesh); a block's parameters are all-gathered just before its forward
  and its backward and freed after, and the gradients are reduce-scattered.

:func:`shard_model` is the one parallelisation function: each decoder block (the classes a Hugging Face
model names in ``_no_split_modules``: ``BayesLayerBlock`` here, ``GatedDeltaNetBlock`` in
flash-linear-attention) is one FSDP unit, the input embedding another (when it is not tied to the head),
and the model itself the root unit that holds the rest (final norm, head).  :func:`shard_trainee` applies
it to the models inside a trainee (:func:`bayeslayer.training.loop.train_loop` calls it for
``shard="fsdp"``).  Mixed precision is FSDP2's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`
(:func:`mixed_precision`: bf16 parameters in forward and backward, fp32 gradient reduction, fp32 sharded
parameters for the optimiser); the Bayesian Layer's filter computes in fp32 whatever its input dtype.

:func:`full_state_dict` and :func:`unsharded_copy` gather a sharded model back (rank 0) for the plain
``final/`` folder that ``from_pretrained`` reads; :func:`local_bytes` is what a rank stores.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

SHARDINGS = ("none", "fsdp")


def check_shard(shard: str, *, option: str = "shard") -> str:
    """``shard`` if it is one of :data:`SHARDINGS`, else ``ValueError`` naming ``option``."""
    if shard not in SHARDINGS:
        raise ValueError(f"{option} must be one of {SHARDINGS}, got {shard!r}")
    return shard


def _fsdp():
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError as exc:  # torch < 2.6 has FSDP2 only under torch.distributed._composable
        raise RuntimeError(f"sharded training needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); this is torch "
                           f"{torch.__version__}") from exc
    return FSDPModule, MixedPrecisionPolicy, fully_shard


def mixed_precision(dtype: torch.dtype | None):
    """FSDP2's policy for a run computing in ``dtype`` (the autocast dtype; ``None``: full precision).

    ``None`` → ``None`` (parameters and gradients in their own dtype); ``bf16``/``fp16`` → parameters
    all-gathered and used in ``dtype``, gradients reduced in fp32, the sharded parameters and optimiser
    state kept in fp32."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    _, MixedPrecisionPolicy, _ = _fsdp()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def block_classes(model: nn.Module) -> set[str]:
    """The class names ``model`` and its submodules list in ``_no_split_modules`` (Hugging Face's decoder
    blocks, the units FSDP and Accelerate wrap)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def _blocks(model: nn.Module, classes: set[str]) -> list[nn.Module]:
    """The outermost submodules of ``model`` whose class is named in ``classes``, in module order."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside:
            for child in m.children():
                inside.add(id(child))
            continue
        if m is not model and type(m).__name__ in classes:
            found.append(m)
            inside.update(id(c) for c in m.children())
    return found


def _tied(embedding: nn.Module | None, head: nn.Module | None) -> bool:
    return (embedding is not None and head is not None
            and any(p is q for p in embedding.parameters() for q in head.parameters()))


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule of it is an FSDP unit (its parameters are sharded)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def shard_model(model: nn.Module, mesh, *, mp_policy=None, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` with FSDP2 over the 1-D DeviceMesh ``mesh``, in place; returns ``model``.

    Units: every decoder block (the outermost submodules whose class ``model`` names in
    ``_no_split_modules``), the input embedding (``model.get_input_embeddings()``) unless it shares its
    weight with the output head, then ``model`` itself (the final norm, the head and whatever else is
    left).  The parameters become ``DTensor``\\ s sharded along dimension 0 (new ``nn.Parameter`` objects:
    build the optimiser afterwards); the module names and the ``state_dict`` keys stay as they were.

    Args:
        model: a causal LM with decoder blocks (``BayesLayerForCausalLM``, an fla model, ...).
        mesh: a 1-D ``DeviceMesh`` (a :class:`~bayeslayer.training.distributed.DistContext`'s ``shard_mesh``).
        mp_policy: a ``MixedPrecisionPolicy`` (:func:`mixed_precision`) or ``None`` (full precision).
        reshard_after_forward: free each block's gathered parameters after its forward (and gather them again
            for the backward); ``False`` keeps them until the backward (less communication, more memory).
    """
    FSDPModule, MixedPrecisionPolicy, fully_shard = _fsdp()
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"mesh must be a 1-D DeviceMesh (DistContext.shard_mesh), got {mesh!r}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy or None, got {type(mp_policy).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {type(reshard_after_forward).__name__}")
    if is_sharded(model):
        raise ValueError(f"{type(model).__name__} is already sharded")
    classes = block_classes(model)
    blocks = _blocks(model, classes)
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no decoder block class in _no_split_modules "
                         f"(found {sorted(classes) or 'none'}): nothing to shard block by block")
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for block in blocks:
        fully_shard(block, **options)
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if isinstance(embedding, nn.Module) and not _tied(embedding, head):
        fully_shard(embedding, **options)
    # the root's parameters (norm, head) are used last in the forward and first in the backward: keep them
    fully_shard(model, **{**options, "reshard_after_forward": False})
    return model


def _models_in(trainee: nn.Module) -> list[nn.Module]:
    """The outermost submodules of ``trainee`` (itself included) that have decoder blocks to shard."""
    found: list[nn.Module] = []
    skip: set[int] = set()
    for m in trainee.modules():
        if id(m) in skip:
            continue
        if getattr(m, "_no_split_modules", None) and callable(getattr(m, "get_input_embeddings", None)):
            found.append(m)
            skip.update(id(x) for x in m.modules())
    return found


def shard_trainee(trainee: nn.Module, mesh, *, mp_policy=None, gradient_divide_factor: float | None = None) -> None:
    """:func:`shard_model` on each model inside ``trainee`` (e.g. the ``.model`` of a next-token trainee, a
    student and its teacher), in place.

    ``gradient_divide_factor``: what the summed gradients are divided by (FSDP's default is the mesh size,
    an average over ranks).  With context parallelism the ranks of a group hold shares of one loss, whose
    gradients must be summed over the group and averaged over the replicas: the factor is the number of
    replicas.  A trainee with parameters outside its models (nothing would shard them) is refused.
    """
    if not isinstance(trainee, nn.Module):
        raise TypeError(f"trainee must be a torch.nn.Module, got {type(trainee).__name__}")
    models = _models_in(trainee)
    if not models:
        raise ValueError(f"{type(trainee).__name__} holds no model with decoder blocks (_no_split_modules) to shard")
    covered = {id(p) for m in models for p in m.parameters()}
    loose = [n for n, p in trainee.named_parameters() if id(p) not in covered]
    if loose:
        raise ValueError(f"{type(trainee).__name__} has parameters outside its models, which FSDP would not shard: "
                         f"{loose[:5]}")
    for model in models:
        shard_model(model, mesh, mp_policy=mp_policy)
    if gradient_divide_factor is not None:
        FSDPModule, _, _ = _fsdp()
        for m in trainee.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(float(gradient_divide_factor))


def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor``, else ``t`` itself."""
    return t.to_local() if isinstance(t, _dtensor()) else t


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes this rank stores for ``tensors`` (local shards of ``DTensor``\\ s; ``None`` entries count 0)."""
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors if t is not None)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s whole ``state_dict`` on the CPU: on rank 0 of a sharded model (gathered; collective, every
    rank calls it), else ``{}`` on the other ranks; an unsharded model's own, on every rank."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _plain_class(model: nn.Module) -> type:
    FSDPModule, _, _ = _fsdp()
    cls = type(model)
    while issubclass(cls, FSDPModule):  # fully_shard swaps the class for an FSDP<Class> subclass
        cls = next(b for b in cls.__bases__ if b is not FSDPModule)
    return cls


def unsharded_copy(model: nn.Module) -> nn.Module | None:
    """A plain CPU copy of a sharded Hugging Face model (its class, its config, its full weights) on rank 0,
    ``None`` on the others (collective: every rank calls it).  An unsharded model is returned as it is."""
    if not is_sharded(model):
        return model
    import torch.distributed as dist

    state = full_state_dict(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    with torch.device("meta"):
        copy = _plain_class(model)(model.config)
    # each tensor its own storage: a gathered shard can be a view of a padded buffer, which safetensors refuses
    copy.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    if getattr(copy.config, "tie_word_embeddings", False):
        copy.tie_weights()
    left = [n for n, t in [*copy.named_parameters(), *copy.named_buffers()] if t.is_meta]
    if left:  # a buffer outside the state_dict (non-persistent) has no value to copy
        raise RuntimeError(f"{type(copy).__name__}'s state_dict lacks {left[:5]}: cannot rebuild it unsharded")
    return copy.eval()


__all__ = ["SHARDINGS", "block_classes", "check_shard", "full_state_dict", "is_sharded", "local_bytes", "local_tensor",
           "mixed_precision", "shard_model", "shard_trainee", "unsharded_copy"]
