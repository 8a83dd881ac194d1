"""Copying gathered rows out to where they belong, in a number of copies that W does not change.

An all-gather gives W rows (one per rank) laid out alike: each row holds every parameter's
slot, one after another. A parameter's full tensor wants the same slot of every row, rank
after rank. Seen as one (W, N) byte matrix, that is a split along dim 1: column range k of
the matrix is parameter k's (W, n_k) block. So one ``torch.split_with_sizes_copy(rows, sizes,
dim=1, out=targets)`` copies a whole group, whatever W and the number of parameters, where
copying row by row would launch W copies per group (and W times the views). The rows arrive
as blocks of consecutive ranks (see ``RowBlock``); each block is one such split.

Nothing here knows parameters or process groups. See [Note: flat group buffers].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardkit.core.runtime.protocol import RowBlock

__all__ = ["GatherSplit", "SplitTarget"]


@dataclass(frozen=True, slots=True)
class SplitTarget:
    """Where one slot of every gathered row goes."""

    offset: int
    """Byte offset of the slot in a row."""
    rows: torch.Tensor
    """(W, nbytes) uint8 with a contiguous last dim: row r receives rank r's slot."""


class GatherSplit:
    """The split of gathered rows into their targets: one copy per block of rows.

    Bytes of a row that no target takes (alignment gaps, the row's tail) go to scratch that
    nobody reads: a split must cover the whole row. The ``out=`` views for each block shape
    are made at its first copy and kept, so a step makes no new views either: the targets
    must keep their storage objects (their memory may be freed and re-allocated in between,
    see [Note: unsharded storage]).
    """

    def __init__(self, row_nbytes: int, targets: Sequence[SplitTarget], world: int) -> None:
        """Plan the split of rows of ``row_nbytes`` bytes into ``targets`` (any order).

        Raises:
            ValueError: targets that overlap, leave the row, or have not ``world`` rows.
        """
        self.world = world
        self.row_nbytes = row_nbytes
        sizes: list[int] = []
        outs: list[torch.Tensor] = []
        cursor = 0
        for target in sorted(targets, key=lambda t: t.offset):
            rows, nbytes = target.rows, target.rows.shape[-1]
            if rows.dim() != 2 or rows.shape[0] != world or rows.dtype != torch.uint8:
                raise ValueError(f"a split target must be ({world}, n) uint8: {rows.shape}")
            if target.offset < cursor:
                raise ValueError(f"split targets overlap at byte {target.offset}")
            if target.offset > cursor:
                sizes.append(target.offset - cursor)
                outs.append(_scratch(world, target.offset - cursor, rows.device))
            sizes.append(nbytes)
            outs.append(rows)
            cursor = target.offset + nbytes
        if cursor > row_nbytes:
            raise ValueError(f"split targets end at byte {cursor} of a {row_nbytes}-byte row")
        if cursor < row_nbytes:
            device = outs[0].device if outs else torch.device("cpu")
            sizes.append(row_nbytes - cursor)
            outs.append(_scratch(world, row_nbytes - cursor, device))
        self.sizes = tuple(sizes)
        self._outs = tuple(outs)
        self._by_block: dict[tuple[int, int], list[torch.Tensor]] = {(0, world): list(outs)}

    def copy(self, blocks: Sequence[RowBlock]) -> None:
        """Copy every block of rows (uint8, ``row_nbytes`` wide) into the targets."""
        for block in blocks:
            count = block.rows.shape[0]
            outs = self._by_block.get((block.first, count))
            if outs is None:
                outs = [out[block.first : block.first + count] for out in self._outs]
                self._by_block[(block.first, count)] = outs
            torch.split_with_sizes_copy(block.rows, self.sizes, dim=1, out=outs)


def _scratch(world: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """(W, nbytes) bytes that a split writes and nobody reads (its own tensor: contiguous)."""
    return torch.empty(world, nbytes, dtype=torch.uint8, device=device)
