"""What a piece of the export launches, counted on the CPU: the ops that run a kernel, and the
numbers read back to the host one at a time. On a GPU each op is a launch and each read a
wait for the device, so both are what a design for GPUs keeps few (tests bound them)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CountKernels"]

_VIEWS = {torch.ops.aten.detach.default, torch.ops.aten.slice.Tensor}


class CountKernels(TorchDispatchMode):
    """Counts the ops that run a kernel (views, slices and the like excluded) and the reads."""

    kernels = 0
    reads = 0
    """Numbers read back to the host one at a time (``int(t)``, ``t.item()``)."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.kernels += not func.is_view and func not in _VIEWS
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))
