"""bayeslayer: the Bayesian Layer (Kalman-filter memory with a covariance) and its design-model family."""

from .ops import bl_chunk, bl_recurrent, bl_step

__version__ = "0.1.0"
__all__ = ["bl_chunk", "bl_recurrent", "bl_step", "__version__"]
