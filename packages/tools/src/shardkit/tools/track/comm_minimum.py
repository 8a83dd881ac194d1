"""The theoretical minimum of a training step's bytes, computed from the tracked model.

When no minimum is given to the tracker, it is worked out from the FSDP groups of the model
(``fsdp_serves.fsdp_groups``: each group's parameter count Ψ and shard world W, from its
DTensor parameters) and the collectives a step ran, with the closed forms the planner uses
too (``shardkit.tools.theory``): a group's all-gather of Ψ elements of b bytes sends at least
Ψ·b·(W-1)/W, its reduce-scatter of the Ψ_trainable gradients as much of those. The element
size b of each collective is read from its bytes (it is the param dtype or the reduce dtype,
which mixed precision may make smaller than the parameters' own). So the minimum is that of
the schedule that ran (as many gathers per group as the engine made, no padding, no
alignment, a bandwidth-optimal algorithm), the same figure the planner compares its plan to.

An all-reduce (HSDP's across replicas) counts at its payload, which is a ring's minimum up to
the shard's padding. A step with any other collective (tensor parallelism's, a broadcast, a
point-to-point message), or a gather or reduction that fits no group, has no computed minimum.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardkit.tools import theory
from shardkit.tools.records import CollectiveRecord
from shardkit.tools.track.fsdp_serves import FSDPGroup

__all__ = ["ALIGNMENT_SLACK", "minimum_bytes"]

ALIGNMENT_SLACK = 16
"""Bytes an engine may pad each parameter's shard with in its gather buffer (shardkit aligns
each to 16 bytes); beyond that, a record does not fit a group."""


def minimum_bytes(records: Sequence[CollectiveRecord], groups: Sequence[FSDPGroup]) -> int | None:
    """The fewest bytes one rank could send for ``records`` (one step's), or None if unknown.

    Args:
        records: The collectives of one training step on this rank, with ``serves`` set
            (by the engine, or ``fsdp_serves.attribute``).
        groups: The model's FSDP groups.
    """
    by_fqn = {g.fqn: g for g in groups}
    if not any(r.kind in ("all_gather", "reduce_scatter") for r in records):
        return None  # no sharded data parallelism (DDP's all-reduces are their own minimum)
    total = 0
    for record in records:
        if record.kind == "all_reduce":
            total += record.sent_bytes
            continue
        if record.kind in ("send", "recv") and record.serves is None:
            continue  # no module's data: shardkit's step check (a few dozen bytes), not FSDP's
        group = by_fqn.get(record.serves) if record.serves is not None else None
        if group is None or record.kind not in ("all_gather", "reduce_scatter"):
            return None
        size = group.element_size(record, slack=ALIGNMENT_SLACK)
        if size is None:
            return None
        if record.kind == "all_gather":
            total += theory.all_gather_bytes(group.numel * size, group.shard_world, 1)
        else:
            total += theory.reduce_scatter_bytes(group.trainable_numel * size, group.shard_world, 1)
    return total
