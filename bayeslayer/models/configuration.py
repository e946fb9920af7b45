"""``BayesLayerConfig``: a Hugging Face config for a stack of (mixer, SwiGLU MLP) blocks.

The per-layer token mixer is chosen by name from :data:`bayeslayer.layers.MIXERS`,
so Bayesian Layer / Gated DeltaNet / attention hybrids are one config away::

    BayesLayerConfig(mixer="gated_deltanet", mixer_overrides={5: "bayesian", 11: "bayesian"})
    BayesLayerConfig(mixers=["bayesian", "gated_deltanet", "attention"], num_hidden_layers=3)
"""

from __future__ import annotations

import numbers
from typing import Any

from transformers.configuration_utils import PretrainedConfig

from ..checks import check_int
from ..ops.backend import check_backend

_DROPOUTS = ("embedding_dropout", "mixer_dropout", "mlp_dropout", "mlp_hidden_dropout")


def _known_mixers() -> tuple[str, ...] | None:
    """The registry's names, or None while the layers package has no registry (checked at build then)."""
    try:
        from ..layers import MIXERS
    except ImportError:
        return None
    return tuple(sorted(MIXERS))


def _layer_index_dict(name: str, value: Any, num_layers: int) -> dict[int, Any]:
    """A ``{layer index: item}`` dict; JSON turns int keys into strings, so accept ``"3"`` as 3."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict {{layer index: ...}}, got {type(value).__name__}")
    out = {}
    for key, item in value.items():
        try:
            idx = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"{name} keys must be layer indices, got {key!r}") from None
        if isinstance(key, bool) or str(idx) != str(key).strip() or not 0 <= idx < num_layers:
            raise ValueError(f"{name} has layer index {key!r}; valid indices are 0..{num_layers - 1}")
        out[idx] = item
    return out


class BayesLayerConfig(PretrainedConfig):
    """Configuration of :class:`~bayeslayer.models.BayesLayerForCausalLM`.

    Args:
        vocab_size, hidden_size, num_hidden_layers: the usual sizes.
        num_heads, head_dim: heads and key dim per head, passed to every mixer.
        mixer: the mixer name used by every layer (``bayesian``, ``gated_deltanet``, ``attention``, ...).
        mixers: an explicit list of ``num_hidden_layers`` mixer names (takes precedence over ``mixer``).
        mixer_overrides: ``{layer index: mixer name}`` applied on top of ``mixer``/``mixers``.
        mixer_kwargs: ``{mixer name: {kwarg: value}}`` extra constructor arguments for every layer
            using that mixer (e.g. ``{"bayesian": {"p0": 1.0}, "gated_deltanet": {"expand_v": 2}}``).
        layer_mixer_kwargs: ``{layer index: {kwarg: value}}``, applied last for that layer.
        hidden_ratio, intermediate_size: SwiGLU width; with ``intermediate_size=None`` it is
            ``2/3 · hidden_ratio · hidden_size`` rounded up to a multiple of 256 (as flash-linear-attention).
        hidden_act: ``swish`` (SwiGLU), the only MLP activation.
        norm_eps: RMSNorm epsilon of the block and final norms.
        embedding_dropout: dropout on the token embeddings.
        mixer_dropout: dropout on each mixer's output before its residual add.
        mlp_dropout: dropout on each MLP's output before its residual add (the paper's "MLP dropout").
        mlp_hidden_dropout: dropout on the SwiGLU hidden activation, before ``down_proj``.
        tie_word_embeddings: share ``lm_head.weight`` with ``model.embeddings.weight``.
        initializer_range: std of the normal init of embeddings, MLPs and the head (mixers initialise
            themselves, since their parameters have their own parametrisations).
        backend: ``"auto"`` (default), ``"torch"`` or ``"triton"``, passed to every mixer that has a
            Triton implementation (the Bayesian Layer; :mod:`bayeslayer.ops.backend`), for training,
            prefill and cached decoding.  This is the one place a model's backend is set:
            ``mixer_kwargs``/``layer_mixer_kwargs`` holding ``backend`` raise ``ValueError``.
    """

    model_type = "bayeslayer"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 512,
        num_hidden_layers: int = 4,
        num_heads: int = 4,
        head_dim: int = 128,
        mixer: str = "bayesian",
        mixers: list[str] | None = None,
        mixer_overrides: dict[int, str] | None = None,
        mixer_kwargs: dict[str, dict] | None = None,
        layer_mixer_kwargs: dict[int, dict] | None = None,
        hidden_ratio: float | None = 4,
        intermediate_size: int | None = None,
        hidden_act: str = "swish",
        norm_eps: float = 1e-6,
        embedding_dropout: float = 0.0,
        mixer_dropout: float = 0.0,
        mlp_dropout: float = 0.0,
        mlp_hidden_dropout: float = 0.0,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        tie_word_embeddings: bool = False,
        backend: str = "auto",
        **kwargs,
    ):
        from .loading import MANIFEST_KEY

        kwargs.pop(MANIFEST_KEY, None)  # a fact of the folder the config was read from (loading.py), not of the model
        self._refuse_derived(kwargs)
        self.vocab_size = check_int("vocab_size", vocab_size, minimum=1)
        self.hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        self.num_hidden_layers = check_int("num_hidden_layers", num_hidden_layers, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self._set_layer_mixers(mixer, mixers, mixer_overrides)
        self._set_mixer_kwargs(mixer_kwargs, layer_mixer_kwargs, backend)
        self._set_mlp(hidden_ratio, intermediate_size, hidden_act)
        self._set_norm_dropout_init(norm_eps, (embedding_dropout, mixer_dropout, mlp_dropout, mlp_hidden_dropout),
                                    initializer_range)
        self.use_cache = bool(use_cache)
        self.backend = check_backend(backend)
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    # -- the steps of __init__ ---------------------------------------------------------------------
    @classmethod
    def _refuse_derived(cls, kwargs: dict[str, Any]) -> None:
        """A derived, read-only property passed as an argument (or found in a config.json) would reach
        PretrainedConfig's setattr and fail as "property ... has no setter": say what to pass instead."""
        derived = sorted(k for k in kwargs
                         if isinstance(getattr(cls, k, None), property) and getattr(cls, k).fset is None)
        if derived:
            hint = {"layer_mixers": "pass mixers=[one name per layer] (or mixer= and mixer_overrides=)",
                    "mlp_intermediate_size": "pass intermediate_size="}
            raise ValueError(f"{', '.join(derived)} is derived from the other arguments and cannot be set: "
                             + "; ".join(hint.get(k, f"remove {k}") for k in derived))

    @staticmethod
    def _mixer_name(where: str, name: Any) -> str:
        """``name`` when it is a registered mixer (any string while the registry cannot be imported)."""
        if not isinstance(name, str):
            raise TypeError(f"{where} must be a mixer name (str), got {type(name).__name__}")
        known = _known_mixers()
        if known is not None and name not in known:
            raise ValueError(f"{where} names unknown mixer {name!r}; known mixers: {list(known)}")
        return name

    def _set_layer_mixers(self, mixer: Any, mixers: Any, mixer_overrides: Any) -> None:
        """``mixer``, ``mixers`` (one name per layer) and ``mixer_overrides`` (``{layer index: name}``)."""
        self.mixer = self._mixer_name("mixer", mixer)
        if mixers is not None:
            if not isinstance(mixers, (list, tuple)) or len(mixers) != self.num_hidden_layers:
                got = len(mixers) if isinstance(mixers, (list, tuple)) else type(mixers).__name__
                raise ValueError(
                    f"mixers must be a list of num_hidden_layers={self.num_hidden_layers} names, got {got}"
                )
            mixers = [self._mixer_name(f"mixers[{i}]", m) for i, m in enumerate(mixers)]
        self.mixers = mixers
        overrides = _layer_index_dict("mixer_overrides", mixer_overrides, self.num_hidden_layers)
        self.mixer_overrides = {i: self._mixer_name(f"mixer_overrides[{i}]", m) for i, m in overrides.items()}

    def _set_mixer_kwargs(self, mixer_kwargs: Any, layer_mixer_kwargs: Any, backend: Any) -> None:
        """Per-name and per-layer constructor keywords; none may set what the model sets (or the backend)."""
        mixer_kwargs = {} if mixer_kwargs is None else mixer_kwargs
        if not isinstance(mixer_kwargs, dict) or not all(isinstance(v, dict) for v in mixer_kwargs.values()):
            raise TypeError("mixer_kwargs must be a dict {mixer name: {kwarg: value}}")
        for name in mixer_kwargs:
            self._mixer_name("mixer_kwargs key", name)
        self.mixer_kwargs = {name: dict(kw) for name, kw in mixer_kwargs.items()}
        per_layer = _layer_index_dict("layer_mixer_kwargs", layer_mixer_kwargs, self.num_hidden_layers)
        if not all(isinstance(v, dict) for v in per_layer.values()):
            raise TypeError("layer_mixer_kwargs must be a dict {layer index: {kwarg: value}}")
        self.layer_mixer_kwargs = {i: dict(kw) for i, kw in per_layer.items()}
        reserved = {"hidden_size", "layer_idx"}
        for where, kw in [*((f"mixer_kwargs[{n!r}]", k) for n, k in self.mixer_kwargs.items()),
                          *((f"layer_mixer_kwargs[{i}]", k) for i, k in self.layer_mixer_kwargs.items())]:
            if reserved & set(kw):
                raise ValueError(f"{where} may not set {sorted(reserved & set(kw))}: the model sets them")
            if "backend" in kw:
                raise ValueError(f"{where} may not set 'backend': a model has one backend, set it with "
                                 f"BayesLayerConfig(backend=...) (got backend={backend!r} there)")

    def _set_mlp(self, hidden_ratio: Any, intermediate_size: Any, hidden_act: Any) -> None:
        if hidden_ratio is not None and not (isinstance(hidden_ratio, numbers.Real) and hidden_ratio > 0):
            raise ValueError(f"hidden_ratio must be a positive number or None, got {hidden_ratio!r}")
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = (
            None if intermediate_size is None else check_int("intermediate_size", intermediate_size, minimum=1)
        )
        if hidden_act != "swish":
            raise ValueError(f"hidden_act must be 'swish' (a SwiGLU MLP), got {hidden_act!r}")
        self.hidden_act = hidden_act

    def _set_norm_dropout_init(self, norm_eps: Any, dropouts: tuple, initializer_range: Any) -> None:
        if not (isinstance(norm_eps, numbers.Real) and norm_eps > 0):
            raise ValueError(f"norm_eps must be a positive number, got {norm_eps!r}")
        self.norm_eps = float(norm_eps)
        for name, p in zip(_DROPOUTS, dropouts, strict=True):
            if not (isinstance(p, numbers.Real) and not isinstance(p, bool) and 0.0 <= p < 1.0):
                raise ValueError(f"{name} must be a probability in [0, 1), got {p!r}")
            setattr(self, name, float(p))
        if not (isinstance(initializer_range, numbers.Real) and initializer_range > 0):
            raise ValueError(f"initializer_range must be a positive number, got {initializer_range!r}")
        self.initializer_range = float(initializer_range)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' ``from_pretrained``; a local folder's ``config.json`` must be a readable JSON object
        with ``model_type: bayeslayer`` (transformers only warns about another type)."""
        from .loading import local_model_dir, read_model_config

        directory = local_model_dir(pretrained_model_name_or_path)
        if directory is not None and (directory / "config.json").exists():
            read_model_config(directory, model_type=cls.model_type)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    # -- derived quantities ------------------------------------------------------------------------
    @property
    def layer_mixers(self) -> list[str]:
        """The mixer name of every layer: ``mixers`` (or ``mixer`` repeated), then ``mixer_overrides``."""
        names = list(self.mixers) if self.mixers is not None else [self.mixer] * self.num_hidden_layers
        for idx, name in self.mixer_overrides.items():
            names[int(idx)] = name
        return names

    def mixer_arguments(self, layer_idx: int) -> tuple[str, dict[str, Any]]:
        """``(name, kwargs)`` of layer ``layer_idx``: heads, head dim, per-name then per-layer kwargs."""
        if not isinstance(layer_idx, numbers.Integral) or not 0 <= layer_idx < self.num_hidden_layers:
            raise ValueError(f"layer_idx must be in 0..{self.num_hidden_layers - 1}, got {layer_idx!r}")
        name = self.layer_mixers[layer_idx]
        kwargs: dict[str, Any] = {"num_heads": self.num_heads, "head_dim": self.head_dim}
        kwargs.update(self.mixer_kwargs.get(name, {}))
        kwargs.update(self.layer_mixer_kwargs.get(int(layer_idx), {}))
        return name, kwargs

    @property
    def mlp_intermediate_size(self) -> int:
        """SwiGLU width, computed as flash-linear-attention's ``GatedMLP`` does when not given."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        ratio = 4 if self.hidden_ratio is None else self.hidden_ratio
        size = int(self.hidden_size * ratio * 2 / 3)
        return 256 * ((size + 255) // 256)
