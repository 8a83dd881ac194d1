"""Where each exported tensor's elements are: its sharding, as gathers along mesh axes.

A model sharded with ``fully_shard`` (torch's or shardkit's) holds each parameter as a DTensor.
Along each mesh axis its placement is ``Replicate`` (HSDP's replicas), ``Shard(d)`` or torch's
``_StridedShard(d)`` (FSDP's dim, or TP's). FSDP and TP both cut with ``torch.chunk``'s
arithmetic: ``c = ceil(N / n)`` rows per rank, rank ``i`` holding rows ``[i*c, min((i+1)*c,
N))`` (trailing ranks possibly empty). So the layout is a pure function of the shape, the mesh
and the placements: no rank needs to ask another where anything is.

An export gathers along every sharded axis except the ones the receiver keeps (a receiver with
the model's TP degree keeps the TP axis and gets its TP part). Each gathered axis is one
:class:`AxisGather`: every rank's piece, padded to ``c`` rows, gathered, then the pieces
narrowed and joined along the tensor dim (named ``Stage`` before 2026-11; that name stays as a
deprecated alias). Gathers run innermost cut first: a ``_StridedShard`` axis (FSDP over
TP's rows) first, then the others from the last mesh dim back. Replicated axes are not
gathered: only coordinate 0 exports (HSDP's first replica group), unless every rank receives.
Plain tensors (buffers, parameters no ``fully_shard`` manages) have no gathers; the receiving
rank sends its own copy.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from shardkit.core.runtime.chunks import chunk_rows, chunk_size

__all__ = [
    "AxisGather",
    "TensorSource",
    "export_order",
    "placements_on",
    "mesh_of",
    "gathered_dims",
    "tensor_source",
]


@dataclass(frozen=True, slots=True)
class AxisGather:
    """One gather of a tensor along one mesh axis."""

    mesh_dim: int
    tensor_dim: int
    parts: int
    """Ranks along the axis."""
    shape: tuple[int, ...]
    """The tensor after this gather (at the gathering rank)."""

    @property
    def rows_per_part(self) -> int:
        """``c``: every part padded to this many rows along ``tensor_dim``."""
        return chunk_size(self.shape[self.tensor_dim], self.parts)

    @property
    def padded_numel(self) -> int:
        """Elements of one part, padded: what each rank sends for this tensor."""
        rest = 1
        for i, size in enumerate(self.shape):
            if i != self.tensor_dim:
                rest *= size
        return self.rows_per_part * rest

    def piece_shape(self, index: int) -> tuple[int, ...]:
        """The unpadded shape of part ``index``."""
        shape = list(self.shape)
        shape[self.tensor_dim] = chunk_rows(self.shape[self.tensor_dim], self.parts, index)[1]
        return tuple(shape)

    def padded_shape(self) -> tuple[int, ...]:
        """A part's shape, padded to ``rows_per_part`` rows."""
        shape = list(self.shape)
        shape[self.tensor_dim] = self.rows_per_part
        return tuple(shape)

    def pack(self, piece: torch.Tensor, out: torch.Tensor) -> None:
        """Write this rank's ``piece`` into ``out``, padded.

        ``out`` is flat, ``padded_numel`` long; the copy casts to its dtype, and the padding
        is zeros.
        """
        rows = piece.shape[self.tensor_dim] if piece.dim() else 0
        view = out.view(self.padded_shape())
        if rows < self.rows_per_part:
            view.narrow(self.tensor_dim, rows, self.rows_per_part - rows).zero_()
        if rows:
            view.narrow(self.tensor_dim, 0, rows).copy_(piece)

    def unpack(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tensor after the gather, from every rank's padded part (flat views), in order."""
        pieces = [
            part.view(self.padded_shape()).narrow(
                self.tensor_dim, 0, self.piece_shape(i)[self.tensor_dim]
            )
            for i, part in enumerate(parts)
        ]
        return torch.cat(pieces, dim=self.tensor_dim)

    def global_index(self, index: int, local: torch.Tensor) -> torch.Tensor:
        """Flat positions in the gather's tensor of positions in one rank's part.

        ``local`` are int64 positions in part ``index``'s padded flat layout.
        """
        start = index * self.rows_per_part
        if self.tensor_dim == 0:
            row = 1
            for size in self.shape[1:]:
                row *= size
            return local + start * row
        padded = self.padded_shape()
        coords = torch.unravel_index(local, padded)
        flat = torch.zeros_like(local)
        stride = 1
        for dim in reversed(range(len(self.shape))):
            coord = coords[dim] + (start if dim == self.tensor_dim else 0)
            flat += coord * stride
            stride *= self.shape[dim]
        return flat


@dataclass(frozen=True, slots=True)
class TensorSource:
    """One tensor of the model, as the export sees it."""

    key: str
    """Its state-dict key in the model."""
    name: str
    """Its name for the receiver."""
    tensor: torch.Tensor
    """The model's tensor (a DTensor, or a plain tensor)."""
    dtype: torch.dtype
    """The dtype it is exported in."""
    shape: tuple[int, ...]
    """What the receiver gets: the full shape, or the kept axes' part."""
    gathers: tuple[AxisGather, ...]
    """The gathers, in order (none for a plain tensor)."""

    @property
    def stages(self) -> tuple[AxisGather, ...]:
        """Deprecated: :attr:`gathers`, by its name before 2026-11."""
        warnings.warn(
            "TensorSource.stages is renamed TensorSource.gathers", DeprecationWarning, stacklevel=2
        )
        return self.gathers

    @property
    def nbytes(self) -> int:
        """Its bytes in the export dtype."""
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize

    def local(self) -> torch.Tensor:
        """This rank's piece (a DTensor's local tensor), as stored (not cast)."""
        value = self.tensor.detach()
        return value.to_local() if isinstance(value, DTensor) else value


def mesh_of(tensor: torch.Tensor) -> DeviceMesh | None:
    """A DTensor's mesh; None for a plain tensor."""
    return tensor.device_mesh if isinstance(tensor, DTensor) else None


def gathered_dims(placements: Sequence[Placement], keep: set[int]) -> list[int]:
    """The mesh dims to gather, in order: ``_StridedShard`` first, then from the last back."""
    sharded = [m for m, p in enumerate(placements) if _cuts(p) and m not in keep]
    strided = [m for m in sharded if isinstance(placements[m], _StridedShard)]
    return strided + sorted((m for m in sharded if m not in strided), reverse=True)


def placements_on(tensor: DTensor, root: DeviceMesh, key: str) -> list[Placement]:
    """``tensor``'s placements along ``root``'s dims.

    A tensor on a sub-mesh of the root (the embeddings on FSDP's ``dp`` axis beside TP's layers
    on ``(dp, tp)``) is replicated along the root's other axes.

    Raises:
        ValueError: a mesh that is not the root nor a named sub-mesh of it.
    """
    mesh = tensor.device_mesh
    if mesh == root:
        return list(tensor.placements)
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if names is None or root_names is None or not set(names) <= set(root_names):
        raise ValueError(
            f"{key} is on mesh {names} and the model's widest mesh is {root_names}: the export "
            "needs one mesh, or named sub-meshes of it"
        )
    placements: list[Placement] = [Replicate()] * root.ndim
    for name, placement in zip(names, tensor.placements, strict=True):
        placements[root_names.index(name)] = placement
    return placements


def export_order(
    tensors: Sequence[torch.Tensor], keep_dims: set[int], root: DeviceMesh | None
) -> list[int]:
    """One gather order of mesh dims for every tensor.

    ``_StridedShard`` dims first, then the others from the last back (each tensor's own rule,
    :func:`gathered_dims`, taken over all).
    """
    strided: set[int] = set()
    plain: set[int] = set()
    for tensor in tensors:
        if isinstance(tensor, DTensor) and root is not None:
            for m, p in enumerate(placements_on(tensor, root, "")):
                if _cuts(p) and m not in keep_dims:
                    (strided if isinstance(p, _StridedShard) else plain).add(m)
    return sorted(strided) + sorted(plain - strided, reverse=True)


def _chunked(
    shape: tuple[int, ...],
    placements: Sequence[Placement],
    dims: Sequence[int],
    mesh: DeviceMesh,
    coord: Sequence[int],
) -> tuple[int, ...]:
    """``shape`` cut along mesh ``dims`` at ``coord``.

    Plain shards in mesh order (DTensor applies placements so), ``_StridedShard`` last (it cuts
    what the others left).
    """
    out = list(shape)
    ordered = sorted(dims, key=lambda m: (isinstance(placements[m], _StridedShard), m))
    for m in ordered:
        p = placements[m]
        out[_dim(p)] = chunk_rows(out[_dim(p)], int(mesh.mesh.shape[m]), coord[m])[1]
    return tuple(out)


def tensor_source(
    key: str,
    name: str,
    tensor: torch.Tensor,
    dtype: torch.dtype,
    keep_dims: set[int],
    root: DeviceMesh | None = None,
    order: Sequence[int] | None = None,
) -> TensorSource:
    """The export's view of one tensor.

    Args:
        key: its state-dict key in the model.
        name: its name for the receiver.
        tensor: the model's tensor (a DTensor, or a plain tensor).
        dtype: the dtype it is exported in.
        keep_dims: the root mesh's dims the receiver keeps sharded.
        root: the model's widest mesh (None: the tensor's own).
        order: the mesh dims in the order every tensor of the export gathers them (the
            model's :func:`export_order`); this tensor's sharded dims are taken in that order.

    Raises:
        ValueError: a placement the export cannot gather (``Partial``), an order that would
            gather two cuts of one tensor dim the wrong way round, or a kept axis that cuts
            a tensor dim before a gathered axis cuts it again.
    """
    value = tensor.detach()
    if not isinstance(value, DTensor):
        return TensorSource(key, name, tensor, dtype, tuple(value.shape), ())
    mesh = root if root is not None else value.device_mesh
    placements = placements_on(value, mesh, key)
    bad = [p for p in placements if not (_cuts(p) or isinstance(p, Replicate))]
    if bad:
        raise ValueError(f"{key}: cannot export a DTensor placed as {bad} (only Shard/Replicate)")
    coord = mesh.get_coordinate()
    assert coord is not None, f"{key}: this rank is not on the parameter's mesh"
    own = gathered_dims(placements, keep_dims)
    ordered = [m for m in order if m in own] if order is not None else own
    kept = [m for m in keep_dims if _cuts(placements[m])]
    _check_order(key, placements, own, ordered, kept)
    shape = tuple(value.shape)
    gathers: list[AxisGather] = []
    for i, m in enumerate(ordered):
        after = _chunked(shape, placements, kept + ordered[i + 1 :], mesh, coord)
        gathers.append(AxisGather(m, _dim(placements[m]), int(mesh.mesh.shape[m]), after))
    final = _chunked(shape, placements, kept, mesh, coord)
    return TensorSource(key, name, tensor, dtype, final, tuple(gathers))


def _cuts(placement: Placement) -> bool:
    """A cut along a tensor dim.

    ``Shard``, or ``_StridedShard`` (not a ``Shard`` subclass in every torch release).
    """
    return isinstance(placement, (Shard, _StridedShard))


def _dim(placement: Placement) -> int:
    assert isinstance(placement, (Shard, _StridedShard))
    return int(placement.dim)


def _check_order(
    key: str, placements: list[Placement], own: list[int], ordered: list[int], kept: list[int]
) -> None:
    """Cuts of one tensor dim must be gathered in the reverse of the order DTensor made them."""
    for a in ordered:
        for b in ordered:
            same = a != b and _dim(placements[a]) == _dim(placements[b])
            if same and (ordered.index(a) < ordered.index(b)) != (own.index(a) < own.index(b)):
                raise ValueError(
                    f"{key}: mesh dims {a} and {b} both cut tensor dim {_dim(placements[a])}, "
                    "in an order the model's other parameters gather the other way round"
                )
    for k in kept:
        for g in ordered:
            same_dim = _dim(placements[k]) == _dim(placements[g])
            if same_dim and g < k and not isinstance(placements[g], _StridedShard):
                raise ValueError(
                    f"{key}: mesh dim {k} is kept but cuts tensor dim "
                    f"{_dim(placements[k])} after mesh dim {g}, which is gathered; keep "
                    "none, or shard FSDP over TP's rows (_StridedShard) as fully_shard does"
                )


def __getattr__(name: str) -> Any:
    """``Stage``: the deprecated name of :class:`AxisGather`.

    Renamed so that one word names one thing: a pipeline's stages and the checkpoint's staging
    are other things.
    """
    if name == "Stage":
        warnings.warn(
            "shardkit.core.export's Stage is renamed AxisGather", DeprecationWarning, stacklevel=2
        )
        return AxisGather
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
