"""Blocks to their matrix's owner, and the owner's update blocks back: exchanges in rounds.

All the sharded matrices of one process group travel in a few collectives, whatever their
number, shapes, dtypes and placements: the blocks rank r sends rank o in one round go out as
one part, packed as bytes, and ``runtime/byte_exchange.py`` carries the W parts at once. Each
owner's matrices are cut into rounds of about equal cost (``owners.rounds``); every round's
blocks are sent at once, and an owner orthogonalizes a round's matrices as soon as they
are in, then sends their updates back while it works on the next round (one exchange each way
a round: :func:`start_gather` and :func:`start_scatter` leave it in flight).

- To owners, one copy of each distinct block travels (``MatrixPlacement.senders``): under
  HSDP each replica's ranks gather from their own replica, and a block the owner holds (a
  whole expert, a replicated matrix) moves no byte.
- Back, every holder of a block gets its rows of the update, every replica's included.

What each part holds is its :class:`~shardkit.core.optim.routes.Route`'s (``routes.py``), which
every rank builds alike from the step's plan, so nothing is exchanged to size the parts. A
rank's own part is empty: its own blocks are neither packed nor copied by the collective nor
unpacked (at W=2, half of each exchange's copies).

A step launches few operators for its moves, whatever the number of matrices and ranks: the
layout of a route is worked out once per plan (:class:`Packing`), and where its pieces are of
one dtype with no padding between them (each piece's bytes a multiple of ``ALIGN``: every
matrix whose blocks hold a multiple of 8 bf16 elements) a part's pieces are packed by one
``cat``, read back by one ``split`` and a view each, and an owner's matrix that its ranks hold
as rows is joined by one ``cat`` of its row blocks. Otherwise each piece is copied alone (4
dispatches a piece, at W=64 two thousand a step on the host, against some 600 this way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.core.optim.blocks import MatrixPlacement
from shardkit.core.optim.routes import Piece, Route, Traffic, part_sizes, row_joins
from shardkit.core.runtime.byte_exchange import start_exchange_bytes
from shardkit.core.runtime.handles import WorkHandle

__all__ = ["Arrival", "Packing", "packing", "start_gather", "start_scatter"]


@dataclass(frozen=True, slots=True)
class Packing:
    """One route and its layout, worked out once per plan rather than at every step."""

    route: Route
    send_sizes: list[int]
    """Each outgoing part's bytes."""
    receive_sizes: list[int]
    """Each incoming part's bytes."""
    traffic: Traffic
    outgoing: tuple[Piece, ...]
    """Every outgoing piece, part after part."""
    incoming: tuple[Piece, ...]
    """Every incoming piece, part after part."""
    dtype: torch.dtype | None
    """The one dtype of every piece both ways, where no piece is padded: then parts are packed
    by one ``cat`` and read by one ``split``. None: piece by piece."""
    incoming_numels: list[int]
    """Each incoming piece's elements."""
    sent_matrices: frozenset[int]
    """The matrices this rank sends pieces of."""
    rows: dict[int, tuple[int, ...]]
    """An owned matrix whose sources are full-width row blocks that tile it: the order (by
    row) of its incoming pieces (indices into ``incoming``; -1: this rank's own block), so that
    one ``cat`` makes it whole. Others are copied into place block by block."""


def packing(route: Route, matrices: list[MatrixPlacement]) -> Packing:
    """``route``'s layout, for ``matrices`` (the step's sharded matrices the route was made for)."""
    outgoing = tuple(p for part in route.outgoing for p in part)
    incoming = tuple(p for part in route.incoming for p in part)
    dtypes = {p.dtype for p in (*outgoing, *incoming)}
    unpadded = all(p.nbytes == _raw_bytes(p) for p in (*outgoing, *incoming))
    dtype = next(iter(dtypes)) if len(dtypes) == 1 and unpadded else None
    rows = row_joins(route, matrices)
    send_sizes, receive_sizes = part_sizes(route.outgoing), part_sizes(route.incoming)
    traffic = Traffic(sum(send_sizes), sum(receive_sizes))
    numels = [_raw_bytes(p) // p.dtype.itemsize for p in incoming]
    return Packing(
        route,
        send_sizes,
        receive_sizes,
        traffic,
        outgoing,
        incoming,
        dtype,
        numels,
        frozenset(p.matrix for p in outgoing),
        rows,
    )


@dataclass(slots=True)
class Arrival:
    """One exchange in flight: what it receives, read once its collective is done."""

    packing: Packing
    sent: torch.Tensor
    """What this rank sends: kept alive until the collective is done."""
    received: torch.Tensor
    handle: WorkHandle
    read: Callable[[list[tuple[Piece, torch.Tensor]]], dict[int, torch.Tensor]]

    def wait(self) -> dict[int, torch.Tensor]:
        """Block until it is in; then its tensors by matrix index.

        Once only: what it read is let go of here (the received buffer, and what ``read``
        built), so that the first exchange's buffers and whole matrices are not held through
        the second's.
        """
        self.handle.wait()
        # Free now; a new empty tensor, as a view (even of no element) would hold the storage.
        self.sent = torch.empty(0, dtype=torch.uint8, device=self.received.device)
        try:
            return self.read(_unpack(self.received, self.packing))
        finally:
            self.received = self.sent  # views read out of it keep what they need of it
            self.read = _read_once


def _read_once(pieces: list[tuple[Piece, torch.Tensor]]) -> dict[int, torch.Tensor]:
    raise AssertionError("an exchange's arrival is read once")


def start_gather(
    matrices: list[MatrixPlacement],
    packing: Packing,
    blocks: list[torch.Tensor],
    group: dist.ProcessGroup,
) -> Arrival:
    """Start sending one copy of every block of each matrix to its owner.

    Args:
        matrices: the step's sharded matrices on ``group``, as the route was made for.
        packing: the layout of ``routes``' first, or of one round of it (``Route.only``).
        blocks: this rank's block of each (possibly empty), in the dtype to send.
        group: the ranks that hold them.

    Returns:
        The exchange in flight; its ``wait()`` gives the matrices this rank owns in the route,
        whole, by index.
    """
    device = blocks[0].device if blocks else torch.device("cpu")
    send = _pack(packing, lambda p: blocks[p.matrix], device)
    received, handle = start_exchange_bytes(send, packing.send_sizes, packing.receive_sizes, group)
    route = packing.route
    # Matrices held as rows are joined by one cat once all is in; the others start with this
    # rank's own block, copied while the rest travels.
    wholes = {
        i: torch.empty(matrices[i].shape, dtype=blocks[i].dtype, device=send.device)
        for i in route.owned
        if i not in packing.rows
    }
    for i in route.kept:
        if i in wholes:
            matrices[i].blocks[route.rank].of(wholes[i]).copy_(blocks[i])

    def read(pieces: list[tuple[Piece, torch.Tensor]]) -> dict[int, torch.Tensor]:
        for p, view in pieces:
            if p.matrix in wholes:
                p.block.of(wholes[p.matrix]).copy_(view)
        for i, order in packing.rows.items():
            # Always a new tensor, as the copies above make: a rule may work in place.
            wholes[i] = torch.cat([blocks[i] if k < 0 else pieces[k][1] for k in order])
        return wholes

    return Arrival(packing, send, received, handle, read)


def start_scatter(
    matrices: list[MatrixPlacement],
    packing: Packing,
    updates: dict[int, torch.Tensor],
    group: dist.ProcessGroup,
    device: torch.device,
) -> Arrival:
    """Start sending every holder its block of the owners' whole updates.

    Args:
        matrices: as :func:`start_gather` took them.
        packing: the layout of ``routes``' second, or of one round of it.
        updates: the whole updates of the matrices this rank owns in the route, by index.
        group: the ranks that hold them.
        device: where the buffers go (a rank that owns nothing has no update to tell it).

    Returns:
        The exchange in flight; its ``wait()`` gives this rank's block of the update of every
        matrix of the round that it holds rows of, by index: views into the received buffer,
        or into the whole update where this rank owns the matrix.
    """
    # A tall matrix's update comes back transposed (Newton-Schulz iterates on the wide side):
    # made contiguous once, its row blocks pack as views, not a copy each.
    packed = {i: updates[i].contiguous() for i in packing.sent_matrices}
    send = _pack(packing, lambda p: p.block.of(packed[p.matrix]), device)
    received, handle = start_exchange_bytes(send, packing.send_sizes, packing.receive_sizes, group)
    route = packing.route
    # A view: the owner's own rows of its update, never copied.
    kept = {i: matrices[i].blocks[route.rank].of(updates[i]) for i in route.kept}

    def read(pieces: list[tuple[Piece, torch.Tensor]]) -> dict[int, torch.Tensor]:
        return {**kept, **{p.matrix: view for p, view in pieces}}

    return Arrival(packing, send, received, handle, read)


def _pack(
    packing: Packing, source: Callable[[Piece], torch.Tensor], device: torch.device
) -> torch.Tensor:
    """Every outgoing piece, one after another, as one uint8 buffer."""
    total = sum(packing.send_sizes)
    if packing.dtype is not None:
        if not packing.outgoing:
            return torch.empty(0, dtype=torch.uint8, device=device)
        flat = torch.cat([source(p).reshape(-1) for p in packing.outgoing])
        # cat promotes dtypes silently: a block of another dtype or size would show here.
        assert flat.dtype == packing.dtype and flat.numel() * flat.element_size() == total, (
            f"packed {flat.numel()} {flat.dtype}, planned {total} bytes of {packing.dtype}"
        )
        return flat.view(torch.uint8)
    send = torch.empty(total, dtype=torch.uint8, device=device)
    offset = 0
    for p in packing.outgoing:
        tensor = source(p)
        assert tensor.dtype == p.dtype and tensor.shape == p.block.shape, (
            f"block of matrix {p.matrix}: {tuple(tensor.shape)} {tensor.dtype}, planned "
            f"{p.block.shape} {p.dtype}"
        )
        _view(send, offset, p).copy_(tensor)
        offset += p.nbytes
    return send


def _unpack(received: torch.Tensor, packing: Packing) -> list[tuple[Piece, torch.Tensor]]:
    """Each incoming piece and its block, read in place from ``received``."""
    if packing.dtype is not None and packing.incoming:
        flats = torch.split(received.view(packing.dtype), packing.incoming_numels)
        return [
            (p, flat.view(p.block.shape)) for p, flat in zip(packing.incoming, flats, strict=True)
        ]
    found: list[tuple[Piece, torch.Tensor]] = []
    offset = 0
    for p in packing.incoming:
        found.append((p, _view(received, offset, p)))
        offset += p.nbytes
    return found


def _raw_bytes(p: Piece) -> int:
    rows, cols = p.block.shape
    return rows * cols * p.dtype.itemsize


def _view(buffer: torch.Tensor, offset: int, p: Piece) -> torch.Tensor:
    rows, cols = p.block.shape
    raw = buffer[offset : offset + rows * cols * p.dtype.itemsize]
    return raw.view(p.dtype).view(rows, cols)
