"""bayeslayer: the Bayesian Layer (Kalman-filter memory with a covariance) and its design-model family.

Importing the package registers its language model with ``transformers``' Auto classes when (and only when)
``transformers`` loads them (:mod:`bayeslayer.autoregister`); ``transformers`` stays optional.
"""

from . import autoregister
from .ops import bl_chunk, bl_recurrent, bl_step

autoregister.install()

__version__ = "0.1.0"
__all__ = ["bl_chunk", "bl_recurrent", "bl_step", "__version__"]
