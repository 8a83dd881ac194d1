"""Where each matrix of a parameter lives: every rank's block of it, from the sharding alone.

A whole-matrix optimizer takes 2-D parameters (one matrix) and 3-D expert stacks ``(E, m, n)``
(E matrices, transformers' MoE layers), as plain tensors (whole on every rank that has them)
or as DTensors on any mesh whose placements cut rectangles:

- ``Shard(d)`` on any dim: FSDP's rows (``Shard(0)``), TP's columns (``RowwiseParallel``'s
  ``Shard(1)``), whole experts (``Shard(0)`` of a stack);
- ``_StridedShard(d)``: FSDP over TP's rows (``ColwiseParallel``), where the TP axis cuts
  first and FSDP then cuts each TP block, so every rank still holds one rectangle;
- ``Replicate``: HSDP's replicas, TP's replicated weights, ``replicate``'s whole matrices.

Each rank's block is torch's own chunk arithmetic per mesh coordinate (``chunk_at``), so no
rank asks another. Blocks held by several ranks (replicas) are one block held several times;
the blocks must tile the matrix, or the parameter is refused by name before any step.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardkit.core.optim.blocks import Block, MatrixPlacement
from shardkit.core.runtime.dtensors import chunk_at
from shardkit.core.runtime.groups import group_ranks, mesh_group, world_size
from shardkit.core.runtime.meshes import concatenate, flattened

__all__ = ["Block", "MatrixPlacement", "placement_of"]


def placement_of(
    param: torch.Tensor, name: str, replicated_over: DeviceMesh | None = None
) -> tuple[MatrixPlacement, ...]:
    """Where each matrix of ``param`` lives: one for a 2-D parameter, E for a stack.

    ``replicated_over`` is a mesh whose ranks hold the same values of every parameter that is
    not placed on it (TP's axis, for the matrices no TP style cuts): such a parameter is taken
    as replicated on it too, so that one rank of the combined mesh owns each of its matrices.
    A parameter already placed on it (TP's own) is left as it is.

    Raises:
        ValueError: ``param`` is neither 2-D nor 3-D (torch's Muon takes 2-D only).
        NotImplementedError: a placement whose blocks are not rectangles of each matrix
            (``Partial``, a ``_StridedShard`` not nested as FSDP over TP, blocks that do not
            tile the matrix).
    """
    if param.dim() not in (2, 3):
        raise ValueError(
            f"{name}: a whole-matrix optimizer takes 2-D parameters and 3-D expert stacks "
            f"(E, out, in), this one has shape {tuple(param.shape)}; give it to AdamW "
            "(embeddings, norms, biases, the head)"
        )
    shape = tuple(int(s) for s in param.shape)
    names = _matrix_names(name, shape)
    mesh, placements, assumed = _placed_on(param, name, replicated_over)
    if mesh is None or mesh.size() == 1:
        # Whole here: a stack's experts are its local tensor's first dim, in order.
        return tuple(
            MatrixPlacement(n, _matrix_shape(shape), None, expert=_index(shape, e))
            for e, n in enumerate(names)
        )
    return _sharded(mesh, placements, shape, names, assumed)


def _placed_on(
    param: torch.Tensor, name: str, replicated_over: DeviceMesh | None
) -> tuple[DeviceMesh | None, tuple[Placement, ...], bool]:
    """Where the step takes ``param``: its mesh, placements, and whether replicas were added.

    The mesh is None for a plain tensor held alone; replicas are added on ``replicated_over``'s
    word (:func:`placement_of`).
    """
    mesh = param.device_mesh if isinstance(param, DTensor) else None
    placements = tuple(param.placements) if isinstance(param, DTensor) else ()
    if replicated_over is None or replicated_over.size() == 1:
        return mesh, placements, False
    if mesh is None:  # whole on every rank of ``replicated_over``
        return replicated_over, (Replicate(),) * replicated_over.ndim, True
    mine, theirs = _ranks(mesh), _ranks(replicated_over)
    if theirs <= mine:
        return mesh, placements, False  # placed on it already (TP's own matrices)
    if len(mine & theirs) != 1:
        raise ValueError(
            f"{name}: its mesh {mesh} and replicated_over {replicated_over} share ranks "
            "other than this one; replicated_over must be an axis its mesh does not have"
        )
    try:
        combined = concatenate([mesh, replicated_over])
    except RuntimeError as error:  # not slices of one root mesh
        raise ValueError(
            f"{name}: its mesh {mesh} and replicated_over {replicated_over} are not axes of "
            f"one device mesh ({error})"
        ) from error
    return combined, placements + (Replicate(),) * replicated_over.ndim, True


def _ranks(mesh: DeviceMesh) -> set[int]:
    return {int(r) for r in mesh.mesh.flatten().tolist()}


def _sharded(
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: tuple[int, ...],
    names: list[str],
    assumed: bool,
) -> tuple[MatrixPlacement, ...]:
    _check_placements(names[0].split("[")[0], placements, tuple(mesh.shape), len(shape))
    group = _group_of(mesh)
    where = {int(r): c for c, r in _coordinates(mesh.mesh)}
    coords = [where[r] for r in group_ranks(group)]  # each group rank's mesh coordinate
    chunks = [chunk_at(shape, tuple(mesh.shape), list(c), placements) for c in coords]
    replicated = [a for a, p in enumerate(placements) if isinstance(p, Replicate)]
    replicas = tuple(tuple(c[a] for a in replicated) for c in coords)
    mine = group.rank()
    found: list[MatrixPlacement] = []
    for e, matrix_name in enumerate(names):
        blocks = tuple(_block(sizes, offsets, shape, e) for sizes, offsets in chunks)
        _check_tiling(matrix_name, _matrix_shape(shape), blocks)
        expert = None
        if len(shape) == 3 and not blocks[mine].empty:
            expert = e - chunks[mine][1][0]  # its place among this rank's experts
        found.append(
            MatrixPlacement(
                matrix_name, _matrix_shape(shape), group, blocks, replicas, expert, assumed
            )
        )
    return tuple(found)


def _group_of(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The group of every rank of ``mesh``: its own where it is 1-D or the whole world.

    Another N-D mesh (a pipeline stage's slice of a bigger one) is flattened as torch's
    ``fully_shard`` flattens axes: every rank of the root mesh calls this in the same order,
    each for its own slice, and each slice gets its group. Without axis names it cannot be
    flattened, and the group is made by every rank of the world, which must then all pass
    the same mesh.
    """
    names = mesh.mesh_dim_names
    if mesh.ndim == 1 or names is None or mesh.size() == world_size():
        return mesh_group(mesh)
    return flattened(mesh, tuple(names)).get_group(0)


def _matrix_names(name: str, shape: tuple[int, ...]) -> list[str]:
    return [name] if len(shape) == 2 else [f"{name}[{e}]" for e in range(shape[0])]


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return (shape[-2], shape[-1])


def _index(shape: tuple[int, ...], expert: int) -> int | None:
    return None if len(shape) == 2 else expert


def _coordinates(ranks: torch.Tensor) -> list[tuple[tuple[int, ...], int]]:
    """(coordinate, global rank) of every position of a mesh's rank tensor."""
    flat = ranks.flatten().tolist()
    dims = tuple(ranks.shape)
    found = []
    for i, rank in enumerate(flat):
        coord = []
        for size in reversed(dims):
            coord.append(i % size)
            i //= size
        found.append((tuple(reversed(coord)), int(rank)))
    return found


def _block(
    sizes: tuple[int, ...], offsets: tuple[int, ...], shape: tuple[int, ...], expert: int
) -> Block:
    """One rank's block of matrix ``expert`` (of the only matrix, for a 2-D parameter)."""
    if len(shape) == 3:
        first, count = offsets[0], sizes[0]
        if not first <= expert < first + count:
            return Block(0, 0, 0, 0)
        sizes, offsets = sizes[1:], offsets[1:]
    if sizes[0] == 0 or sizes[1] == 0:
        return Block(0, 0, 0, 0)  # an uneven cut's empty chunk (its offsets say nothing)
    return Block(offsets[0], offsets[0] + sizes[0], offsets[1], offsets[1] + sizes[1])


def _check_placements(
    name: str, placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], ndim: int
) -> None:
    """Refuse what ``chunk_at``'s offsets would not place as rectangles, naming the parameter."""
    for axis, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            # FSDP over TP: the later axes that cut the same dim cut first, so this axis cuts
            # each of their blocks; its split factor is their number of blocks.
            later = [
                mesh_shape[b]
                for b in range(axis + 1, len(placements))
                if type(placements[b]) is Shard and placements[b].dim == p.dim  # type: ignore[attr-defined]
            ]
            if p.split_factor != math.prod(later):
                raise NotImplementedError(
                    f"{name}: placement {p!r} on mesh axis {axis} is not FSDP over TP's blocks "
                    f"(split factor {p.split_factor}, the later axes cut dim {p.dim} into "
                    f"{math.prod(later)}); a whole-matrix optimizer cannot place its rows"
                )
        elif not isinstance(p, Replicate) and not (type(p) is Shard and 0 <= p.dim < ndim):
            raise NotImplementedError(
                f"{name}: placement {p!r} on mesh axis {axis}; a whole-matrix optimizer takes "
                "Shard, FSDP-over-TP's _StridedShard and Replicate placements"
            )


def _check_tiling(name: str, shape: tuple[int, int], blocks: tuple[Block, ...]) -> None:
    """The distinct blocks cover the matrix once: ranges on each dim equal or apart."""
    distinct = {b for b in blocks if not b.empty}
    for lo, hi in ((0, 1), (2, 3)):
        spans = sorted({(_bounds(b)[lo], _bounds(b)[hi]) for b in distinct})
        for (_, stop), (start, _) in itertools.pairwise(spans):
            if start < stop:
                raise NotImplementedError(f"{name}: its shards overlap {spans}; {_TILING}")
    area = sum(b.shape[0] * b.shape[1] for b in distinct)
    if area != shape[0] * shape[1]:
        raise NotImplementedError(f"{name}: its shards cover {area} of {shape}; {_TILING}")


def _bounds(b: Block) -> tuple[int, int, int, int]:
    return (b.row0, b.row1, b.col0, b.col1)


_TILING = "a whole-matrix optimizer needs blocks that tile each matrix once"
