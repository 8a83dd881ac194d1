"""The planned step's gradient reductions on sizes: their buffers, collectives and order.

When backward has a group's gradients, the engine (``engine/reduce/`` in the core) packs them
into the reduce-scatter's send buffer and frees them, receives this rank's row (which becomes
the sharded gradient, or is cast into it), all-reduces the row over the replicas under HSDP
(with a compressing ``ReducePrecision``: a reduce-scatter and an all-gather of the sums), and
assigns the sharded gradients (``offload``). A reduction in flight keeps its buffers until it
finishes; the oldest finishes first. :class:`Reductions` does the same on the ledger for
``step_ops.LedgerOps``, which holds one and calls it when the schedule's driver says.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

from shardkit.core.layout import wire_row_bytes
from shardkit.tools.plan.ledger import Key, Ledger, Pool
from shardkit.tools.plan.offload import assign_sharded_grads
from shardkit.tools.plan.step_inputs import StepInputs
from shardkit.tools.records import Category

__all__ = ["RecordCollective", "Reductions"]


class RecordCollective(Protocol):
    """Records a collective of group ``g`` (``LedgerOps``'s record of the step's calls)."""

    def __call__(
        self, kind: str, g: int, size: int, input_bytes: int, sent: int, *, replicas: bool = False
    ) -> None:
        """``replicas``: over the HSDP replicas (else the shard axis)."""


class Reductions:
    """The reductions started and not finished, oldest first, on the step's ledger."""

    def __init__(self, inputs: StepInputs, ledger: Ledger, pool: Pool, record: RecordCollective):
        """No reduction in flight; ``record`` notes each collective a reduction issues."""
        self.inputs = inputs
        self.groups = inputs.groups
        self.world = self.groups[0].world
        self.gloo = inputs.options.backend == "gloo"
        self.offload = inputs.options.offload  # sharded gradients on the host
        self.ledger = ledger
        self.pool = pool
        self._record = record
        self.in_flight: deque[int] = deque()
        """The groups whose reduction is in flight, oldest first."""

    def start(self, g: int, grad_keys: list[Key]) -> None:
        """Allocate group ``g``'s reduction buffers (the gradients packed and freed), send it."""
        group = self.groups[g]
        layout = group.layout
        row, send = layout.reduce_scatter_output_bytes, layout.reduce_scatter_input_bytes
        label = f"reduce-scatter {group.fqn}"
        # The output becomes the sharded gradient: it counts as one from the start. In another
        # dtype it is cast into the gradient and stays a collective's output buffer.
        # Offloaded to a GPU's host, it is copied there: a collective's output meanwhile.
        becomes_grad = layout.reduce_dtype == group.grad_dtype and (self.gloo or not self.offload)
        category = Category.GRADIENTS if becomes_grad else Category.COMM_BUFFERS
        if self.world > 1:
            # The gradients are packed into the send buffer and freed before the output comes.
            self.pool.get(send, ("reduce_send", g), label)
            self._free_all(grad_keys)
            self.ledger.alloc(("reduce_out", g), category, row, label)
            wire = self._wire_bytes(g, row)  # a row in the reduction's messages
            self._record(
                "reduce_scatter", g, self.world, self.world * wire, (self.world - 1) * wire
            )
            if self.gloo and self.world > 2:
                self.pool.get((self.world - 1) * row, ("reduce_scatter_rows", g), label)
        else:
            self.ledger.alloc(("reduce_out", g), category, row, label)  # packed into directly
            self._free_all(grad_keys)
        self.in_flight.append(g)

    def finish_oldest(self) -> None:
        """Finish the oldest reduction; its buffers go before the next one allocates."""
        self._release(self._finish(self.in_flight.popleft()))

    @property
    def _compresses(self) -> bool:
        policy = self.inputs.options.reduce_precision
        return policy is not None and policy.compresses

    def _wire_bytes(self, g: int, row: int) -> int:
        """Bytes of a reduction's row of ``row`` bytes (in the reduce dtype) on the wire."""
        itemsize = self.groups[g].layout.reduce_dtype.itemsize
        return wire_row_bytes(self.inputs.options.reduce_precision, row // itemsize, itemsize)

    def _free_all(self, keys: list[Key]) -> None:
        for key in keys:
            self.ledger.free(key)

    def _finish(self, g: int) -> list[tuple[Key, int]]:
        """Finish a reduction; returns the buffers its record keeps alive (key, pool size)."""
        group = self.groups[g]
        row = group.layout.reduce_scatter_output_bytes
        held: list[tuple[Key, int]] = []
        if self.world > 1:
            if self.gloo and self.world > 2:
                # The received rows are summed into a temporary, then added to the output.
                self.ledger.alloc(("reduce_sum", g), Category.COMM_BUFFERS, row, "row sum")
                self.ledger.free(("reduce_sum", g))
                held.append((("reduce_scatter_rows", g), (self.world - 1) * row))
            held.append((("reduce_send", g), group.layout.reduce_scatter_input_bytes))
        replicas = self.inputs.replicas
        if replicas > 1 and self._compresses:
            # A compressed reduce-scatter over the replicas, then an all-gather of the sums.
            itemsize = group.layout.reduce_dtype.itemsize
            chunk = self._wire_bytes(g, math.ceil(row // itemsize / replicas) * itemsize)
            sent = (replicas - 1) * chunk
            self._record("reduce_scatter", g, replicas, replicas * chunk, sent, replicas=True)
            self._record("all_gather", g, replicas, chunk, sent, replicas=True)
        elif replicas > 1:
            self._record("all_reduce", g, replicas, row, 2 * row * (replicas - 1) // replicas)
        held += assign_sharded_grads(self.ledger, g, group, offload=self.offload, cpu=self.gloo)
        return held

    def _release(self, held: list[tuple[Key, int]]) -> None:
        for key, pool_size in held:
            if pool_size:
                self.pool.put(pool_size, key)
            else:
                self.ledger.free(key)
