"""A weight export's layout, as the planner models it: the tensors, the buckets, each gather.

``shardkit.core.export`` moves a sharded model's weights to an inference engine bucket by
bucket. Its plan is a pure function of the tensors' shapes and dtypes and of the mesh, so the
planner builds it from a model on the meta device with the export's own rules (its names and
tied tensors, ``export_sources``; its buckets of whole layers, ``plan_buckets``; a gather's
rows, ``AxisGather``). What the planner adds is the sharding the model would have:

- Parameters are sharded by ``fully_shard`` on dim 0 along the FSDP axis (``_StridedShard(0)``
  where TP shards dim 0 too); buffers are plain, sent by the receiving rank from its own copy,
  never on the wire.
- Each bucket is one gather per sharded mesh axis, innermost cut first: a ``_StridedShard``
  axis, then the others from the last mesh dim back (``layout.export_order``'s rule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardkit.core.export import (
    AxisGather,
    TensorSource,
    default_layer_of,
    export_sources,
    plan_buckets,
)

__all__ = [
    "ExportBucketModel",
    "ExportMesh",
    "ExportTensor",
    "export_tensors",
    "plan_export_buckets",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportTensor:
    """One tensor of the export, as stored in the trainer (before any sharding)."""

    source: TensorSource
    """The export's view of it, from the unsharded model: its key, name, full shape, dtype."""
    sharded: bool
    """A parameter ``fully_shard`` manages (dim 0 along the FSDP axis); False: a buffer."""
    tp_dim: int | None = None
    """The tensor dim tensor parallelism shards (None: replicated on tp, or no TP)."""

    @property
    def name(self) -> str:
        """Its name for the receiver."""
        return self.source.name

    @property
    def shape(self) -> tuple[int, ...]:
        """The full shape."""
        return self.source.shape

    def export_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        """Its dtype on the wire: ``dtype`` for a floating tensor, else its own."""
        own = self.source.dtype
        return dtype if dtype is not None and own.is_floating_point else own

    def nbytes(self, dtype: torch.dtype | None) -> int:
        """Its whole bytes in the export dtype."""
        return self.source.nbytes // self.source.dtype.itemsize * self.export_dtype(dtype).itemsize


def export_tensors(
    model: nn.Module, tp_dims: Mapping[str, int | None] | None = None
) -> list[ExportTensor]:
    """The tensors an export of ``model`` sends, in its order (the model may be on meta).

    Args:
        model: the model, unsharded (as the planner builds it).
        tp_dims: parameter FQN -> the tensor dim TP shards (``Shard(d)``'s ``d``), for the
            parameters a TP plan distributes.
    """
    tp_dims = tp_dims or {}
    sources = export_sources(
        model, dtype=None, keep_dims=set(), rename=None, include_tied=False, root=None
    )
    out: list[ExportTensor] = []
    for source in sources:
        sharded = isinstance(source.tensor, nn.Parameter) and source.tensor.dim() > 0
        tp_dim = tp_dims.get(source.key) if sharded else None
        out.append(ExportTensor(source=source, sharded=sharded, tp_dim=tp_dim))
    return out


@dataclass(frozen=True, slots=True)
class ExportBucketModel:
    """One bucket: whole layers, in order."""

    index: int
    tensors: tuple[ExportTensor, ...]
    nbytes: int
    """Its whole tensors' bytes in the export dtype."""


def plan_export_buckets(
    tensors: Sequence[ExportTensor],
    bucket_bytes: int,
    dtype: torch.dtype | None,
    layer_of: Callable[[str], str] = default_layer_of,
    min_buckets: int = 1,
) -> list[ExportBucketModel]:
    """The export's buckets (``plan_buckets``) of ``tensors`` in the export dtype."""
    by_key = {t.source.key: t for t in tensors}
    cast = [dataclasses.replace(t.source, dtype=t.export_dtype(dtype)) for t in tensors]
    return [
        ExportBucketModel(b.index, tuple(by_key[s.key] for s in b.sources), b.nbytes)
        for b in plan_buckets(cast, bucket_bytes, layer_of, min_buckets)
    ]


@dataclass(frozen=True, slots=True)
class ExportMesh:
    """The planner's mesh, (dp_replicate, dp_shard, tp) with tp innermost.

    Axes of size 1 are left out, but the FSDP one.
    """

    replicas: int
    shard: int
    tp: int

    @property
    def dims(self) -> list[tuple[str, int]]:
        """(axis name, size) per mesh dim, in mesh order."""
        dims = [("dp_replicate", self.replicas)] if self.replicas > 1 else []
        dims.append(("dp_shard" if self.replicas > 1 else "dp", self.shard))
        if self.tp > 1:
            dims.append(("tp", self.tp))
        return dims

    @property
    def shard_dim(self) -> int:
        """The FSDP axis' mesh dim."""
        return 1 if self.replicas > 1 else 0

    @property
    def tp_mesh_dim(self) -> int | None:
        """TP's mesh dim (None: no TP)."""
        return len(self.dims) - 1 if self.tp > 1 else None

    def cuts(self, tensor: ExportTensor) -> dict[int, tuple[int, bool]]:
        """Mesh dim -> (the tensor dim it cuts, strided) for each axis that shards ``tensor``."""
        if not tensor.sharded:
            return {}
        strided = tensor.tp_dim == 0 and self.tp_mesh_dim is not None
        cuts = {self.shard_dim: (0, strided)}
        if self.tp_mesh_dim is not None and tensor.tp_dim is not None:
            cuts[self.tp_mesh_dim] = (tensor.tp_dim, False)
        return cuts

    def order(self, tensors: Sequence[ExportTensor]) -> list[int]:
        """The gather order of every bucket (the export's one order for all tensors).

        ``_StridedShard`` dims first, then the others from the last mesh dim back.
        """
        strided: set[int] = set()
        plain: set[int] = set()
        for tensor in tensors:
            for m, (_, is_strided) in self.cuts(tensor).items():
                (strided if is_strided else plain).add(m)
        return sorted(strided) + sorted(plain - strided, reverse=True)

    def gather(
        self, tensor: ExportTensor, mesh_dim: int, later: Sequence[int], coord: Sequence[int]
    ) -> AxisGather:
        """``tensor``'s gather along ``mesh_dim`` as the rank at ``coord`` runs it.

        The tensor at that gather is the full one cut by the dims gathered ``later`` (at this
        rank's ``coord``): plain cuts in mesh order, a strided one last, as DTensor makes them.
        """
        cuts = self.cuts(tensor)
        shape = tensor.shape
        for m in sorted(later, key=lambda d: (cuts[d][1], d)):
            shape = AxisGather(m, cuts[m][0], self.dims[m][1], shape).piece_shape(coord[m])
        return AxisGather(mesh_dim, cuts[mesh_dim][0], self.dims[mesh_dim][1], shape)
