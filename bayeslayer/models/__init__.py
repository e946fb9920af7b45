"""Language model, checkpoints and retrofit.

* :class:`BayesLayerConfig`, :class:`BayesLayerModel`, :class:`BayesLayerForCausalLM`: a Hugging Face
  model (``model_type = "bayeslayer"``, registered with ``AutoConfig``/``AutoModel``/``AutoModelForCausalLM``)
  whose blocks use any mixer of :mod:`bayeslayer.layers`, per layer.
* :func:`load_gdn_checkpoint`: a flash-linear-attention Gated DeltaNet checkpoint → our model (runs on CPU).
* :func:`replace_layers`: swap chosen layers' mixers for Bayesian Layers, initialised from the GDN teacher.
* :func:`count_parameters`: total and non-embedding parameter counts.
* :mod:`~bayeslayer.models.loading`: what every loader of the package checks (SHA-256 manifest of the
  folders it saves, no holes in the weights, the right ``model_type``, finite values, no remote code).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import BayesLayerCache
from .configuration import BayesLayerConfig
from .fla_import import gdn_config_to_bayeslayer, load_gdn_checkpoint
from .modeling import (
    BayesLayerBlock,
    BayesLayerCausalLMOutput,
    BayesLayerForCausalLM,
    BayesLayerGenerateBeamOutput,
    BayesLayerGenerateOutput,
    BayesLayerModel,
    BayesLayerModelOutput,
    BayesLayerPreTrainedModel,
    ParameterCount,
    count_parameters,
)
from .retrofit import replace_layers

AutoConfig.register(BayesLayerConfig.model_type, BayesLayerConfig, exist_ok=True)
AutoModel.register(BayesLayerConfig, BayesLayerModel, exist_ok=True)
AutoModelForCausalLM.register(BayesLayerConfig, BayesLayerForCausalLM, exist_ok=True)

__all__ = [
    "BayesLayerBlock",
    "BayesLayerCache",
    "BayesLayerCausalLMOutput",
    "BayesLayerConfig",
    "BayesLayerForCausalLM",
    "BayesLayerGenerateBeamOutput",
    "BayesLayerGenerateOutput",
    "BayesLayerModel",
    "BayesLayerModelOutput",
    "BayesLayerPreTrainedModel",
    "ParameterCount",
    "count_parameters",
    "gdn_config_to_bayeslayer",
    "load_gdn_checkpoint",
    "replace_layers",
]
