"""Who sends what to whom, for an engine whose tensor-parallel layout is not the trainer's.

A trainer rank holds one block of each tensor (FSDP's ``Shard(0)`` rows, or under FSDP x TP
a block cut along two dims); an engine rank needs one window of it (``tp_slices.py``). Each
trainer rank sends each receiving rank the overlap of its block with that rank's window, and
nothing else: no rank gathers a whole tensor, and every receiving rank gets exactly its
window's elements, from as many trainer ranks as its window spans (its own overlap copied).

A rank's block is a pure function of the shape, the mesh and the placements (``Shard(d)``
cuts as ``torch.chunk`` does, in mesh order; ``_StridedShard``, FSDP over TP's rows, cuts
last what the others left, as ``fully_shard`` made it; ``Replicate`` copies), so every rank
plans every route alone. Of the ranks holding one block (HSDP's replicas) the one at
coordinate 0 of the replicated axes sends. A plain tensor (a buffer, a parameter no
``fully_shard`` manages) is on every rank: the receiving rank copies its window from its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardkit.core.export.axis_gathers import placements_on
from shardkit.core.export.tp_slices import Box, EngineTP, Window, engine_window
from shardkit.core.runtime.chunks import chunk_rows

__all__ = ["Route", "block_of", "blocks_by_rank", "overlap", "plan_routes", "volume"]


@dataclass(frozen=True, slots=True)
class Route:
    """One block of one tensor, from one trainer rank to one receiving rank."""

    sender: int
    """The global rank that sends (the receiver itself: a local copy)."""
    receiver: int
    """The global rank that receives."""
    box: Box
    """The block, in the full tensor's coordinates."""


def overlap(a: Box, b: Box) -> Box | None:
    """The block both ``a`` and ``b`` cover (None: they share no element)."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(start < stop for start, stop in out) else None


def volume(box: Box) -> int:
    """Elements in ``box``."""
    count = 1
    for start, stop in box:
        count *= max(0, stop - start)
    return count


def block_of(
    shape: Sequence[int],
    cuts: Sequence[int | None],
    sizes: Sequence[int],
    coord: Sequence[int],
    strided: frozenset[int] = frozenset(),
) -> Box:
    """The block at mesh coordinate ``coord`` of a tensor.

    Mesh dim ``m`` cuts tensor dim ``cuts[m]`` (None: replicated along it); the cuts apply in
    mesh order as DTensor makes them, the ``strided`` mesh dims last.
    """
    box = [(0, size) for size in shape]
    order = sorted(
        (m for m, dim in enumerate(cuts) if dim is not None), key=lambda m: (m in strided, m)
    )
    for m in order:
        dim = cuts[m]
        assert dim is not None
        start, stop = box[dim]
        first, rows = chunk_rows(stop - start, sizes[m], coord[m])
        box[dim] = (start + first, start + first + rows)
    return tuple(box)


def blocks_by_rank(key: str, tensor: DTensor, root: DeviceMesh) -> dict[int, Box]:
    """Each sending rank's block of ``tensor``.

    One rank sends each block: the one at coordinate 0 of the replicated axes.

    Raises:
        ValueError: a placement that is no cut nor copy (``Partial``), named with the tensor.
    """
    cuts: list[int | None] = []
    strided: set[int] = set()
    for m, placement in enumerate(placements_on(tensor, root, key)):
        if isinstance(placement, (Shard, _StridedShard)):
            cuts.append(int(placement.dim))
            if isinstance(placement, _StridedShard):
                strided.add(m)
        elif isinstance(placement, Replicate):
            cuts.append(None)
        else:
            raise ValueError(
                f"{key}: placed as {placement}; a TP-sliced export takes Shard and Replicate "
                "placements only"
            )
    sizes = [int(s) for s in root.mesh.shape]
    ranks = root.mesh.reshape(-1).tolist()
    blocks: dict[int, Box] = {}
    for flat, rank in enumerate(ranks):
        coord = [int(c) for c in torch.unravel_index(torch.tensor(flat), root.mesh.shape)]
        if any(c != 0 for c, cut in zip(coord, cuts, strict=True) if cut is None):
            continue  # a replica of a block another rank sends
        blocks[int(rank)] = block_of(tuple(tensor.shape), cuts, sizes, coord, frozenset(strided))
    return blocks


def plan_routes(
    tp: EngineTP,
    name: str,
    shape: tuple[int, ...],
    blocks: Mapping[int, Box] | None,
    engine_ranks: Mapping[int, int],
) -> tuple[dict[int, Window], list[Route]]:
    """Every receiving rank's window of one tensor, and the routes that fill them.

    Args:
        tp: the engine.
        name: the checkpoint name.
        shape: the full shape.
        blocks: the sending ranks' blocks (None: a plain tensor, on every rank).
        engine_ranks: receiving global rank -> its engine rank.

    Returns:
        The windows by receiving rank, and the routes (each window covered once, exactly).
    """
    windows = {g: engine_window(tp, name, shape, e) for g, e in engine_ranks.items()}
    routes: list[Route] = []
    for receiver, window in sorted(windows.items()):
        if window.numel == 0:
            continue
        if blocks is None:
            routes.append(Route(receiver, receiver, window.box))
            continue
        for sender, block in sorted(blocks.items()):
            common = overlap(block, window.box)
            if common is not None:
                routes.append(Route(sender, receiver, common))
    return windows, routes
