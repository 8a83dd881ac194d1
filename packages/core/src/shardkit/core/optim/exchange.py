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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.core.optim.blocks import MatrixPlacement
from shardkit.core.optim.routes import Piece, Route, part_sizes
from shardkit.core.runtime.byte_exchange import start_exchange_bytes
from shardkit.core.runtime.handles import WorkHandle

__all__ = ["Arrival", "start_gather", "start_scatter"]


@dataclass(slots=True)
class Arrival:
    """One exchange in flight: what it receives, read once its collective is done."""

    route: Route
    sent: torch.Tensor
    """What this rank sends: kept alive until the collective is done."""
    received: torch.Tensor
    handle: WorkHandle
    read: Callable[[list[tuple[Piece, torch.Tensor]]], dict[int, torch.Tensor]]

    def wait(self) -> dict[int, torch.Tensor]:
        """Block until it is in; then its tensors by matrix index."""
        self.handle.wait()
        self.sent = self.received[:0]  # free now
        return self.read(_unpack(self.received, self.route.incoming))


def start_gather(
    matrices: list[MatrixPlacement],
    route: Route,
    blocks: list[torch.Tensor],
    group: dist.ProcessGroup,
) -> Arrival:
    """Start sending one copy of every block of each matrix to its owner.

    Args:
        matrices: the step's sharded matrices on ``group``, as the route was made for.
        route: ``routes``' first, or one round of it (``Route.only``).
        blocks: this rank's block of each (possibly empty), in the dtype to send.
        group: the ranks that hold them.

    Returns:
        The exchange in flight; its ``wait()`` gives the matrices this rank owns in ``route``,
        whole, by index.
    """
    device = blocks[0].device if blocks else torch.device("cpu")
    send = _pack(route.outgoing, lambda p: blocks[p.matrix], device)
    received, handle = start_exchange_bytes(
        send, part_sizes(route.outgoing), part_sizes(route.incoming), group
    )
    # Whole matrices start with this rank's own blocks, copied while the others travel.
    wholes = {
        i: torch.empty(matrices[i].shape, dtype=blocks[i].dtype, device=send.device)
        for i in route.owned
    }
    for i in route.kept:
        matrices[i].blocks[route.rank].of(wholes[i]).copy_(blocks[i])

    def read(pieces: list[tuple[Piece, torch.Tensor]]) -> dict[int, torch.Tensor]:
        for p, view in pieces:
            p.block.of(wholes[p.matrix]).copy_(view)
        return wholes

    return Arrival(route, send, received, handle, read)


def start_scatter(
    matrices: list[MatrixPlacement],
    route: Route,
    updates: dict[int, torch.Tensor],
    group: dist.ProcessGroup,
    device: torch.device,
) -> Arrival:
    """Start sending every holder its block of the owners' whole updates.

    Args:
        matrices: as :func:`start_gather` took them.
        route: ``routes``' second, or one round of it.
        updates: the whole updates of the matrices this rank owns in ``route``, by index.
        group: the ranks that hold them.
        device: where the buffers go (a rank that owns nothing has no update to tell it).

    Returns:
        The exchange in flight; its ``wait()`` gives this rank's block of the update of every
        matrix of the round that it holds rows of, by index: views into the received buffer,
        or into the whole update where this rank owns the matrix.
    """
    send = _pack(route.outgoing, lambda p: p.block.of(updates[p.matrix]), device)
    received, handle = start_exchange_bytes(
        send, part_sizes(route.outgoing), part_sizes(route.incoming), group
    )
    # A view: the owner's own rows of its update, never copied.
    kept = {i: matrices[i].blocks[route.rank].of(updates[i]) for i in route.kept}

    def read(pieces: list[tuple[Piece, torch.Tensor]]) -> dict[int, torch.Tensor]:
        return {**kept, **{p.matrix: view for p, view in pieces}}

    return Arrival(route, send, received, handle, read)


def _pack(
    parts: tuple[tuple[Piece, ...], ...],
    source: Callable[[Piece], torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """The pieces of every part, one after another, as one uint8 buffer."""
    send = torch.empty(sum(part_sizes(parts)), dtype=torch.uint8, device=device)
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
    received: torch.Tensor, parts: tuple[tuple[Piece, ...], ...]
) -> list[tuple[Piece, torch.Tensor]]:
    """Each piece of ``parts`` and its block, read in place from ``received``."""
    found: list[tuple[Piece, torch.Tensor]] = []
    offset = 0
    for part in parts:
        for p in part:
            found.append((p, _view(received, offset, p)))
            offset += p.nbytes
    return found


def _view(buffer: torch.Tensor, offset: int, p: Piece) -> torch.Tensor:
    rows, cols = p.block.shape
    raw = buffer[offset : offset + rows * cols * p.dtype.itemsize]
    return raw.view(p.dtype).view(rows, cols)
