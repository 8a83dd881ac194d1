"""Rows to their matrix's owner, and the owner's update rows back: one exchange each way.

All the sharded matrices of one process group travel in the same two collectives, whatever
their number, shapes and dtypes: rank r's rows of every matrix that rank o owns go out as one
part, packed as bytes, and ``runtime/byte_exchange.py`` carries the W parts at once. Every rank
knows every part's size from the step's plan (the shapes, the row bounds, the owners and the
dtypes), so nothing is exchanged to size them. Each piece starts at a multiple of
``_ALIGN`` bytes, so that it can be read back in place as any dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.core.optim.matrices import MatrixPlacement
from shardkit.core.runtime.byte_exchange import exchange_bytes

__all__ = ["Traffic", "gather_to_owners", "scatter_from_owners"]

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
    """One matrix's rows of one rank, where they sit in a packed part."""

    matrix: int  # index into the step's list of matrices
    first: int  # row bounds in the whole matrix
    stop: int
    cols: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        raw = (self.stop - self.first) * self.cols * self.dtype.itemsize
        return -(-raw // _ALIGN) * _ALIGN


def gather_to_owners(
    matrices: list[MatrixPlacement],
    owners: list[int],
    rows: list[torch.Tensor],
    group: dist.ProcessGroup,
) -> tuple[dict[int, torch.Tensor], Traffic]:
    """Each matrix whole on its owner, from every rank's rows of it.

    Args:
        matrices: the step's sharded matrices on ``group``, in the same order on every rank.
        owners: each one's owning group rank.
        rows: this rank's rows of each (its block, possibly empty), in the dtype to send.
        group: the ranks that hold them.

    Returns:
        The matrices this rank owns, whole, by index; and the bytes moved.
    """
    rank, world = group.rank(), group.size()
    dtypes = [r.dtype for r in rows]
    device = rows[0].device if rows else torch.device("cpu")
    piece = _pieces(matrices, dtypes)
    owned = _owned(owners, world)
    outgoing = [[piece(i, rank) for i in owned[dest]] for dest in range(world)]
    incoming = [[piece(i, src) for i in owned[rank]] for src in range(world)]
    send = _pack(outgoing, lambda p: rows[p.matrix], device)
    received = exchange_bytes(send, _sizes(outgoing), _sizes(incoming), group)
    wholes = {
        i: torch.empty(matrices[i].shape, dtype=dtypes[i], device=send.device) for i in owned[rank]
    }
    for p, view in _unpack(received, incoming):
        wholes[p.matrix][p.first : p.stop].copy_(view)
    return wholes, _traffic(outgoing, incoming, rank)


def scatter_from_owners(
    matrices: list[MatrixPlacement],
    owners: list[int],
    updates: dict[int, torch.Tensor],
    dtypes: list[torch.dtype],
    group: dist.ProcessGroup,
    device: torch.device,
) -> tuple[list[torch.Tensor], Traffic]:
    """This rank's rows of every matrix's update, from the owners' whole updates.

    Args:
        matrices: as :func:`gather_to_owners` took them.
        owners: each one's owning group rank.
        updates: the whole updates of the matrices this rank owns, by index.
        dtypes: each update's dtype, known to every rank beforehand.
        group: the ranks that hold them.
        device: where the buffers go (a rank that owns nothing has no update to tell it).

    Returns:
        This rank's rows of each update (views into one received buffer), in ``matrices``'
        order; and the bytes moved.
    """
    rank, world = group.rank(), group.size()
    piece = _pieces(matrices, dtypes)
    owned = _owned(owners, world)
    outgoing = [[piece(i, dest) for i in owned[rank]] for dest in range(world)]
    incoming = [[piece(i, rank) for i in owned[src]] for src in range(world)]
    send = _pack(outgoing, lambda p: updates[p.matrix][p.first : p.stop], device)
    received = exchange_bytes(send, _sizes(outgoing), _sizes(incoming), group)
    mine: list[torch.Tensor | None] = [None] * len(matrices)
    for p, view in _unpack(received, incoming):
        mine[p.matrix] = view
    assert all(m is not None for m in mine), "a matrix's rows came from no owner"
    return [m for m in mine if m is not None], _traffic(outgoing, incoming, rank)


def _pieces(
    matrices: list[MatrixPlacement], dtypes: list[torch.dtype]
) -> Callable[[int, int], _Piece]:
    """piece(i, holder): matrix i's rows on group rank ``holder``, as they travel."""

    def piece(i: int, holder: int) -> _Piece:
        m = matrices[i]
        return _Piece(i, m.bounds[holder], m.bounds[holder + 1], m.shape[1], dtypes[i])

    return piece


def _owned(owners: list[int], world: int) -> list[list[int]]:
    """The matrices each rank owns, in the step's order."""
    return [[i for i, o in enumerate(owners) if o == rank] for rank in range(world)]


def _pack(
    parts: list[list[_Piece]],
    source: Callable[[_Piece], torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """The pieces of every part, one after another, as one uint8 buffer."""
    send = torch.empty(sum(_sizes(parts)), dtype=torch.uint8, device=device)
    offset = 0
    for part in parts:
        for p in part:
            tensor = source(p)
            assert tensor.dtype == p.dtype and tensor.shape == (p.stop - p.first, p.cols), (
                f"rows of matrix {p.matrix}: {tuple(tensor.shape)} {tensor.dtype}, planned "
                f"{(p.stop - p.first, p.cols)} {p.dtype}"
            )
            _view(send, offset, p).copy_(tensor)
            offset += p.nbytes
    return send


def _unpack(received: torch.Tensor, parts: list[list[_Piece]]) -> list[tuple[_Piece, torch.Tensor]]:
    """Each piece of ``parts`` and its rows, read in place from ``received``."""
    found: list[tuple[_Piece, torch.Tensor]] = []
    offset = 0
    for part in parts:
        for p in part:
            found.append((p, _view(received, offset, p)))
            offset += p.nbytes
    return found


def _view(buffer: torch.Tensor, offset: int, p: _Piece) -> torch.Tensor:
    count = (p.stop - p.first) * p.cols
    raw = buffer[offset : offset + count * p.dtype.itemsize]
    return raw.view(p.dtype).view(p.stop - p.first, p.cols)


def _sizes(parts: list[list[_Piece]]) -> list[int]:
    return [sum(p.nbytes for p in part) for part in parts]


def _traffic(outgoing: list[list[_Piece]], incoming: list[list[_Piece]], rank: int) -> Traffic:
    sent, received = _sizes(outgoing), _sizes(incoming)
    return Traffic(sum(sent) - sent[rank], sum(received) - received[rank])
