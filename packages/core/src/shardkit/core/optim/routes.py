"""Which blocks each exchange of a whole-matrix optimizer's step carries: routes, as data.

Pure arithmetic on the step's plan (blocks, owners, dtypes): every rank computes the same
routes with no message, and the planner (``shardkit-plan --optimizer muon``) sizes the
exchange's collectives with them. ``exchange.py`` carries what they say.

A :class:`Route` says which pieces each part holds. Each piece starts at a multiple of
``ALIGN`` bytes, so that it can be read back in place as any dtype. A rank's own part is empty:
an owner's own block is copied straight into its whole matrix, and its own rows of an update
it owns are read from the whole update (``Route.kept``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardkit.core.optim.blocks import Block, MatrixPlacement

__all__ = ["ALIGN", "Piece", "Route", "Traffic", "part_sizes", "routes", "row_joins"]

ALIGN = 16  # bytes: the widest element (complex128) a piece may be read back as


@dataclass(frozen=True, slots=True)
class Traffic:
    """What one exchange moved for this rank, its own part (a local copy) left out."""

    sent: int
    """Bytes sent to other ranks."""
    received: int
    """Bytes received from other ranks."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One block of one matrix, as it travels in a packed part."""

    matrix: int  # index into the step's list of matrices
    block: Block
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Its bytes in a part: its elements', rounded up to ``ALIGN``."""
        rows, cols = self.block.shape
        return -(-(rows * cols * self.dtype.itemsize) // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class Route:
    """One exchange as this rank sees it: the pieces of each part it sends and receives."""

    outgoing: tuple[tuple[Piece, ...], ...]
    """By destination group rank; nothing to this rank itself."""
    incoming: tuple[tuple[Piece, ...], ...]
    """By source group rank; nothing from this rank itself."""
    rank: int
    owned: tuple[int, ...]
    """The matrices this rank owns."""
    kept: tuple[int, ...]
    """The owned matrices whose block on this rank stays here: to owners, those it sends
    itself; back, those it holds rows of."""

    def traffic(self) -> Traffic:
        """The bytes this exchange moves between this rank and the others."""
        return Traffic(sum(part_sizes(self.outgoing)), sum(part_sizes(self.incoming)))

    def only(self, chosen: frozenset[int]) -> Route:
        """This exchange for the ``chosen`` matrices alone (one round's)."""

        def keep(parts: tuple[tuple[Piece, ...], ...]) -> tuple[tuple[Piece, ...], ...]:
            return tuple(tuple(p for p in part if p.matrix in chosen) for part in parts)

        return Route(
            keep(self.outgoing),
            keep(self.incoming),
            self.rank,
            tuple(i for i in self.owned if i in chosen),
            tuple(i for i in self.kept if i in chosen),
        )


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

    def sent(i: int, src: int) -> tuple[Piece, ...]:  # matrix i's piece from src to its owner
        return (Piece(i, matrices[i].blocks[src], out_dtypes[i]),) if src in senders[i] else ()

    def back(i: int, dest: int) -> tuple[Piece, ...]:  # matrix i's update rows for dest
        block = matrices[i].blocks[dest]
        return () if block.empty else (Piece(i, block, back_dtypes[i]),)

    def parts(part: Callable[[int], tuple[Piece, ...]]) -> tuple[tuple[Piece, ...], ...]:
        return tuple(() if r == rank else part(r) for r in range(world))  # own part: empty

    there = Route(
        parts(lambda d: tuple(p for i in owned[d] for p in sent(i, rank))),
        parts(lambda s: tuple(p for i in owned[rank] for p in sent(i, s))),
        rank,
        tuple(owned[rank]),
        tuple(i for i in owned[rank] if rank in senders[i]),
    )
    home = Route(
        parts(lambda d: tuple(p for i in owned[rank] for p in back(i, d))),
        parts(lambda s: tuple(p for i in owned[s] for p in back(i, rank))),
        rank,
        tuple(owned[rank]),
        tuple(i for i in owned[rank] if not matrices[i].blocks[rank].empty),
    )
    return there, home


def part_sizes(parts: tuple[tuple[Piece, ...], ...]) -> list[int]:
    """Each part's bytes."""
    return [sum(p.nbytes for p in part) for part in parts]


def row_joins(route: Route, matrices: list[MatrixPlacement]) -> dict[int, tuple[int, ...]]:
    """The owned matrices whose sources are full-width row blocks that tile them.

    For each, the order (by row) of its incoming pieces (indices into the route's incoming
    pieces, all parts in order; -1: this rank's own block), so that one ``cat`` makes it
    whole once all is in. The others are copied into place block by block as they come, into
    a whole made before the exchange is in (the planner counts it then).
    """
    incoming = [p for part in route.incoming for p in part]
    rows: dict[int, tuple[int, ...]] = {}
    for i in route.owned:
        sources = [(p.block, k) for k, p in enumerate(incoming) if p.matrix == i]
        if i in route.kept:
            sources.append((matrices[i].blocks[route.rank], -1))
        sources.sort(key=lambda source: source[0].row0)
        m, n = matrices[i].shape
        tiles = [(b.row0, b.row1) for b, _ in sources if b.col0 == 0 and b.col1 == n]
        edges = [0, *(row1 for _, row1 in tiles)]
        if len(tiles) == len(sources) and [r0 for r0, _ in tiles] == edges[:-1] and edges[-1] == m:
            rows[i] = tuple(k for _, k in sources)
    return rows
