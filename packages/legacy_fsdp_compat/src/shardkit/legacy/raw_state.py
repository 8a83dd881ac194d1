"""A wrapped module's raw state, and the switch that makes wrappers give it.

Under :func:`plain_state_dicts`, every wrapper's ``state_dict()`` is ``nn.Module``'s own:
raw names (inner wrappers show as ``_fsdp_wrapped_module``) and the core's values (sharded
parameters as DTensors). The core's full-state-dict generator and its loader read a module
that way; the handlers then turn names and values into FSDP1's.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardkit.legacy.buffers import original_dtype
from shardkit.legacy.flat_params import per_parameter_view
from shardkit.legacy.torch_compat import clean_name
from shardkit.legacy.units import unit_of

__all__ = ["PLAIN", "RawState", "plain_state_dicts", "raw_state"]

PLAIN: contextvars.ContextVar[bool] = contextvars.ContextVar("PLAIN", default=False)


@contextlib.contextmanager
def plain_state_dicts() -> Iterator[None]:
    """Inside, wrappers give ``nn.Module``'s own state dict (raw names, core values)."""
    token = PLAIN.set(True)
    try:
        yield
    finally:
        PLAIN.reset(token)


class RawState:
    """A wrapped module's raw state: its tensors, clean name to raw name, buffer dtypes."""

    def __init__(self, module: nn.Module) -> None:
        with per_parameter_view(), plain_state_dicts():  # the originals, not flat ones
            raw = module.state_dict(keep_vars=True)
            params = {name for name, _ in module.named_parameters()}
        self.params: set[str] = params
        """Raw names of parameters (the rest are buffers and extra state)."""
        self.values: dict[str, Any] = dict(raw)
        """Raw name -> value (sharded parameters are the core's DTensors)."""
        self.raw_of: dict[str, str] = {clean_name(k): k for k in raw}
        """Clean name -> raw name, in state-dict order."""
        self.buffer_dtypes: dict[str, torch.dtype] = {}
        """Raw name -> original dtype of each buffer that mixed precision cast."""
        for prefix, sub in module.named_modules():
            for name, _ in sub.named_buffers(recurse=False):
                dtype = original_dtype(sub, name)
                if dtype is not None:
                    self.buffer_dtypes[f"{prefix}.{name}" if prefix else name] = dtype


def raw_state(wrapper: nn.Module) -> RawState:
    """The raw state of ``wrapper``'s module."""
    return RawState(unit_of(wrapper).module)
