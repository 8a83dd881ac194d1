"""Gradient hooks that hold their object weakly.

torch keeps a post-accumulate-grad hook on the tensor's C++ side, out of the garbage
collector's sight: a hook that held its group (which holds the parameter it is on) would be a
cycle never collected, and every sharded model, shards and all, would live as long as the
process. So the engine's gradient hooks call a bound method through a weak reference.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

__all__ = ["weak_grad_hook"]


def weak_grad_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """A gradient hook that calls the bound ``method`` while its object lives."""
    ref = weakref.WeakMethod(method)  # its object is held weakly

    def hook(tensor: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(tensor)

    return hook
