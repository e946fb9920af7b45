"""Load a flash-linear-attention Gated DeltaNet checkpoint (Hugging Face format) into our model.

A checkpoint written by ``fla.models.GatedDeltaNetForCausalLM.save_pretrained`` is a
``config.json`` (``model_type: gated_deltanet``) plus ``model.safetensors`` (or
sharded safetensors; a pickle ``pytorch_model.bin`` is refused, since reading one can run code).  Our
:class:`BayesLayerForCausalLM` with ``gated_deltanet`` mixers uses the same parameter names and shapes, so the
weights map one to one; the recurrence then runs through
:data:`bayeslayer.design.GATED_DELTANET` in plain PyTorch, on any device.

Every tensor must find its place: a checkpoint tensor the model has no slot for,
a model parameter the checkpoint lacks, or a shape mismatch raises one error that
lists them all.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from ..files import read_json
from .configuration import BayesLayerConfig
from .modeling import BayesLayerForCausalLM

_WEIGHT_PATTERNS = ["config.json", "*.safetensors", "*.safetensors.index.json"]  # never a pickle (*.bin)


def gdn_config_to_bayeslayer(gdn_config: dict[str, Any]) -> BayesLayerConfig:
    """A flash-linear-attention ``GatedDeltaNetConfig`` (as a dict) as a :class:`BayesLayerConfig`.

    The mixer keeps the checkpoint's ``expand_v``, ``conv_size``, ``norm_eps``,
    ``use_gate`` and ``allow_neg_eigval``.  Features our Gated DeltaNet mixer does not
    implement (hybrid attention layers, grouped value heads, a sigmoid output gate,
    attention residuals) raise a ValueError naming them, rather than loading into a
    model that would compute something else.
    """
    if not isinstance(gdn_config, dict):
        raise TypeError(f"gdn_config must be a dict (a parsed config.json), got {type(gdn_config).__name__}")
    model_type = gdn_config.get("model_type")
    if model_type != "gated_deltanet":
        raise ValueError(f"expected a flash-linear-attention config with model_type 'gated_deltanet', "
                         f"got {model_type!r}")
    c = dict(gdn_config)
    unsupported = []
    if c.get("attn") is not None:
        unsupported.append(f"attn={c['attn']!r} (hybrid softmax-attention layers)")
    num_heads = c.get("num_heads", 6)
    if c.get("num_v_heads") not in (None, num_heads):
        unsupported.append(f"num_v_heads={c['num_v_heads']} != num_heads={num_heads} (grouped value heads)")
    if c.get("use_gate", True) and c.get("output_gate_activation", "swish") not in ("swish", "silu"):
        unsupported.append(f"output_gate_activation={c['output_gate_activation']!r}")
    if c.get("attnres_block_size") is not None:
        unsupported.append(f"attnres_block_size={c['attnres_block_size']}")
    if c.get("hidden_act", "swish") != "swish":
        unsupported.append(f"hidden_act={c['hidden_act']!r}")
    if unsupported:
        raise ValueError("this Gated DeltaNet checkpoint uses features bayeslayer does not implement: "
                         + "; ".join(unsupported))

    norm_eps = c.get("norm_eps", 1e-6)
    use_conv = c.get("use_short_conv", True)
    mixer = "gated_deltanet" if use_conv else "gated_deltanet_noconv"
    gdn_kwargs: dict[str, Any] = {"expand_v": c.get("expand_v", 2.0), "norm_eps": norm_eps}
    if use_conv:
        gdn_kwargs["conv_size"] = c.get("conv_size", 4)
    # only non-defaults, so that the config stays readable
    if not c.get("use_gate", True):
        gdn_kwargs["use_gate"] = False
    if c.get("allow_neg_eigval", False):
        gdn_kwargs["allow_neg_eigval"] = True
    return BayesLayerConfig(
        vocab_size=c.get("vocab_size", 32000),
        hidden_size=c.get("hidden_size", 2048),
        num_hidden_layers=c.get("num_hidden_layers", 21),
        num_heads=num_heads,
        head_dim=c.get("head_dim", 256),
        mixer=mixer,
        mixer_kwargs={mixer: gdn_kwargs},
        hidden_ratio=c.get("hidden_ratio", 4),
        intermediate_size=c.get("intermediate_size"),
        norm_eps=norm_eps,
        initializer_range=c.get("initializer_range", 0.02),
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        pad_token_id=c.get("pad_token_id"),
        bos_token_id=c.get("bos_token_id", 1),
        eos_token_id=c.get("eos_token_id", 2),
    )


_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def hub_id(path_or_repo_id: str | os.PathLike) -> str | None:
    """The hub id ``owner/name`` that ``path_or_repo_id`` names, or None when it means a local path.

    It is a local path when it exists, is a ``Path`` object, is written as a path (starts with
    ``.``, ``/`` or ``~``, has no or several ``/``, characters a hub id cannot have), or when its
    first part is a folder here (``ckpts/gdn`` next to a ``ckpts/`` folder is a path, mistyped or
    not yet written, not a hub repository of a user called ``ckpts``).
    """
    if not isinstance(path_or_repo_id, (str, os.PathLike)) or not str(path_or_repo_id):
        raise TypeError(f"path_or_repo_id must be a non-empty path or hub id string, got {path_or_repo_id!r}")
    if isinstance(path_or_repo_id, os.PathLike) or Path(path_or_repo_id).expanduser().exists():
        return None
    name = str(path_or_repo_id)
    if not _HUB_NAME.match(name) or name.startswith("."):
        return None
    if Path(name.split("/")[0]).exists():
        return None
    return name


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_checkpoint_dir(path_or_repo_id: str | os.PathLike, revision: str | None) -> Path:
    """A local checkpoint folder, or a hub id's snapshot (the local cache first, the network last).

    A name that means a local path (see :func:`hub_id`) and does not exist fails at once, and so
    does a hub id under ``HF_HUB_OFFLINE`` that is not in the cache; a failed download is one
    ``FileNotFoundError`` that says what was tried.
    """
    if not isinstance(path_or_repo_id, (str, os.PathLike)) or not str(path_or_repo_id):
        raise TypeError(f"path_or_repo_id must be a non-empty path or hub id string, got {path_or_repo_id!r}")
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; pass the checkpoint directory (config.json and weights)")
    name = str(path_or_repo_id)
    hub = hub_id(path_or_repo_id)
    if hub is None:
        first = Path(name).parts[0] if Path(name).parts else name
        why = (f" (the folder {first!r} exists here, so this is read as a local path, not a hub id)"
               if "/" in name and Path(first).is_dir() and first != name else "")
        raise FileNotFoundError(f"no checkpoint directory at {name!r}{why}")
    from huggingface_hub import snapshot_download

    try:  # a cached snapshot needs no network
        return Path(snapshot_download(hub, revision=revision, allow_patterns=_WEIGHT_PATTERNS, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache (the hub's error types vary by version)
        if _hub_offline():
            raise FileNotFoundError(f"no checkpoint directory at {name!r}, and as a hub id it is not in the local "
                                    "cache (HF_HUB_OFFLINE is set, so nothing is downloaded)") from None
    try:
        return Path(snapshot_download(hub, revision=revision, allow_patterns=_WEIGHT_PATTERNS))
    except Exception as err:  # noqa: BLE001 - network, missing repository, gated repository, ...
        reason = " ".join(str(err).split())[:300]
        raise FileNotFoundError(f"no checkpoint directory at {name!r}, and fetching it as the hub id {hub!r} "
                                f"failed: {type(err).__name__}: {reason}") from err


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF checkpoint directory's (sharded) safetensors; pickles are never read."""
    from ..files import read_safetensors
    from .loading import refuse_pickle_weights

    def _shards(index_name: str) -> list[Path]:
        index = read_json(directory / index_name, what="shard index")
        try:
            return [directory / f for f in sorted(set(index["weight_map"].values()))]
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"shard index {directory / index_name} has no valid weight_map ({exc})") from exc

    refuse_pickle_weights(directory)
    if (directory / "model.safetensors").is_file():
        files, loader = [directory / "model.safetensors"], read_safetensors
    elif (directory / "model.safetensors.index.json").is_file():
        files, loader = _shards("model.safetensors.index.json"), read_safetensors
    else:
        found = sorted(p.name for p in directory.iterdir())
        raise FileNotFoundError(f"no model.safetensors (or sharded index) in {directory}; found {found}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for key, tensor in loader(f).items():
            if key in weights:
                raise ValueError(f"tensor {key!r} appears in more than one shard ({f.name})")
            weights[key] = tensor
    return weights


def load_gdn_checkpoint(
    path_or_repo_id: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    revision: str | None = None,
) -> BayesLayerForCausalLM:
    """A flash-linear-attention Gated DeltaNet checkpoint as a :class:`BayesLayerForCausalLM`.

    Args:
        path_or_repo_id: a directory holding ``config.json`` (``model_type: gated_deltanet``) and
            the weights, or a hub id ``owner/name`` (downloaded through ``huggingface_hub``).
        dtype, device: where the model's parameters live (float32 on the CPU by default).
        revision: hub revision, for hub ids.

    Raises:
        ValueError: listing every checkpoint tensor left unused, every model parameter the
            checkpoint does not provide, and every shape mismatch.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    from .loading import check_finite, naming_config, read_model_config, verify_model_dir

    directory = resolve_checkpoint_dir(path_or_repo_id, revision)
    verify_model_dir(directory)
    config = gdn_config_to_bayeslayer(read_model_config(directory))
    weights = _read_weights(directory)

    with naming_config(directory):
        model = BayesLayerForCausalLM(config)
    expected = model.state_dict()
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(set(weights) - set(expected))
    missing = sorted(set(expected) - set(weights) - tied)
    mismatched = sorted(
        f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(weights) & set(expected)
        if weights[k].shape != expected[k].shape
    )
    if unexpected or missing or mismatched:
        parts = []
        if unexpected:
            parts.append(f"{len(unexpected)} checkpoint tensors have no place in the model: {unexpected}")
        if missing:
            parts.append(f"{len(missing)} model parameters are missing from the checkpoint: {missing}")
        if mismatched:
            parts.append(f"{len(mismatched)} shapes differ: {mismatched}")
        raise ValueError(f"cannot load the Gated DeltaNet checkpoint at {directory}: " + "; ".join(parts))
    if tied and "lm_head.weight" in weights and not torch.equal(weights["lm_head.weight"],
                                                                weights["model.embeddings.weight"]):
        raise ValueError("config ties the word embeddings but lm_head.weight differs from the embeddings")
    state = {k: v for k, v in weights.items() if k not in tied}
    model.load_state_dict(state, strict=not tied)
    model.tie_weights()
    check_finite(model, directory)
    return model.to(device=device, dtype=dtype).eval()
