"""Accelerate's FSDP path on CPU processes, for tests.

Accelerate (1.15) takes its FSDP plugin only on accelerators: with ``use_cpu=True`` under ``torchrun`` its state
is ``MULTI_CPU`` and a plugin that ``Trainer`` or the caller passes is dropped, so the model is wrapped in DDP
instead, silently.  :func:`take_fsdp_path_on_cpu` makes ``AcceleratorState`` do on the CPU what it does on a
GPU with a plugin (``accelerate/state.py``: the ``distributed_type`` becomes ``FSDP``, the plugin is kept and
takes the mixed precision, and ``PartialState`` shares the type); everything after that (``fully_shard`` of the
wrap class, clipping, the optimiser, gathering the state for saving) is Accelerate's and Trainer's own code.
"""

from __future__ import annotations

import functools


def take_fsdp_path_on_cpu() -> None:
    """Patch ``accelerate.state.AcceleratorState.__init__`` in this process (call it before the Trainer or the
    Accelerator is built).  Idempotent."""
    from accelerate.state import AcceleratorState, DistributedType, PartialState

    original = AcceleratorState.__init__
    if getattr(original, "_fsdp_on_cpu", False):
        return

    @functools.wraps(original)
    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type

    init._fsdp_on_cpu = True
    AcceleratorState.__init__ = init
