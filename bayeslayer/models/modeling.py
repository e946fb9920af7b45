"""A Hugging Face causal language model over any stack of ``bayeslayer`` token mixers.

Module names mirror flash-linear-attention's ``GatedDeltaNetForCausalLM`` so its
checkpoints load parameter-for-parameter::

    model.embeddings                          nn.Embedding [V, hidden]
    model.layers.{i}.attn_norm                RMSNorm
    model.layers.{i}.attn                     the token mixer (bayeslayer.layers)
    model.layers.{i}.mlp_norm                 RMSNorm
    model.layers.{i}.mlp.{gate,up,down}_proj  SwiGLU MLP
    model.norm                                RMSNorm
    lm_head                                   nn.Linear [hidden → V] (tied or not)

Each block is pre-norm:  ``h = h + drop(mixer(norm(h)))``, ``h = h + drop(mlp(norm(h)))``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.generation import GenerationMixin
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel

from ..checks import check_fits, check_int
from ..errors import SizeError
from ..ops.backend import BackendError, forced_backend
from ..ops.flops import FlopCount, Tally
from ..ops.utils.validation import can_read_values, values_checked
from .cache import BayesLayerCache
from .configuration import BayesLayerConfig
from .packing import document_starts, resolve_packing, take_flash_attention_kwargs

# Keyword arguments that ``generate()`` (or HF tooling) may pass and that carry nothing this model
# uses: the cache position (the cache counts its own tokens), attention weights (refused when asked
# for) and token types.  ``position_ids`` is not among them: it is read for packed documents
# (:mod:`bayeslayer.models.packing`).
_IGNORED_HF_KWARGS = frozenset({"cache_position", "output_attentions", "token_type_ids"})


@dataclass
class BayesLayerModelOutput(BaseModelOutputWithPast):
    """:class:`BaseModelOutputWithPast` plus ``variances``: with ``output_variances=True``, one entry
    per layer, the mixer's predictive variance ``1 + q_tᵀ P_t q_t`` ``[B, T, H, G]`` (Bayesian
    Layers) or ``None`` (mixers without a covariance)."""

    variances: tuple[torch.Tensor | None, ...] | None = None
    #: the offsets of the packed documents over the row-major flattened ``[B·T]`` tokens (from
    #: ``cu_seqlens`` or flattening ``position_ids``), or None when nothing was packed
    cu_seqlens: torch.Tensor | None = None


@dataclass
class BayesLayerCausalLMOutput(CausalLMOutputWithPast):
    """:class:`CausalLMOutputWithPast` plus the per-layer ``variances`` (see :class:`BayesLayerModelOutput`)."""

    variances: tuple[torch.Tensor | None, ...] | None = None


@dataclass
class BayesLayerGenerateOutput(GenerateDecoderOnlyOutput):
    """``generate(..., output_variances=True, return_dict_in_generate=True)`` (greedy or sampling):
    :class:`GenerateDecoderOnlyOutput` plus ``variances``, one entry per generated token, each the
    per-layer tuple of the forward that produced it (as ``attentions`` in transformers): the first
    covers the prompt ``[B, T_prompt, H, G]``, the later ones the token fed in ``[B, 1, H, G]``."""

    variances: tuple[tuple[torch.Tensor | None, ...], ...] | None = None


@dataclass
class BayesLayerGenerateBeamOutput(GenerateBeamDecoderOnlyOutput):
    """:class:`GenerateBeamDecoderOnlyOutput` plus ``variances`` (see :class:`BayesLayerGenerateOutput`;
    the batch axis is ``batch · num_beams``, in the beams' order at that step)."""

    variances: tuple[tuple[torch.Tensor | None, ...], ...] | None = None


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the next-token cross-entropy is computed in for logits of ``dtype``: float32 at least (bf16
    and fp16 logits are upcast), float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


def _check_output_variances(value, model: BayesLayerModel) -> bool:
    """``output_variances`` must be a bool, and ``True`` only for a model with a layer that has a covariance."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(f"output_variances must be True or False, got {value!r}")
    if value and not any(_has_covariance(layer.attn) for layer in model.layers):
        raise ValueError(
            "output_variances=True needs a layer with a covariance (a Bayesian Layer), but this model's "
            f"mixers {list(model.config.layer_mixers)} have none"
        )
    return value


def _has_covariance(mixer: nn.Module) -> bool:
    design = getattr(mixer, "design", None)
    return bool(getattr(design, "has_covariance", False))


def _takes_backend(name: str) -> bool:
    """Whether mixer ``name`` runs on the backend its ``backend`` argument chooses (its constructor takes one)."""
    from ..layers import MIXERS

    return "backend" in inspect.signature(MIXERS[name]).parameters


def build_layer_mixer(config: BayesLayerConfig, layer_idx: int) -> nn.Module:
    """The token mixer of layer ``layer_idx``, built from the registry with the config's kwargs
    (and ``config.backend`` for a mixer with a Triton implementation: the config is its one place)."""
    from ..layers import build_mixer

    name, kwargs = config.mixer_arguments(layer_idx)
    if _takes_backend(name):
        kwargs["backend"] = getattr(config, "backend", "auto")
    return build_mixer(name, config.hidden_size, layer_idx=layer_idx, **kwargs)


class SwiGLUMLP(nn.Module):
    """``down_proj(drop(silu(gate_proj(x)) * up_proj(x)))``; ``3 · hidden · intermediate`` parameters."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_dropout: float = 0.0) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.hidden_dropout = nn.Dropout(hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden_dropout(F.silu(self.gate_proj(x)) * self.up_proj(x)))

    def flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """The three projections of a training step (:mod:`bayeslayer.ops.flops`' convention)."""
        tokens = check_int("batch_size", batch_size, minimum=1) * check_int("seq_len", seq_len, minimum=1)
        t = Tally()
        d, inner = self.gate_proj.in_features, self.gate_proj.out_features
        t.linear(tokens, d, inner)
        t.linear(tokens, d, inner)
        t.linear(tokens, inner, d)
        return t.count()


class BayesLayerBlock(GradientCheckpointingLayer):
    """Pre-norm block: a token mixer then a SwiGLU MLP, each with a residual connection.

    With ``model.activation_checkpointing_enable()`` the block's activations are recomputed in
    the backward pass (training only; a cached forward is never checkpointed).
    """

    def __init__(self, config: BayesLayerConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.mixer_name = config.layer_mixers[layer_idx]
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = build_layer_mixer(config, layer_idx)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.mlp_intermediate_size, config.mlp_hidden_dropout)
        self.mixer_dropout = nn.Dropout(config.mixer_dropout)
        self.mlp_dropout = nn.Dropout(config.mlp_dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                state: dict | None = None, use_cache: bool = False, output_variance: bool = False,
                cp_context=None, cu_seqlens: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict | None, torch.Tensor | None]:
        """``(hidden_states, the mixer's new state or None, its predictive variance or None)``; ``cu_seqlens``
        (packed documents, ``B = 1``) goes to the mixer."""
        cp = {}
        if cp_context is not None:
            reason = self.cp_unsupported()
            if reason is not None:
                raise ValueError(reason)
            cp = {"cp_context": cp_context}
        if cu_seqlens is not None:
            cp["cu_seqlens"] = cu_seqlens
        out = self.attn(self.attn_norm(hidden_states), attention_mask=attention_mask, state=state,
                        use_cache=use_cache, output_variance=output_variance, **cp)
        hidden_states = hidden_states + self.mixer_dropout(out.o)
        hidden_states = hidden_states + self.mlp_dropout(self.mlp(self.mlp_norm(hidden_states)))
        return hidden_states, out.state, out.variance

    def cp_unsupported(self) -> str | None:
        """Why this block cannot run with a ``cp_context`` (naming the layer and its mixer), or None."""
        cp_unsupported = getattr(self.attn, "cp_unsupported", None)
        reason = cp_unsupported() if cp_unsupported is not None else "it has no context-parallel path"
        if reason is None:
            return None
        return f"layer {self.layer_idx}'s mixer {self.mixer_name!r} cannot run with cp_context: {reason}"


class BayesLayerPreTrainedModel(PreTrainedModel):
    config_class = BayesLayerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BayesLayerBlock"]
    # generate(): the state is recurrent, so no assisted decoding and no default DynamicCache.
    _is_stateful = True
    _input_embed_layer = "embeddings"

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' ``from_pretrained``, strict (:mod:`bayeslayer.models.loading`).

        Before loading, a local folder's ``manifest.json`` (written by :meth:`save_pretrained` and the
        package's own model folders, whose ``config.json`` says so) is verified, pickle weights are refused
        (only safetensors are read, ``use_safetensors=True``), and its ``config.json`` must say
        ``model_type: bayeslayer`` (unless ``config=`` is passed).  A config whose sizes need more memory
        than the machine has is refused naming the field and the file.  After loading, a tensor the model
        needs that the weights lack, a tensor with no place, or a shape that differs raises one
        ``ValueError`` naming the folder and the tensors, and only then are the values checked (NaN/Inf),
        where transformers would leave uninitialised memory and log a line.  ``ignore_mismatched_sizes=True``
        (the caller's choice) initialises the tensors whose shapes differ as a new model's.
        ``output_loading_info=True`` still returns the report.
        """
        from safetensors import SafetensorError

        from .loading import (
            check_finite,
            check_loading_info,
            initialise_as_new,
            local_model_dir,
            naming_config,
            quiet_transformers,
            read_model_config,
            safetensors_error,
            verify_model_dir,
        )

        want_info = kwargs.pop("output_loading_info", False)
        directory = local_model_dir(pretrained_model_name_or_path)
        where = directory if directory is not None else pretrained_model_name_or_path
        if directory is not None:
            verify_model_dir(directory)
            read_model_config(directory, model_type=None if kwargs.get("config") is not None else cls.config_class
                              .model_type)
        kwargs.setdefault("trust_remote_code", False)
        kwargs["use_safetensors"] = True  # a pickle can run code when read
        strict_sizes = not kwargs.get("ignore_mismatched_sizes", False)
        kwargs["ignore_mismatched_sizes"] = True  # reported in the loading info, and refused below by name
        try:
            # transformers' load report is a table of warnings; ours is one error
            with quiet_transformers(), naming_config(where):
                model, info = super().from_pretrained(pretrained_model_name_or_path, *model_args,
                                                      output_loading_info=True, **kwargs)
        except SafetensorError as exc:
            raise (safetensors_error(directory, exc) if directory is not None else ValueError(
                f"{where}: the weights are damaged or not safetensors ({exc})")) from exc
        # shapes before values: a tensor whose shape differs holds no loaded value to check
        check_loading_info(where, info if strict_sizes else {**info, "mismatched_keys": ()})
        # ignore_mismatched_sizes=True (the caller's choice): the report still lists them, for the caller
        initialise_as_new(model, [k[0] if isinstance(k, (tuple, list)) else k
                                  for k in info.get("mismatched_keys") or ()])
        check_finite(model, where)
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``, then ``manifest.json`` (SHA-256 of every file the folder
        holds) last, which :meth:`from_pretrained` verifies."""
        from .loading import write_model_manifest

        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_model_manifest(save_directory)
        return result

    def _init_weights(self, module: nn.Module) -> None:
        """Normal(0, ``initializer_range``) for embeddings, MLPs and the head; ones for the block norms.

        Token mixers are left alone: they initialise their own parameters in their
        constructors (decay parametrisations, noise floors, short convs), and a
        generic normal init would undo that.
        """
        if getattr(module, "_bayeslayer_mixer_part", False):
            return
        std = self.config.initializer_range
        if isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm):
            init.ones_(module.weight)


def _check_ids_and_mask(input_ids, inputs_embeds, attention_mask, vocab_size: int, hidden_size: int):
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids [B, T] and inputs_embeds [B, T, hidden]")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be an integer (int64/int32) tensor, got "
                            f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T] with T >= 1, got shape {tuple(input_ids.shape)}")
        if values_checked(input_ids):
            lo, hi = (int(x) for x in torch.stack((input_ids.min(), input_ids.max())).tolist())
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"input_ids must lie in [0, vocab_size={vocab_size}), got values in "
                                 f"[{lo}, {hi}]")
        B, T = input_ids.shape
    else:
        if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.is_floating_point():
            raise TypeError("inputs_embeds must be a floating-point tensor [B, T, hidden]")
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size or inputs_embeds.shape[1] == 0:
            raise ValueError(
                f"inputs_embeds must be [B, T, hidden={hidden_size}], got {tuple(inputs_embeds.shape)}"
            )
        B, T = inputs_embeds.shape[:2]
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a tensor [B, T], got {type(attention_mask).__name__}")
        if attention_mask.dim() != 2:
            raise ValueError("attention_mask must be a 0/1 tensor [B, T] (1 = token, 0 = left padding), "
                             f"got shape {tuple(attention_mask.shape)}")
        if attention_mask.shape[0] != B or attention_mask.shape[1] < T:
            raise ValueError(
                f"attention_mask must be [B, >= T] = [{B}, >= {T}] (generate() passes the whole history), "
                f"got {tuple(attention_mask.shape)}"
            )
        if values_checked(attention_mask) and bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention_mask must contain only 0 and 1")
        # generate() keeps the mask of the whole history; a mixer sees the rows of this call.
        attention_mask = attention_mask[:, -T:]
        # nothing masked: let mixers take their fast path (decided where reading the mask costs no device sync;
        # elsewhere the mask goes on, which gives the same values)
        if attention_mask.device.type == "cpu" and can_read_values() and bool(attention_mask.all()):
            attention_mask = None
    return B, T, attention_mask


def _check_extra_kwargs(kwargs: dict) -> None:
    unknown = set(kwargs) - _IGNORED_HF_KWARGS
    if "output_variance" in unknown:
        raise TypeError("unexpected keyword argument 'output_variance': the model's flag is output_variances "
                        "(one tuple of per-layer variances; a single mixer takes output_variance)")
    if unknown:
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions is not supported: the mixers do not form attention matrices")


def check_model_fits(config: BayesLayerConfig, *, head: bool = True) -> None:
    """Refuse, before anything is allocated, a config whose embeddings, MLPs and (``head``) output head alone
    need more memory than the machine has: a :class:`~bayeslayer.errors.SizeError` naming the fields
    (``vocab_size: 1000000000000`` in a ``config.json`` would otherwise end in the allocator's error)."""
    V, H, L, inner = config.vocab_size, config.hidden_size, config.num_hidden_layers, config.mlp_intermediate_size
    elements = V * H * (2 if head and not config.tie_word_embeddings else 1) + L * 3 * H * inner
    check_fits(elements * torch.get_default_dtype().itemsize, error=SizeError,
               what=f"a model of vocab_size={V:,}, hidden_size={H:,}, num_hidden_layers={L:,} and MLP width "
                    f"{inner:,} (its embeddings{', head' if head else ''} and MLPs alone)")


class BayesLayerModel(BayesLayerPreTrainedModel):
    """Embeddings → ``num_hidden_layers`` pre-norm (mixer, MLP) blocks → final RMSNorm."""

    def __init__(self, config: BayesLayerConfig) -> None:
        check_model_fits(config, head=False)
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=self.padding_idx)
        self.embedding_dropout = nn.Dropout(config.embedding_dropout)
        forced = forced_backend(getattr(config, "backend", "auto"))
        if forced is not None and not forced.reference and not any(
            _takes_backend(name) for name in config.layer_mixers
        ):
            raise BackendError(
                f"backend={forced.name!r} but none of the model's mixers {sorted(set(config.layer_mixers))} has a "
                f"{forced.label} implementation (the Bayesian Layer has)"
            )
        self.layers = nn.ModuleList([BayesLayerBlock(config, i) for i in range(config.num_hidden_layers)])
        for layer in self.layers:
            for part in layer.attn.modules():
                part._bayeslayer_mixer_part = True
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings = value

    def flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """FLOPs of a training step's forward and backward through the blocks on ``[batch_size, seq_len]``
        token ids (each mixer's :meth:`~bayeslayer.layers.Mixer.flops` and MLP; embedding lookups and norms
        are not counted: :mod:`bayeslayer.ops.flops`)."""
        count = FlopCount()
        for layer in self.layers:
            count = count + layer.attn.flops(batch_size, seq_len) + layer.mlp.flops(batch_size, seq_len)
        return count

    def context_parallel_conv_size(self) -> int | None:
        """The ``conv1d_kernel_size`` to build this model's CP context with
        (:func:`bayeslayer.ops.build_cp_context`): the width of the mixers' short convolutions, None
        without any.  A mixer without a context-parallel path raises ``ValueError`` naming its layer (check
        before training starts), as do short convolutions of different widths."""
        reasons = [r for r in (layer.cp_unsupported() for layer in self.layers) if r is not None]
        if reasons:
            raise ValueError("; ".join(reasons))
        widths = sorted({layer.attn.conv_size for layer in self.layers if getattr(layer.attn, "use_short_conv", False)})
        if len(widths) > 1:
            raise ValueError(f"the layers' short convolutions have widths {widths}: one context-parallel context "
                             "carries one halo width, so context parallelism needs them equal")
        return widths[0] if widths else None

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, cache: BayesLayerCache | None = None,
                use_cache: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, past_key_values: BayesLayerCache | None = None,
                output_variances: bool | None = None, cp_context=None, cu_seqlens: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs) -> BayesLayerModelOutput | tuple:
        """Hidden states ``[B, T, hidden]`` after the final norm; with ``use_cache`` also the updated cache.

        ``attention_mask`` ``[B, T']`` (``T' >= T``; 1 = token, 0 = left padding): the last ``T``
        columns go to every mixer, which keeps padded tokens out of its memory.
        Packed documents (:mod:`bayeslayer.models.packing`): ``cu_seqlens`` (``[N + 1]`` offsets, ``B = 1``, as
        flash-linear-attention's models take them; ``cu_seq_lens_q``/``cu_seq_lens_k`` are accepted too), or
        ``position_ids`` that restart at 0 at every document (Hugging Face's ``DataCollatorWithFlattening``):
        every document starts from the prior state in every layer, as if run alone, and with ``use_cache`` the
        returned cache holds one row per document.  ``position_ids`` that count up by 1 (``generate()``, plain
        batches) change nothing; any other pattern is refused.
        ``past_key_values`` is accepted as the pre-5.x name of ``cache``.  ``output_variances``
        adds each layer's predictive variance (``None`` for mixers without a covariance); it is an
        error for a model without a Bayesian Layer.
        ``cp_context`` (:func:`bayeslayer.ops.build_cp_context`, with the mixers' ``conv_size`` as
        ``conv1d_kernel_size``): the inputs are this rank's slice of one sequence (B = 1) split along T
        across the context's group (docs/context_parallel.md); every mixer must have a context-parallel
        path (the Bayesian Layer with a dense covariance), others are refused by name.
        """
        cu_seqlens = take_flash_attention_kwargs(kwargs, cu_seqlens)
        _check_extra_kwargs(kwargs)
        output_variances = _check_output_variances(output_variances, self)
        if cp_context is not None and (cache is not None or past_key_values is not None or use_cache):
            raise ValueError("cp_context runs a slice of one sequence: pass no cache and use_cache=False")
        if cache is not None and past_key_values is not None:
            raise ValueError("pass the cache as cache or as past_key_values, not both")
        cache = cache if cache is not None else past_key_values
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        use_cache = use_cache if use_cache is not None else (
            self.config.use_cache and not self.training and cp_context is None)
        if use_cache and self.training and torch.is_grad_enabled() and any(
            layer.gradient_checkpointing for layer in self.layers
        ):
            # a checkpointed block is replayed in the backward pass, so it cannot also write a cache
            raise ValueError("use_cache=True cannot be combined with activation checkpointing in training")
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        B, T, mask = _check_ids_and_mask(input_ids, inputs_embeds, attention_mask, self.config.vocab_size,
                                         self.config.hidden_size)
        if cache is not None and not isinstance(cache, BayesLayerCache):
            raise TypeError(f"cache must be a BayesLayerCache (or None), got {type(cache).__name__}")
        if cache is not None and len(cache.layers) != len(self.layers):
            raise ValueError(f"cache has {len(cache.layers)} layers but the model has {len(self.layers)}")
        device = (input_ids if inputs_embeds is None else inputs_embeds).device
        cu = None
        if cu_seqlens is not None or position_ids is not None:
            if cp_context is not None:
                raise ValueError("with cp_context, pass the global cu_seqlens to build_cp_context, not cu_seqlens or "
                                 "position_ids")
            cu = resolve_packing(cu_seqlens, position_ids, batch=B, length=T, device=device,
                                 valid=None if mask is None else mask.bool(),
                                 continuing=cache is not None and cache.get_seq_length() > 0)
        if use_cache and cache is None:
            cache = BayesLayerCache(len(self.layers))

        hidden_states = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        hidden_states = self.embedding_dropout(hidden_states)
        if cu is not None:  # the documents of every row, one after another in one packed row
            hidden_states, mask = hidden_states.reshape(1, B * T, -1), None
        unpack = (lambda x: x) if cu is None else (lambda x: None if x is None else x.reshape(B, T, *x.shape[2:]))
        all_hidden = () if output_hidden_states else None
        variances = () if output_variances else None
        for idx, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden += (unpack(hidden_states),)
            state = cache[idx] if cache is not None else None
            hidden_states, new_state, variance = layer(hidden_states, attention_mask=mask, state=state,
                                                       use_cache=use_cache, output_variance=output_variances,
                                                       cp_context=cp_context, cu_seqlens=cu)
            if use_cache:
                cache.set_state(idx, new_state, T)
            if output_variances:
                variances += (unpack(variance),)
        hidden_states = unpack(self.norm(hidden_states))
        if output_hidden_states:
            all_hidden += (hidden_states,)
        cache = cache if use_cache else None
        if not return_dict:
            return tuple(x for x in (hidden_states, cache, all_hidden, variances) if x is not None)
        return BayesLayerModelOutput(last_hidden_state=hidden_states, cache=cache, hidden_states=all_hidden,
                                     variances=variances, cu_seqlens=cu)


class BayesLayerForCausalLM(BayesLayerPreTrainedModel, GenerationMixin):
    """:class:`BayesLayerModel` plus a language-model head; ``labels`` gives the shifted next-token loss."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: BayesLayerConfig) -> None:
        check_model_fits(config)
        super().__init__(config)
        self.model = BayesLayerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def get_decoder(self) -> BayesLayerModel:
        return self.model

    def flops(self, batch_size: int, seq_len: int) -> FlopCount:
        """FLOPs of one training step (forward and backward) on ``[batch_size, seq_len]`` token ids: the
        decoder's (:meth:`BayesLayerModel.flops`) and the output head's, by :mod:`bayeslayer.ops.flops`'
        convention (matrix products, convolutions and the filters' factorizations; elementwise work not
        counted), without activation checkpointing.  The tests hold it within 10% of PyTorch's
        ``FlopCounterMode``."""
        t = Tally()
        t.linear(check_int("batch_size", batch_size, minimum=1) * check_int("seq_len", seq_len, minimum=1),
                 self.config.hidden_size, self.config.vocab_size)
        return self.model.flops(batch_size, seq_len) + t.count()

    def context_parallel_conv_size(self) -> int | None:
        """:meth:`BayesLayerModel.context_parallel_conv_size` of the decoder."""
        return self.model.context_parallel_conv_size()

    def set_decoder(self, decoder: BayesLayerModel) -> None:
        self.model = decoder

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, cache: BayesLayerCache | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None, logits_to_keep: int = 0,
                past_key_values: BayesLayerCache | None = None, num_items_in_batch: int | torch.Tensor | None = None,
                output_variances: bool | None = None, cu_seqlens: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs) -> BayesLayerCausalLMOutput | tuple:
        """Logits ``[B, T, V]`` (the last ``logits_to_keep`` positions if > 0) and, with ``labels``
        ``[B, T]``, the mean cross-entropy of predicting ``labels[:, t+1]`` from position ``t``
        (label ``-100`` is ignored, as in transformers).  With ``num_items_in_batch`` (the
        ``Trainer``'s count of labelled tokens over gradient-accumulation steps) the loss is the
        summed cross-entropy divided by it.  The cross-entropy is computed in :func:`loss_dtype` (float32,
        float64 for a float64 model).  ``output_variances`` adds the per-layer predictive
        variances (see :class:`BayesLayerModelOutput`).  Packed documents (``cu_seqlens`` or flattening
        ``position_ids``, see :meth:`BayesLayerModel.forward`) give the loss of the documents run one by one:
        a document's first token is never the target of the previous document's last."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if labels is not None and kwargs.get("cp_context") is not None:
            raise ValueError("with cp_context, compute the loss from the logits: the label after a slice's last "
                             "token is on the next rank (docs/context_parallel.md)")
        if not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be a non-negative int, got {logits_to_keep!r}")
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            cache=cache,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            past_key_values=past_key_values,
            output_variances=output_variances,
            cu_seqlens=cu_seqlens,
            position_ids=position_ids,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        loss = None
        if labels is not None:
            if not isinstance(labels, torch.Tensor) or labels.shape != hidden_states.shape[:2]:
                raise ValueError(
                    f"labels must be [B, T] = {tuple(hidden_states.shape[:2])}, got "
                    f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}"
                )
            logits = self.lm_head(hidden_states)
            if outputs.cu_seqlens is not None:  # no target across a document boundary
                labels = labels.masked_fill(document_starts(outputs.cu_seqlens, *labels.shape).to(labels.device), -100)
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).to(loss_dtype(logits.dtype)),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
                reduction="mean" if num_items_in_batch is None else "sum",
            )
            if num_items_in_batch is not None:
                loss = loss / num_items_in_batch
            if logits_to_keep:
                logits = logits[:, -logits_to_keep:]
        else:
            kept = hidden_states[:, -logits_to_keep:] if logits_to_keep else hidden_states
            logits = self.lm_head(kept)
        if not return_dict:
            rest = tuple(x for x in (outputs.cache, outputs.hidden_states, outputs.variances) if x is not None)
            return ((loss,) if loss is not None else ()) + (logits,) + rest
        return BayesLayerCausalLMOutput(loss=loss, logits=logits, cache=outputs.cache,
                                        hidden_states=outputs.hidden_states, variances=outputs.variances)

    def generate(self, *args, output_variances: bool | None = None, **kwargs):
        """transformers' ``generate``; with ``output_variances=True`` (which needs
        ``return_dict_in_generate=True``) its output also has ``variances``, one per-layer tuple per
        generated token (:class:`BayesLayerGenerateOutput`).  Through the recurrent cache these are the
        values a full forward over the same tokens gives."""
        if not _check_output_variances(output_variances, self.model):
            return super().generate(*args, **kwargs)
        config = kwargs.get("generation_config") or self.generation_config
        if not kwargs.get("return_dict_in_generate", getattr(config, "return_dict_in_generate", False)):
            raise ValueError("generate(output_variances=True) needs return_dict_in_generate=True (the variances "
                             "are a field of the returned output)")
        collected = []

        def collect(module, inputs, output):
            collected.append(output.variances if isinstance(output, BayesLayerCausalLMOutput) else output[-1])

        handle = self.register_forward_hook(collect)
        try:
            out = super().generate(*args, output_variances=True, **kwargs)
        finally:
            handle.remove()
        beam = isinstance(out, GenerateBeamDecoderOnlyOutput)
        cls = BayesLayerGenerateBeamOutput if beam else BayesLayerGenerateOutput
        return cls(**out, variances=tuple(collected))


class ParameterCount(NamedTuple):
    """``total`` unique parameters; ``embedding`` = input embeddings (+ an untied head); ``non_embedding``."""

    total: int
    embedding: int
    non_embedding: int


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> ParameterCount:
    """Count unique parameters (a tied head is counted once).

    ``non_embedding`` excludes the token embeddings and an untied output head, the
    usual convention for sizing language models (e.g. the paper's 16–18M for width
    512, 4 layers). Works on :class:`BayesLayerForCausalLM`, :class:`BayesLayerModel`
    or any module (then embeddings are its ``nn.Embedding`` modules).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    seen: set[int] = set()

    def _count(params) -> int:
        n = 0
        for p in params:
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            n += p.numel()
        return n

    embedding_params = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        embedding_params += list(head.parameters())
    embedding = _count(embedding_params)
    rest = _count(model.parameters())
    return ParameterCount(total=embedding + rest, embedding=embedding, non_embedding=rest)
