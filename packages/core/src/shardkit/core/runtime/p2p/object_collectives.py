"""Whole objects between ranks through the first rank: state dicts, checkpoints, agreement.

Blocking transfers that run between steps, never inside one: a group's full tensors gathered
to its first rank and scattered back, broadcasts from one rank, and small byte messages
(outcomes, agreements). The step's own collectives live in ``runtime/collectives.py``; these only
share its rule that the runtime is the one caller of ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardkit.core.runtime.flat_collectives import all_gather_single
from shardkit.core.runtime.groups import cpu_world
from shardkit.core.runtime.p2p.p2p_tags import OBJECT_TRANSFERS

__all__ = [
    "all_gather_bytes",
    "all_reduce_max",
    "broadcast_bytes",
    "broadcast_from",
    "broadcast_from_first",
    "gather_rows_to_first",
    "gather_to_first",
    "ranks_where",
    "scatter_from_first",
]


def gather_to_first(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor] | None:
    """Every rank's ``tensor`` on the group's first rank (rank order), None elsewhere.

    Point to point rather than ``dist.gather``: gloo's gather stages all rows in one more
    flat buffer, which would double the first rank's memory. Its own row is not copied.
    """
    tag = OBJECT_TRANSFERS.tag()
    if group.rank() != 0:
        _wait_all([dist.isend(tensor, group=group, group_dst=0, tag=tag)])
        return None
    rows = [tensor] + [torch.empty_like(tensor) for _ in range(group.size() - 1)]
    _receive_at_first(rows, group, tag)
    return rows


def gather_rows_to_first(
    head: torch.Tensor, body: torch.Tensor, group: dist.ProcessGroup, *, most: int = 1 << 26
) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """Every rank's ``(head, body)`` on the group's first rank (rank order), None elsewhere.

    ``head``: int64, the same length on every rank; ``body``: 1-D int64 of any length (its
    length travels with the head, so the first rank sizes each receive before it posts it).
    A body said to be longer than ``most`` elements, or of a negative length, is not received
    (None in its place): the first rank never allocates what a peer's header claims unchecked.
    A rank's own body over ``most`` is not sent either (its length is sent as -1).
    """
    length = body.numel() if body.numel() <= most else -1
    framed = torch.cat([head.reshape(-1), torch.tensor([length], dtype=torch.int64)])
    heads = gather_to_first(framed, group)
    tag = OBJECT_TRANSFERS.tag()
    if heads is None:
        if length > 0:
            _wait_all([dist.isend(body.contiguous(), group=group, group_dst=0, tag=tag)])
        return None
    claimed = [int(h[-1]) for h in heads]
    bodies: list[torch.Tensor | None] = [body if length >= 0 else None]
    bodies += [torch.empty(n, dtype=torch.int64) if 0 <= n <= most else None for n in claimed[1:]]
    # An empty body is not sent, so not received either.
    _receive_at_first([b if b is not None and b.numel() else None for b in bodies], group, tag)
    return [(h[:-1], b) for h, b in zip(heads, bodies, strict=True)]


def scatter_from_first(
    out: torch.Tensor, rows: list[torch.Tensor] | None, group: dist.ProcessGroup
) -> None:
    """Row r of the first rank's ``rows`` into ``out`` on rank r (``rows`` only on the first)."""
    tag = OBJECT_TRANSFERS.tag()
    if group.rank() != 0:
        _wait_all([dist.irecv(out, group=group, group_src=0, tag=tag)])
        return
    assert rows is not None and len(rows) == group.size()
    works = [
        dist.isend(rows[peer], group=group, group_dst=peer, tag=tag)
        for peer in range(1, group.size())
    ]
    out.copy_(rows[0])
    _wait_all(works)


def _receive_at_first(
    rows: Sequence[torch.Tensor | None], group: dist.ProcessGroup, tag: int
) -> None:
    """On the first rank: peer r's message into ``rows[r]``, all posted before any is waited for.

    ``rows[0]`` is the first rank's own; a None row is not received (a peer that sends nothing,
    or one whose claimed size was refused).
    """
    _wait_all(
        [
            dist.irecv(row, group=group, group_src=peer, tag=tag)
            for peer, row in enumerate(rows)
            if peer > 0 and row is not None
        ]
    )


def _wait_all(works: list[dist.Work | None]) -> None:
    """Wait on every posted message (a message to or from this rank itself has no work)."""
    for work in works:
        if work is not None:
            work.wait()


def broadcast_from(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Global rank ``src``'s ``tensor`` on every rank of ``group`` (default: the world)."""
    dist.broadcast(tensor, src=src, group=group)


def ranks_where(flag: bool) -> list[int]:
    """The global ranks whose ``flag`` is True (every rank of the world must call it)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.uint8)
    mine = torch.tensor([int(flag)], dtype=torch.uint8)
    all_gather_single(flags, mine)
    return [rank for rank, value in enumerate(flags.tolist()) if value]


def broadcast_from_first(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """The first rank's ``tensor`` on every rank of ``group`` (default: the world), in place."""
    dist.broadcast(tensor, group=group, group_src=0)


# --- small messages between ranks (outcomes, agreements) -----------------------------------


def broadcast_bytes(
    payload: bytes | None, src: int, group: dist.ProcessGroup | None = None
) -> bytes:
    """Global rank ``src``'s ``payload`` on every rank of ``group`` (the others pass None).

    ``group``: a gloo group (default: the world's, :func:`~shardkit.core.runtime.groups.
    cpu_world`); a background checkpoint write passes its own.
    """
    group = group if group is not None else cpu_world()
    mine = payload if dist.get_rank() == src and payload is not None else b""
    size = torch.tensor([len(mine)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buffer = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else None
    if buffer is None:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    if buffer.numel():
        dist.broadcast(buffer, src=src, group=group)
    return bytes(buffer.numpy())


def all_reduce_max(values: list[int], group: dist.ProcessGroup | None = None) -> list[int]:
    """The element-wise maximum of every rank's ``values`` (int64, the same length on all).

    ``group``: a gloo group (default: the world's, :func:`~shardkit.core.runtime.groups.
    cpu_world`). One all-reduce of ``8 * len(values)`` bytes: a verdict of fixed size, where
    :func:`all_gather_bytes` would carry each rank's message.
    """
    group = group if group is not None else cpu_world()
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in tensor.tolist()]


def all_gather_bytes(
    payload: bytes, group: dist.ProcessGroup | None = None, *, device: torch.device | None = None
) -> list[bytes]:
    """Every rank's ``payload``, in rank order, on every rank of ``group`` (default: the world).

    The bytes travel in tensors on ``device`` (default: the CPU), which ``group`` must take:
    the CPU for gloo (the world's default, :func:`~shardkit.core.runtime.groups.cpu_world`),
    the rank's GPU for NCCL.
    """
    group = group if group is not None else cpu_world()
    device = device if device is not None else torch.device("cpu")
    world = group.size()
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    mine_size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    all_gather_single(sizes, mine_size, group=group)
    lengths = [int(n) for n in sizes.tolist()]
    longest = max(lengths)
    if not longest:
        return [b""] * world
    mine = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    rows = torch.empty(world, longest, dtype=torch.uint8, device=device)
    all_gather_single(rows.view(-1), mine.to(device), group=group)
    on_host = rows.cpu()
    return [bytes(on_host[r, : lengths[r]].numpy()) for r in range(world)]
