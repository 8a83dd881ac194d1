"""The layout arithmetic of a parameter group, from parameter shapes alone.

:func:`group_layout` computes where each parameter lives in its group's flat buffers and how
big they are, with no process group and no allocation. The engine builds its buffers from
it, and the planner in ``shardkit.tools`` calls it (through :mod:`shardkit.core.layout`) for
a model it has never run, so their sizes cannot drift apart. See [Note: flat group buffers].
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from shardkit.core.runtime.buffers import ALIGN_BYTES, FlatLayout, ShardGeometry, shard_geometry

__all__ = [
    "ALIGN_BYTES",
    "GroupLayout",
    "ParamLayout",
    "ParamSpec",
    "ShardGeometry",
    "group_layout",
    "pooled_sizes",
]


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
    """The dtype of the all-gather and of the unsharded parameter (``param_dtype`` if set)."""
    requires_grad: bool
    """Whether it is trained."""
    storage_offset: int
    """Byte offset of its padded shard in the group's sharded buffer."""
    comm_offset: int
    """Byte offset of its padded shard in one rank's all-gather input."""
    unsharded_offset: int
    """Byte offset of its padded full tensor in the group's unsharded buffer."""

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


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupLayout:
    """The buffers of one parameter group: one ``fully_shard`` call."""

    params: tuple[ParamLayout, ...]
    """Its parameters, in the order the engine packs them."""
    shard_world: int
    """Ranks of the shard axis."""
    replicate_world: int
    """Ranks of the replicate axis (HSDP), 1 without one."""
    reduce_dtype: torch.dtype
    """The dtype gradients are reduced in."""
    storage: FlatLayout
    """The sharded buffer: each padded shard in its own dtype."""
    comm: FlatLayout
    """One rank's all-gather input: each padded shard in its ``comm_dtype``."""
    unsharded: FlatLayout
    """The unsharded buffer: each padded full tensor in its ``comm_dtype``."""

    @property
    def sharded_bytes(self) -> int:
        """Bytes of the sharded buffer (alignment gaps included)."""
        return self.storage.nbytes

    @property
    def all_gather_input_bytes(self) -> int:
        """Bytes one rank contributes to the all-gather."""
        return self.comm.nbytes

    @property
    def unsharded_bytes(self) -> int:
        """Bytes of the unsharded buffer."""
        return self.unsharded.nbytes

    @property
    def trainable(self) -> tuple[ParamLayout, ...]:
        """The parameters whose gradients are reduced."""
        return tuple(p for p in self.params if p.requires_grad)

    @property
    def reduce_scatter_output_numel(self) -> int:
        """Elements of one rank's reduced gradient: its padded shards, back to back."""
        return sum(p.shard_numel for p in self.trainable)

    @property
    def reduce_scatter_output_bytes(self) -> int:
        """Bytes of one rank's reduced gradient."""
        return self.reduce_scatter_output_numel * self.reduce_dtype.itemsize

    @property
    def reduce_scatter_input_bytes(self) -> int:
        """Bytes of the (W, S) buffer a reduction sends from."""
        return self.shard_world * self.reduce_scatter_output_bytes

    def all_gather_receive_bytes(self, *, exchange: bool) -> int:
        """Bytes of the all-gather's receive buffer.

        Args:
            exchange: True for the direct exchange on gloo, where this rank's own row stays
                in place ((W-1) rows); False for a native all-gather (W rows).
        """
        rows = self.shard_world - 1 if exchange else self.shard_world
        return rows * self.all_gather_input_bytes

    @property
    def pool_sizes(self) -> frozenset[int]:
        """The receive-buffer sizes this group registers with the engine's buffer pool."""
        return frozenset(self.all_gather_receive_bytes(exchange=e) for e in (True, False))


def _comm_dtype(spec: ParamSpec, param_dtype: torch.dtype | None) -> torch.dtype:
    # Mixed precision casts floating-point parameters only; integer ones keep their dtype.
    if param_dtype is not None and spec.dtype.is_floating_point:
        return param_dtype
    return spec.dtype


def _reduce_dtype(
    specs: Sequence[ParamSpec], comm_dtypes: Sequence[torch.dtype], reduce_dtype: torch.dtype | None
) -> torch.dtype:
    if reduce_dtype is not None:
        return reduce_dtype
    trained = {d for s, d in zip(specs, comm_dtypes, strict=True) if s.requires_grad}
    if len(trained) > 1:
        names = ", ".join(
            f"{s.fqn}: {d}" for s, d in zip(specs, comm_dtypes, strict=True) if s.requires_grad
        )
        raise ValueError(
            "fully_shard needs one dtype for the trainable parameters of a group so that "
            f"their gradients reduce together; got {names}. Set "
            "MixedPrecisionPolicy(param_dtype=...) or shard them in separate calls."
        )
    return trained.pop() if trained else torch.float32


def group_layout(
    params: Sequence[ParamSpec],
    *,
    shard_world: int,
    replicate_world: int = 1,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    post_forward_world: int | None = None,
) -> GroupLayout:
    """The layout of a group of parameters sharded over ``shard_world`` ranks.

    Args:
        params: the group's parameters in packing order.
        shard_world: ranks of the shard axis.
        replicate_world: ranks of the replicate axis (HSDP).
        param_dtype: ``MixedPrecisionPolicy.param_dtype``.
        reduce_dtype: ``MixedPrecisionPolicy.reduce_dtype``.
        post_forward_world: n of ``reshard_after_forward=n`` (the unsharded buffer must also
            hold a copy-out from n shards, whose padding differs).

    Raises:
        ValueError: trainable parameters of different dtypes and no ``reduce_dtype``.
    """
    geometries = [shard_geometry(torch.Size(s.shape), s.shard_dim, shard_world) for s in params]
    comm_dtypes = [_comm_dtype(s, param_dtype) for s in params]
    numels = [g.shard_numel for g in geometries]
    storage = FlatLayout.build(numels, [s.dtype for s in params])
    comm = FlatLayout.build(numels, comm_dtypes)
    unsharded_numels = [n * shard_world for n in numels]
    if post_forward_world is not None:
        unsharded_numels = [
            max(
                u,
                post_forward_world * shard_geometry(g.shape, g.dim, post_forward_world).shard_numel,
            )
            for u, g in zip(unsharded_numels, geometries, strict=True)
        ]
    unsharded = FlatLayout.build(unsharded_numels, comm_dtypes)
    layouts = tuple(
        ParamLayout(
            fqn=s.fqn,
            geometry=g,
            dtype=s.dtype,
            comm_dtype=c,
            requires_grad=s.requires_grad,
            storage_offset=storage.offsets[i],
            comm_offset=comm.offsets[i],
            unsharded_offset=unsharded.offsets[i],
        )
        for i, (s, g, c) in enumerate(zip(params, geometries, comm_dtypes, strict=True))
    )
    return GroupLayout(
        params=layouts,
        shard_world=shard_world,
        replicate_world=replicate_world,
        reduce_dtype=_reduce_dtype(params, comm_dtypes, reduce_dtype),
        storage=storage,
        comm=comm,
        unsharded=unsharded,
    )


def pooled_sizes(layouts: Iterable[GroupLayout]) -> frozenset[int]:
    """The buffer sizes the engine's pool keeps a buffer for: those of two groups or more.

    A size that one group alone uses would sit idle from one of its collectives to the next,
    so the pool hands such buffers back to the allocator (see ``runtime/pool.py``).
    """
    users = Counter(size for layout in layouts for size in layout.pool_sizes)
    return frozenset(size for size, count in users.items() if count >= 2)
