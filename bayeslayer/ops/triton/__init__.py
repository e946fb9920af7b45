"""Triton kernels for the chunked Bayesian Layer (docs/theory.md §6).

``bl_chunk_triton`` and ``bl_step_triton`` have the contracts of
:func:`bayeslayer.ops.bl_chunk` and :func:`bayeslayer.ops.bl_step`.  Importing this
package does not import Triton; the kernels are compiled on first call.  On a
CPU set ``TRITON_INTERPRET=1`` before Triton is first imported to run them in
Triton's interpreter (how the tests run them).
"""

from .chunk import bl_chunk_triton, set_triton_backward, triton_available
from .step import bl_step_triton

__all__ = ["bl_chunk_triton", "bl_step_triton", "set_triton_backward", "triton_available"]
