"""A prototype of the owner layout, issue 83's other design, to measure beside the built one.

shardkit's Muon (``shardkit.core.optim``) keeps torch's contract for ``fully_shard``: each
parameter, its gradient and its momentum are ``Shard(0)`` row blocks, so the step sends every
matrix's rows to its owner and the update's rows back (two all-to-alls: the redistributing
design). The owner layout instead puts each matrix's reduced gradient whole on its owner inside
the reduce-scatter, orthogonalizes it there, and lets the all-gather that brings parameters
out bring the updated matrix: no bytes beyond AdamW's, and a parameter that is whole on one
rank and absent on the others, which no DTensor placement says (docs/guide/muon.md, "Bytes").

The engine has no such layout. This prototype runs it beside ``fully_shard``: the blocks'
matrices are ``ignored_params`` (their gradients come out of the backward whole and
unreduced on every rank), and after the backward a layout object does for them what an
engine would do per group: one reduce-scatter of every matrix's gradient, the optimizer on
this rank's part, one all-gather. Two layouts, the same collectives and sizes:

- :class:`OwnerLayout`: rank r's segment holds the matrices r owns, whole (owners balanced by
  Newton-Schulz cost as shardkit's Muon balances them, ``assign_owners``); segments padded to
  the largest. Its optimizer is torch's single-process ``torch.optim.Muon`` on the owned
  matrices, with momentum whole on the owner. The parameters are views of the all-gather's
  output, so nothing is copied out.
- :class:`RowLayout`: FSDP's layout (each matrix's dim-0 row blocks, rank-major), AdamW on the
  rows: the same two collectives with the optimizer that moves nothing, so that the two
  optimizers' parts differ by what the design adds and by nothing the harness does.

Not a layout users get: the matrices stay unsharded on every rank between steps (FSDP frees
them after use), so memory figures of these configurations are not an FSDP's, and the
collectives run once for all matrices after the backward instead of per block inside it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardkit.core.optim.newton_schulz import newton_schulz_cost
from shardkit.core.optim.owners import assign_owners
from shardkit.core.runtime.flat_collectives import all_gather_single, reduce_scatter_single

__all__ = ["OwnerLayout", "RowLayout"]


class _Layout:
    """Matrices as parts of a flat fp32 buffer of W equal segments (the all-gather's output),
    each rank's segment the reduce-scatter's output on it. Subclasses place the parts."""

    def __init__(self, matrices: Sequence[torch.Tensor], segment: int) -> None:
        self.matrices = list(matrices)
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.segment = segment
        self.send = torch.zeros(self.world * segment)  # padding stays zero from here on
        self.reduced = torch.zeros(segment)

    def zero_grad(self) -> None:
        for matrix in self.matrices:
            matrix.grad = None

    def _reduce(self) -> None:
        """Sum every rank's whole gradients into this rank's segment, then the mean."""
        reduce_scatter_single(self.reduced, self.send, op=dist.ReduceOp.SUM)
        self.reduced.div_(self.world)  # gloo's mean, as the engine takes it (sum, then divide)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank's reduce-scatter and all-gather put on the wire (ring: (W-1)/W of
        the buffer each), padding included."""
        return 2 * 4 * self.segment * (self.world - 1)


class OwnerLayout(_Layout):
    """Each matrix whole in its owner's segment; Muon on the owner."""

    def __init__(self, matrices: Sequence[torch.Tensor], lr: float) -> None:
        world = dist.get_world_size()
        shapes = [(m.size(0), m.size(1)) for m in matrices]
        self.owners = assign_owners(
            [newton_schulz_cost(s) for s in shapes], world, tall=[a > b for a, b in shapes]
        )
        used = [0] * world
        self.offsets: list[int] = []
        for matrix, owner in zip(matrices, self.owners, strict=True):
            self.offsets.append(used[owner])
            used[owner] += matrix.numel()
        super().__init__(matrices, max(used))
        self.padding = world * self.segment - sum(used)
        self.gathered = torch.zeros(world * self.segment)
        self.outgoing = torch.zeros(self.segment)
        owned: list[torch.Tensor] = []
        self._owned_at: list[tuple[torch.Tensor, int]] = []
        for matrix, owner, offset in zip(matrices, self.owners, self.offsets, strict=True):
            start = owner * self.segment + offset
            view = self.gathered[start : start + matrix.numel()].view_as(matrix)
            view.copy_(matrix.detach())
            matrix.data = view  # the model reads the all-gather's output in place
            if owner == self.rank:
                whole = view.detach()  # a leaf over the same storage: the optimizer's matrix
                owned.append(whole)
                self._owned_at.append((whole, offset))
        self.optimizer = torch.optim.Muon(owned, lr=lr) if owned else None

    def step(self) -> None:
        for matrix, owner, offset in zip(self.matrices, self.owners, self.offsets, strict=True):
            assert matrix.grad is not None
            start = owner * self.segment + offset
            self.send[start : start + matrix.numel()].copy_(matrix.grad.view(-1))
        self._reduce()
        for whole, offset in self._owned_at:
            whole.grad = self.reduced[offset : offset + whole.numel()].view_as(whole)
        if self.optimizer is not None:
            self.optimizer.step()
        mine = self.rank * self.segment
        self.outgoing.copy_(self.gathered[mine : mine + self.segment])
        all_gather_single(self.gathered, self.outgoing)


class RowLayout(_Layout):
    """FSDP's layout: rank r's segment holds row block r of every matrix; AdamW on the rows."""

    def __init__(self, matrices: Sequence[torch.Tensor]) -> None:
        world = dist.get_world_size()
        for matrix in matrices:
            if matrix.size(0) % world:
                shape = tuple(matrix.shape)
                raise ValueError(f"RowLayout needs rows that divide by {world}: {shape}")
        self.block_sizes = [m.numel() // world for m in matrices]
        self.offsets = [sum(self.block_sizes[:i]) for i in range(len(matrices))]
        super().__init__(matrices, sum(self.block_sizes))
        self.padding = 0
        self.gathered = torch.zeros(world * self.segment)
        self.rows = torch.zeros(self.segment)  # this rank's row blocks: the sharded parameters
        blocks: list[torch.Tensor] = []
        for matrix, size, offset in zip(matrices, self.block_sizes, self.offsets, strict=True):
            block = self.rows[offset : offset + size].view(-1, matrix.size(1))
            block.copy_(matrix.detach().view(world, size)[self.rank].view_as(block))
            blocks.append(block)
        self.blocks = blocks
        self.optimizer = torch.optim.AdamW(blocks, lr=1e-3, weight_decay=0.01)

    def _columns(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Matrix ``index``'s row blocks in ``flat``, one row of the result per rank."""
        offset, size = self.offsets[index], self.block_sizes[index]
        return flat.view(self.world, self.segment)[:, offset : offset + size]

    def step(self) -> None:
        for index, matrix in enumerate(self.matrices):
            assert matrix.grad is not None
            self._columns(self.send, index).copy_(matrix.grad.view(self.world, -1))
        self._reduce()
        for block, offset, size in zip(self.blocks, self.offsets, self.block_sizes, strict=True):
            block.grad = self.reduced[offset : offset + size].view_as(block)
        self.optimizer.step()
        all_gather_single(self.gathered, self.rows)
        with torch.no_grad():
            for index, matrix in enumerate(self.matrices):  # FSDP's copy-out, one per matrix
                matrix.view(self.world, -1).copy_(self._columns(self.gathered, index))
