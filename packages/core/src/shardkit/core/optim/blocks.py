"""A matrix's blocks: the rectangles its ranks hold, and the matrix as the step sees it.

Pure data, no process group consulted: ``matrices.py`` finds them from a parameter's mesh and
placements, and the planner builds them from a layout's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Block", "MatrixPlacement"]


@dataclass(frozen=True, slots=True)
class Block:
    """A rectangle of a matrix: rows ``row0`` to ``row1``, columns ``col0`` to ``col1``."""

    row0: int
    row1: int
    col0: int
    col1: int

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns)."""
        return (self.row1 - self.row0, self.col1 - self.col0)

    @property
    def empty(self) -> bool:
        """Whether it holds no element (a rank with none of the matrix)."""
        return self.row1 <= self.row0 or self.col1 <= self.col0

    def of(self, whole: torch.Tensor) -> torch.Tensor:
        """This block of a whole matrix (a view)."""
        if self.col0 == 0 and self.col1 == whole.size(1):  # rows: one narrow, not two slices
            return whole.narrow(0, self.row0, self.row1 - self.row0)
        return whole[self.row0 : self.row1, self.col0 : self.col1]


@dataclass(frozen=True, slots=True)
class MatrixPlacement:
    """One matrix (a 2-D parameter, or one expert of a stack) as the step sees it."""

    name: str
    """The parameter's name, for errors (its FQN where the optimizer was given names); an
    expert's has its index: ``layers.0.mlp.experts.down_proj[3]``."""
    shape: tuple[int, int]
    """The whole matrix's (m, n)."""
    group: dist.ProcessGroup | None
    """Every rank of the parameter's mesh; None where this rank holds the matrix whole alone."""
    blocks: tuple[Block, ...] = ()
    """With a group: each group rank's block (empty where it holds none of the matrix)."""
    replicas: tuple[tuple[int, ...], ...] = ()
    """With a group: each group rank's coordinates on the mesh axes that replicate the
    parameter. Two ranks with the same ones are one copy of the whole matrix (HSDP's replica)."""
    expert: int | None = None
    """Where this rank's block sits in its local tensor's first dim (a stack); None for a 2-D
    parameter, and where this rank holds none of the expert."""
    assumed: bool = False
    """Whether its replicas on some axis were given by the user's word (``replicated_over``),
    not by its placements: the step checks them once before it trusts them."""

    @property
    def tall(self) -> bool:
        """More rows than columns: Newton-Schulz runs on its transpose (``assign_owners``)."""
        return self.shape[0] > self.shape[1]

    def whole_on(self) -> tuple[int, ...]:
        """The group ranks that hold the whole matrix (its owner there moves no rows in)."""
        whole = Block(0, self.shape[0], 0, self.shape[1])
        return tuple(r for r, b in enumerate(self.blocks) if b == whole)

    def senders(self, owner: int) -> tuple[int, ...]:
        """The group ranks that send ``owner`` their block: one copy of each distinct block.

        A block the owner holds comes from itself; another from the holder in the owner's own
        replica, so each replica gathers from itself; else from its first holder.
        """
        chosen: dict[Block, int] = {}
        for rank, block in enumerate(self.blocks):
            if block.empty:
                continue
            best = chosen.get(block)
            if best is None or self._nearer(rank, best, owner):
                chosen[block] = rank
        return tuple(sorted(chosen.values()))

    def _nearer(self, rank: int, best: int, owner: int) -> bool:
        if best == owner:
            return False
        if rank == owner:
            return True
        return self.replicas[rank] == self.replicas[owner] != self.replicas[best]
