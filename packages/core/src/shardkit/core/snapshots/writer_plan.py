"""What one rank's snapshot writer will do, decided before it starts: one frozen value.

``MemorySnapshots`` decides it from the first state and the ranks' agreement: how many slots
this rank owns and how large their headers may grow, whether it replicates to a peer and holds
a source's replicas (``Replication``), how often a snapshot is replicated whole, and whether
its state lives on an accelerator and is staged there. ``SnapshotWriter`` takes the plan and
the two live objects it works with (the slot directory and the gradient log).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardkit.core.snapshots.checksum import checksum_count
from shardkit.core.snapshots.contents import JSONValue, Layout
from shardkit.core.snapshots.format import Header
from shardkit.core.snapshots.slots import Topology

__all__ = ["Replication", "WriterPlan", "header_capacity"]


@dataclass(frozen=True, slots=True)
class Replication:
    """Where this rank's snapshots go and whose it holds: ranks on other nodes."""

    peer: int  # receives this rank's snapshots
    source: int  # sends its snapshots here
    source_capacity: int  # the source's header capacity
    source_data_bytes: int  # and its data size
    source_log_capacity: int = 0  # and its log entries' (gradient_log), where it logs
    source_log_bytes: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class WriterPlan:
    """What one rank's writer will do: its slots, what it replicates, where its state lives."""

    topology: Topology
    """This rank among the run's ranks and nodes."""

    layout: Layout
    """Where each tensor of the state is in a slot's data bytes (the first state's layout)."""

    capacity: int
    """Room for the header of any snapshot of this state (``header_capacity``)."""

    slots: int
    """The own slots the snapshots rotate through (one more where a replicated step is
    pinned: its own copy stays until the next replicated step)."""

    replication: Replication | None = None
    """The peer and the source of this rank's replicas; None on one node (nothing sent)."""

    staging_on: torch.device | None = None
    """The accelerator the state lives on (``staging_device``), where it is staged; None for
    a state in host memory."""

    replica_slots: int = 0
    """Slots for the source's replicas; 0: as many as ``slots``."""

    replicate_every: int = 1
    """Replicate the snapshots of steps that are a multiple of it only; the newest
    replicated one stays in its own slot until the next. With a gradient log, the source's
    log entries go to ``replicate_every - 1`` slots, one for each step between."""

    def __post_init__(self) -> None:
        if self.slots < 1 or self.replica_slots < 0 or self.replicate_every < 1:
            raise ValueError(
                f"a snapshot writer needs at least one slot and replicate_every >= 1, got "
                f"slots={self.slots}, replica_slots={self.replica_slots}, "
                f"replicate_every={self.replicate_every}"
            )

    @property
    def replica_count(self) -> int:
        """How many replica slots of the source's this rank holds."""
        return self.replica_slots or self.slots


def header_capacity(topology: Topology, layout: Layout, values: dict[str, JSONValue]) -> int:
    """Room for any later header of this state: twice the first, and 4 KiB more."""
    widest = Header(
        topology.run_id,
        topology.world_size,
        topology.rank,
        2**62,
        layout,
        bytes(8 * checksum_count(layout.data_bytes)),
        values,
    )
    return 2 * len(widest.to_json()) + 4096
