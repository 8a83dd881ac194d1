"""Blocks to their matrix's owner, and the owner's update blocks back: one exchange each way.

All the sharded matrices of one process group travel in the same two collectives, whatever
their number, shapes, dtypes and placements: the blocks rank r sends rank o go out as one
part, packed as bytes, and ``runtime/byte_exchange.py`` carries the W parts at once.

- To owners, one copy of each distinct block travels (``MatrixPlacement.senders``): under
  HSDP each replica's ranks gather from their own replica, and a block the owner holds (a
  whole expert, a replicated matrix) moves no byte.
- Back, every holder of a block gets its rows of the update, every replica's included.

A :class:`Route` says which pieces each part holds; every rank builds the same routes from the
step's plan (blocks, owners, dtypes), so nothing is exchanged to size the parts. Each piece
starts at a multiple of ``_ALIGN`` bytes, so that it can be read back in place as any dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.core.optim.matrices import Block, MatrixPlacement
from shardkit.core.runtime.byte_exchange import exchange_bytes

__all__ = ["Route", "Traffic", "gather_to_owners", "routes", "scatter_from_owners"]

_ALIGN = 16  # bytes: the widest element (complex128) a piece may be read back as


@dataclass(frozen=True, slots=True)
class Traffic:
    """What one exchange moved for this rank, its own part (a local copy) left out."""

    sent: int
    """Bytes sent to other ranks."""
    received: int
    """Bytes received from other ranks."""


@dataclass(frozen=True, slots=True)
class _Piece:
    """One block of one matrix, as it travels in a packed part."""

    matrix: int  # index into the step's list of matrices
    block: Block
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        rows, cols = self.block.shape
        return -(-(rows * cols * self.dtype.itemsize) // _ALIGN) * _ALIGN


@dataclass(frozen=True, slots=True)
class Route:
    """One exchange as this rank sees it: the pieces of each part it sends and receives."""

    outgoing: tuple[tuple[_Piece, ...], ...]
    """By destination group rank."""
    incoming: tuple[tuple[_Piece, ...], ...]
    """By source group rank."""
    rank: int
    owned: tuple[int, ...]
    """The matrices this rank owns."""

    def traffic(self) -> Traffic:
        """The bytes this exchange moves between this rank and the others."""
        sent, received = _sizes(self.outgoing), _sizes(self.incoming)
        return Traffic(sum(sent) - sent[self.rank], sum(received) - received[self.rank])


def routes(
    matrices: list[MatrixPlacement],
    owners: list[int],
    out_dtypes: list[torch.dtype],
    back_dtypes: list[torch.dtype],
    rank: int,
) -> tuple[Route, Route]:
    """This rank's routes of a step: blocks to owners, then update blocks back.

    Args:
        matrices: the step's sharded matrices on one group, in the same order on every rank.
        owners: each one's owning group rank.
        out_dtypes: what travels to the owner of each (``prepare``'s dtype).
        back_dtypes: what comes back (``update_dtype``).
        rank: this rank in the group.
    """
    world = len(matrices[0].blocks)
    owned = [[i for i, o in enumerate(owners) if o == r] for r in range(world)]
    senders = [set(m.senders(o)) for m, o in zip(matrices, owners, strict=True)]

    def sent(i: int, src: int) -> tuple[_Piece, ...]:  # matrix i's piece from src to its owner
        return (_Piece(i, matrices[i].blocks[src], out_dtypes[i]),) if src in senders[i] else ()

    def back(i: int, dest: int) -> tuple[_Piece, ...]:  # matrix i's update rows for dest
        block = matrices[i].blocks[dest]
        return () if block.empty else (_Piece(i, block, back_dtypes[i]),)

    there = Route(
        tuple(tuple(p for i in owned[d] for p in sent(i, rank)) for d in range(world)),
        tuple(tuple(p for i in owned[rank] for p in sent(i, s)) for s in range(world)),
        rank,
        tuple(owned[rank]),
    )
    home = Route(
        tuple(tuple(p for i in owned[rank] for p in back(i, d)) for d in range(world)),
        tuple(tuple(p for i in owned[s] for p in back(i, rank)) for s in range(world)),
        rank,
        tuple(owned[rank]),
    )
    return there, home


def gather_to_owners(
    matrices: list[MatrixPlacement],
    route: Route,
    blocks: list[torch.Tensor],
    group: dist.ProcessGroup,
) -> dict[int, torch.Tensor]:
    """Each matrix whole on its owner, from one copy of every block of it.

    Args:
        matrices: the step's sharded matrices on ``group``, as the route was made for.
        route: ``routes``' first.
        blocks: this rank's block of each (possibly empty), in the dtype to send.
        group: the ranks that hold them.

    Returns:
        The matrices this rank owns, whole, by index.
    """
    device = blocks[0].device if blocks else torch.device("cpu")
    send = _pack(route.outgoing, lambda p: blocks[p.matrix], device)
    received = exchange_bytes(send, _sizes(route.outgoing), _sizes(route.incoming), group)
    wholes = {
        i: torch.empty(matrices[i].shape, dtype=blocks[i].dtype, device=send.device)
        for i in route.owned
    }
    for p, view in _unpack(received, route.incoming):
        p.block.of(wholes[p.matrix]).copy_(view)
    return wholes


def scatter_from_owners(
    matrices: list[MatrixPlacement],
    route: Route,
    updates: dict[int, torch.Tensor],
    dtypes: list[torch.dtype],
    group: dist.ProcessGroup,
    device: torch.device,
) -> list[torch.Tensor]:
    """This rank's block of every matrix's update, from the owners' whole updates.

    Args:
        matrices: as :func:`gather_to_owners` took them.
        route: ``routes``' second.
        updates: the whole updates of the matrices this rank owns, by index.
        dtypes: each update's dtype, known to every rank beforehand.
        group: the ranks that hold them.
        device: where the buffers go (a rank that owns nothing has no update to tell it).

    Returns:
        This rank's block of each update (views into one received buffer; an empty tensor
        where it holds none), in ``matrices``' order.
    """
    send = _pack(route.outgoing, lambda p: p.block.of(updates[p.matrix]), device)
    received = exchange_bytes(send, _sizes(route.outgoing), _sizes(route.incoming), group)
    mine: list[torch.Tensor | None] = [None] * len(matrices)
    for p, view in _unpack(received, route.incoming):
        mine[p.matrix] = view
    rank = route.rank
    return [
        torch.empty(m.blocks[rank].shape, dtype=dtypes[i], device=device) if got is None else got
        for i, (m, got) in enumerate(zip(matrices, mine, strict=True))
    ]


def _pack(
    parts: tuple[tuple[_Piece, ...], ...],
    source: Callable[[_Piece], torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """The pieces of every part, one after another, as one uint8 buffer."""
    send = torch.empty(sum(_sizes(parts)), dtype=torch.uint8, device=device)
    offset = 0
    for part in parts:
        for p in part:
            tensor = source(p)
            assert tensor.dtype == p.dtype and tensor.shape == p.block.shape, (
                f"block of matrix {p.matrix}: {tuple(tensor.shape)} {tensor.dtype}, planned "
                f"{p.block.shape} {p.dtype}"
            )
            _view(send, offset, p).copy_(tensor)
            offset += p.nbytes
    return send


def _unpack(
    received: torch.Tensor, parts: tuple[tuple[_Piece, ...], ...]
) -> list[tuple[_Piece, torch.Tensor]]:
    """Each piece of ``parts`` and its block, read in place from ``received``."""
    found: list[tuple[_Piece, torch.Tensor]] = []
    offset = 0
    for part in parts:
        for p in part:
            found.append((p, _view(received, offset, p)))
            offset += p.nbytes
    return found


def _view(buffer: torch.Tensor, offset: int, p: _Piece) -> torch.Tensor:
    rows, cols = p.block.shape
    raw = buffer[offset : offset + rows * cols * p.dtype.itemsize]
    return raw.view(p.dtype).view(rows, cols)


def _sizes(parts: tuple[tuple[_Piece, ...], ...]) -> list[int]:
    return [sum(p.nbytes for p in part) for part in parts]
