"""How the holders of a chunk share its writing: by bytes, in row pieces where a chunk is large.

Under HSDP every chunk of a tensor is held by R ranks (its replicas), and one write of it is
enough. Taking turns tensor by tensor (the tensor's ordinal modulo R) left the bytes to chance:
for an 8B Llama with AdamW at 1,024 ranks (128 replicas of 8), a replica that drew the
embedding's chunks wrote 352 MiB where the median rank wrote 82, and the save waits for the
busiest rank. :func:`shares_by_bytes` shares the writing by bytes instead, computed by every
rank alone from the layout (no collective), value by value in the state's order:

- per holder count R, the mean a holder writes: the bytes of one chunk of every value (the
  largest of its chunks held by R ranks), over R; a piece's target is an eighth of it;
- a value's chunks larger than the target are cut by rows into pieces of about the target
  (at most R, no more than the chunk's rows, and none under :data:`SMALLEST_PIECE`: below
  it a write costs its latency more than its bytes, and small states keep DCP's own chunks);
  each piece goes to a different holder, the least loaded so far (ties: the earlier turn),
  the largest piece first.

A holder is named by its turn, its place among its chunk's holders in mesh order, and loads
are kept per (R, turn): on HSDP's mesh every shard's replicas see the same sequence, so a
rank's bytes are its turn's. Pieces of one value go to the least loaded distinct turns, which
keeps all turns' loads within one piece of each other, so the busiest writes at most the mean
plus the largest piece: 1.125 times the mean where the target is above twice the smallest
piece (8B or 70B with AdamW up to 8,192 ranks at 8 a replica), the mean plus 512 KiB beyond.

:func:`shares_by_turns` is the earlier rule (whole chunks, the ordinal's turn), which
checkpoints with a record of version 1 were written by.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "PIECE_OF_MEAN",
    "SMALLEST_PIECE",
    "Demand",
    "Pieces",
    "Share",
    "cut_chunks",
    "least_loaded",
    "piece_count",
    "shares_by_bytes",
    "shares_by_turns",
    "split_rows",
]

PIECE_OF_MEAN = 8
"""A piece is at most 1/8 of the mean a holder writes: the busiest then writes at most 9/8."""

SMALLEST_PIECE = 256 << 10
"""No chunk is cut into pieces smaller than this (bytes)."""


@dataclass(frozen=True, slots=True)
class Share:
    """How the holders of one value's chunks of one holder count write them."""

    pieces: int
    """Row pieces a chunk is cut into (1: written whole; fewer where a chunk has fewer rows)."""
    turns: tuple[int, ...]
    """The turn (place among the chunk's holders) that writes each piece."""


@dataclass(frozen=True, slots=True)
class Demand:
    """What the rule needs of one value's chunks held by ``holders`` ranks each."""

    holders: int
    nbytes: int
    """The largest such chunk's bytes."""
    rows: int
    """That chunk's rows (its dim 0; 0 for a scalar)."""


def piece_count(pieces: int, rows: int, nbytes: int) -> int:
    """How many pieces a chunk of ``rows`` rows and ``nbytes`` bytes is cut into."""
    return 1 if nbytes == 0 or rows == 0 else min(pieces, rows)


def split_rows(rows: int, pieces: int) -> list[int]:
    """``rows`` cut into ``pieces`` runs, the first ``rows % pieces`` of them one longer."""
    base, extra = divmod(rows, pieces)
    return [base + (1 if j < extra else 0) for j in range(pieces)]


def shares_by_turns(demands: list[list[Demand]]) -> list[dict[int, Share]]:
    """Whole chunks, each written by the holder whose turn is the value's ordinal mod R."""
    return [
        {d.holders: Share(1, (ordinal % d.holders,)) for d in value}
        for ordinal, value in enumerate(demands)
    ]


def shares_by_bytes(demands: list[list[Demand]]) -> list[dict[int, Share]]:
    """Per value, per holder count, its :class:`Share` (the rule in the module's docstring).

    ``demands``: per value in the state's order, one :class:`Demand` per holder count of its
    chunks (none for a value that is not chunked).
    """
    stored: dict[int, int] = {}  # holder count -> bytes one set of holders stores
    for value in demands:
        for demand in value:
            stored[demand.holders] = stored.get(demand.holders, 0) + demand.nbytes
    targets = {r: max(1, total // (r * PIECE_OF_MEAN)) for r, total in stored.items()}
    loads = {r: np.zeros(r, dtype=np.int64) for r in stored}
    shares: list[dict[int, Share]] = []
    for value in demands:
        mine: dict[int, Share] = {}
        for d in value:
            r = d.holders
            if r == 1:
                mine[r] = Share(1, (0,))
                continue
            wanted = min(r, -(-d.nbytes // targets[r]), max(1, d.nbytes // SMALLEST_PIECE))
            pieces = piece_count(wanted, d.rows, d.nbytes)
            load = loads[r]
            order = least_loaded(load, pieces)
            if pieces == 1:
                load[order[0]] += d.nbytes
            else:
                row_bytes = d.nbytes // d.rows
                load[order] += np.array(split_rows(d.rows, pieces), dtype=np.int64) * row_bytes
            mine[r] = Share(pieces, tuple(int(t) for t in order))
        shares.append(mine)
    return shares


def least_loaded(load: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` least loaded turns, ties in turn order: ``argsort(load, stable)[:count]``.

    Without sorting all R turns for every value (R in the thousands): the ``count``-th load
    found by a partition, then only the turns at or below it sorted.
    """
    if count >= load.size:
        every: np.ndarray = np.argsort(load, kind="stable")
        return every
    if count == 1:
        return np.array([int(np.argmin(load))])  # the first of the least
    bound = np.partition(load, count - 1)[count - 1]
    below = np.flatnonzero(load < bound)
    ties = np.flatnonzero(load == bound)[: count - below.size]
    chosen = np.concatenate([below, ties])
    found: np.ndarray = chosen[np.lexsort((chosen, load[chosen]))]
    return found


@dataclass(frozen=True, slots=True)
class Pieces:
    """A geometry's chunks as one value's shares cut them: its items, chunk by chunk.

    Item ``i`` is piece ``piece[i]`` of chunk ``chunk[i]``; the items of chunk ``c`` are
    ``start[c]:start[c + 1]``, in row order. Uncut, the items are the chunks.
    """

    chunk: np.ndarray
    piece: np.ndarray
    offsets: np.ndarray
    """(items, ndim)."""
    sizes: np.ndarray
    start: np.ndarray
    """(chunks + 1,)."""


def cut_chunks(
    offsets: np.ndarray, sizes: np.ndarray, counts: np.ndarray, cuts: dict[int, int]
) -> Pieces:
    """The chunks cut into ``cuts[R]`` row pieces where R ranks hold them.

    ``offsets``, ``sizes``: (chunks, ndim); ``counts``: the holders of each chunk. Each chunk
    into :func:`piece_count` pieces.
    """
    chunks = offsets.shape[0]
    if not cuts:
        every = np.arange(chunks, dtype=np.int64)
        start = np.arange(chunks + 1, dtype=np.int64)
        return Pieces(every, np.zeros(chunks, dtype=np.int64), offsets, sizes, start)
    parent: list[int] = []
    piece: list[int] = []
    cut_offsets: list[np.ndarray] = []
    cut_sizes: list[np.ndarray] = []
    starts = [0]
    for c in range(chunks):
        rows = int(sizes[c, 0]) if sizes.shape[1] else 0
        elements = int(np.prod(sizes[c]))
        k = piece_count(cuts.get(int(counts[c]), 1), rows, elements)
        row = int(offsets[c, 0]) if k > 1 else 0
        for j, length in enumerate(split_rows(rows, k) if k > 1 else [rows]):
            here, size = offsets[c].copy(), sizes[c].copy()
            if k > 1:
                here[0], size[0] = row, length
                row += length
            parent.append(c)
            piece.append(j)
            cut_offsets.append(here)
            cut_sizes.append(size)
        starts.append(len(parent))
    return Pieces(
        np.array(parent, dtype=np.int64),
        np.array(piece, dtype=np.int64),
        np.stack(cut_offsets).astype(np.int64),
        np.stack(cut_sizes).astype(np.int64),
        np.array(starts, dtype=np.int64),
    )
