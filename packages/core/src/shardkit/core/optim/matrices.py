"""Where a 2-D parameter's rows live: whole on this rank, or row blocks over one process group.

A whole-matrix optimizer takes plain tensors (whole on every rank that has them) and the
DTensors of ``fully_shard`` over one mesh axis, shardkit's or torch's: ``Shard(0)``, row block
r on rank r, as ``torch.chunk`` cuts them (ceil(m / W) rows each, the last ones shorter or
empty where m does not divide by W). Anything else is refused here, naming the parameter,
before any rank starts a step: HSDP (a replicate axis too), tensor parallelism (a matrix whole
only across two axes) and ``Replicate`` placements are the next part of issue 83, and a
matrix sharded along its columns is not the row blocks the exchange carries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from shardkit.core.runtime.dtensors import chunk_at
from shardkit.core.runtime.groups import mesh_group

__all__ = ["MatrixPlacement", "placement_of"]


@dataclass(frozen=True, slots=True)
class MatrixPlacement:
    """One 2-D parameter as the step sees it."""

    name: str
    """The parameter's name, for errors: its FQN where the optimizer was given names."""
    shape: tuple[int, int]
    """The whole matrix's (m, n)."""
    group: dist.ProcessGroup | None
    """The ranks holding its row blocks; None where this rank holds it whole."""
    bounds: tuple[int, ...] = ()
    """With a group, W + 1 row bounds: group rank r holds rows bounds[r] to bounds[r + 1]."""

    def rows_of(self, rank: int) -> int:
        """How many rows group rank ``rank`` holds."""
        return self.bounds[rank + 1] - self.bounds[rank]


def placement_of(param: torch.Tensor, name: str) -> MatrixPlacement:
    """Where ``param``'s rows live.

    Raises:
        ValueError: ``param`` is not 2-D (torch's Muon refuses it too).
        NotImplementedError: a DTensor on more than one mesh axis (HSDP, FSDP x TP), or one
            whose placement is not ``Shard(0)``.
    """
    if param.dim() != 2:
        raise ValueError(
            f"{name}: a whole-matrix optimizer takes 2-D parameters only, this one has shape "
            f"{tuple(param.shape)}; give it to AdamW (embeddings, norms, biases, the head)"
        )
    shape = (int(param.size(0)), int(param.size(1)))
    if not isinstance(param, DTensor):
        return MatrixPlacement(name, shape, None)
    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"{name}: sharded over a {mesh.ndim}-D mesh {tuple(mesh.shape)} (HSDP or tensor "
            f"parallelism, placements {placements}); whole-matrix optimizers take parameters "
            "sharded over one mesh axis for now (the next part of issue 83 adds these)"
        )
    placement = placements[0]
    if type(placement) is not Shard or placement.dim != 0:
        raise NotImplementedError(
            f"{name}: placement {placement!r} on its mesh; whole-matrix optimizers take row "
            "blocks, Shard(0) (fully_shard's default), for now"
        )
    world = mesh.size()
    if world == 1:
        return MatrixPlacement(name, shape, None)  # its one block is the whole matrix
    bounds = [0]
    for rank in range(world):
        sizes, offsets = chunk_at(shape, (world,), [rank], placements)
        assert offsets[0] == bounds[-1] or sizes[0] == 0, f"{name}: row blocks out of order"
        bounds.append(bounds[-1] + sizes[0])
    assert bounds[-1] == shape[0], f"{name}: row blocks do not cover its {shape[0]} rows"
    return MatrixPlacement(name, shape, mesh_group(mesh), tuple(bounds))
