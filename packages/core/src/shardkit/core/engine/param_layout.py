"""One parameter in the layout arithmetic: :class:`ParamSpec` in, :class:`ParamLayout` out.

A :class:`ParamSpec` is a parameter as ``buffer_layout.group_layout`` needs it (shape, dtype,
how it is gathered; with all-gather hooks, the :class:`HookInput` tensors they send); a
:class:`ParamLayout` is where ``group_layout`` put it in its group's flat buffers, and its
shards' sizes. Values only: nothing here computes a layout. A parameter describes itself in
a spec (``param``), the group's layout is made of them (``buffer_layout``), and the all-gather
hooks report their tensors in them (``gather_hooks``); ``shardkit.core.layout`` publishes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from shardkit.core.runtime.buffers import FlatLayout, ShardGeometry

__all__ = ["HookInput", "ParamLayout", "ParamSpec"]


class HookInput(NamedTuple):
    """One tensor that a parameter's ``fsdp_pre_all_gather`` hook returns for the all-gather."""

    numel: int
    dtype: torch.dtype


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamSpec:
    """A parameter as :func:`group_layout` needs it: shape and dtype, nothing allocated."""

    fqn: str
    """Its name relative to the sharded module (for messages and views)."""
    shape: tuple[int, ...]
    """The shape that the data-parallel axis shards (the full shape without TP)."""
    dtype: torch.dtype
    """Its own dtype: that of the sharded parameter, its gradient and optimizer state."""
    requires_grad: bool = True
    """Whether it is trained (its gradient is reduce-scattered)."""
    shard_dim: int = 0
    """The tensor dim the data-parallel axis shards (non-negative)."""
    all_gather_hooks: bool = False
    """Whether it is a tensor subclass gathered through its ``fsdp_pre_all_gather`` and
    ``fsdp_post_all_gather`` hooks: then it keeps its own storage, and what the all-gather
    sends is what the hook returns. See [Note: all-gather extensions]."""
    all_gather_inputs: tuple[HookInput, ...] | None = None
    """With hooks: the tensors the pre-all-gather hook returns, once known (the engine learns
    them at the group's first unshard); None before, or without hooks."""
    keeps_own_dtype: bool = False
    """Whether ``MixedPrecisionPolicy.param_dtype_override_fn`` keeps it out of
    ``param_dtype``: it is gathered and computed in its own dtype."""
    grad_dtype_policy: tuple[bool, torch.dtype | None] = (False, None)
    """Whether its user set its ``grad_dtype`` (torch 2.15 on), and to what (None: any)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamLayout:
    """Where one parameter lives in its group's flat buffers."""

    fqn: str
    """Its name relative to the sharded module."""
    geometry: ShardGeometry
    """How it is cut into shards along ``shard_dim`` (torch.chunk semantics)."""
    dtype: torch.dtype
    """Its own dtype (sharded parameter, gradient, optimizer state)."""
    comm_dtype: torch.dtype
    """The dtype of the all-gather and of the unsharded parameter (``param_dtype`` if set).
    With all-gather hooks, the dtype the post-all-gather hook is asked for; the all-gather
    sends the dtypes of ``all_gather_inputs``."""
    requires_grad: bool
    """Whether it is trained."""
    storage_offset: int
    """Byte offset of its padded shard in the group's sharded buffer."""
    comm_offset: int
    """Byte offset of its padded shard in one rank's all-gather input."""
    unsharded_offset: int
    """Byte offset of its padded full tensor in the group's unsharded buffer."""
    all_gather_hooks: bool = False
    """Whether it is gathered through its subclass's all-gather hooks. Then its slot in the
    sharded and unsharded buffers is empty (it keeps its own storage, and the hooks' outputs
    and unsharded tensor are its own), and its slot in the all-gather input is the bytes of
    ``all_gather_inputs``."""
    all_gather_inputs: FlatLayout | None = None
    """With hooks, once known: where each tensor the pre-all-gather hook returns lies in this
    parameter's slot of the all-gather input (16-byte aligned). Its all-gather output ``k``
    holds ``shard_world`` times input ``k``."""

    @property
    def shape(self) -> torch.Size:
        """The full shape (what the data-parallel axis shards)."""
        return self.geometry.shape

    @property
    def shard_dim(self) -> int:
        """The sharded tensor dim."""
        return self.geometry.dim

    @property
    def shard_world(self) -> int:
        """Number of shards."""
        return self.geometry.world

    @property
    def chunk(self) -> int:
        """Size of every padded shard along ``shard_dim``."""
        return self.geometry.chunk

    @property
    def padded_shard_shape(self) -> torch.Size:
        """Shape of one padded shard: what every rank contributes to the all-gather."""
        return self.geometry.padded_shard_shape

    @property
    def shard_numel(self) -> int:
        """Elements of one padded shard."""
        return self.geometry.shard_numel

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return self.geometry.shape.numel()

    def local_length(self, rank: int) -> int:
        """Size along ``shard_dim`` of ``rank``'s real (unpadded) shard."""
        return self.geometry.local_length(rank)

    def local_shape(self, rank: int) -> torch.Size:
        """Shape of ``rank``'s unpadded shard: what its DTensor's local tensor shows."""
        return self.geometry.local_shape(rank)

    def local_numel(self, rank: int) -> int:
        """Elements of ``rank``'s unpadded shard."""
        return self.geometry.local_shape(rank).numel()
