"""Building the planned model on the meta device, whatever device its factory would pick.

A user's factory usually builds the model on the CPU (``Llama(config)``). The planner needs
shapes and dtypes only, so it calls the factory inside ``torch.device("meta")``: every tensor
a factory function (``torch.empty``, ``torch.arange``, an ``nn.Linear``'s weight) creates
without naming a device lands on meta, and nothing is allocated. What escapes that context is
a tensor made on a device named explicitly (``device="cpu"``, ``.to("cuda")``), loaded from a
file or converted from NumPy: such a model is refused, naming the tensor, since planning it
would allocate (and an 8B model does not fit in memory).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["NotAModuleError", "OffMetaError", "build_on_meta", "off_meta_tensors"]


class OffMetaError(ValueError):
    """A model built under ``torch.device("meta")`` that still holds tensors elsewhere."""


class NotAModuleError(TypeError):
    """A model factory that returned something other than an ``nn.Module``."""


def off_meta_tensors(model: nn.Module) -> list[str]:
    """Parameters and buffers of ``model`` not on the meta device: '<kind> <fqn> (on <device>)'."""
    found = [
        f"parameter {name} (on {p.device})" for name, p in model.named_parameters() if not p.is_meta
    ]
    found += [
        f"buffer {name} (on {b.device})" for name, b in model.named_buffers() if not b.is_meta
    ]
    return found


def build_on_meta(factory: Callable[[], object], name: str) -> nn.Module:
    """Calls ``factory`` inside ``torch.device("meta")`` and checks what it built.

    Args:
        factory: A callable returning the model (on any device, or on meta already).
        name: What to call the factory in errors (its ``module:function`` spec).

    Returns:
        The model, with every parameter and buffer on the meta device.

    Raises:
        NotAModuleError: the factory returned something other than an ``nn.Module``.
        OffMetaError: a parameter or buffer is not on meta (the first few are named).
        Exception: whatever the factory raised, unchanged.
    """
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise NotAModuleError(f"{name} returned {type(model).__name__}, not an nn.Module")
    stray = off_meta_tensors(model)
    if stray:
        shown = ", ".join(stray[:3]) + (f" and {len(stray) - 3} more" if len(stray) > 3 else "")
        raise OffMetaError(
            f"{name} was built under torch.device('meta') but placed {shown} on a device "
            "of its own (an explicit device=, .to(), a loaded file or NumPy data escape the "
            "meta context); planning it would allocate that memory. Let the factory create "
            "these tensors without naming a device, or with device='meta'"
        )
    return model
