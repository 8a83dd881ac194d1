"""Which group a torch fully_shard collective serves: sizes first, then forward order."""

from __future__ import annotations

from shardkit.tools.records import CollectiveRecord, Phase, PhaseSpan
from shardkit.tools.track.comm_minimum import minimum_bytes
from shardkit.tools.track.fsdp_serves import FSDPGroup, attribute

# Two identical blocks (100 shard elements each at W=2) and a root of another size.
GROUPS = [
    FSDPGroup("b0", "pg", 100, shard_world=2, numel=200, trainable_numel=200, param_count=2),
    FSDPGroup("b1", "pg", 100, shard_world=2, numel=200, trainable_numel=200, param_count=2),
    FSDPGroup("", "pg", 30, shard_world=2, numel=59, trainable_numel=59, param_count=1),
]


def _record(kind: str, phase: Phase, t: float, shard_bytes: int, module: str) -> CollectiveRecord:
    total = shard_bytes * 2 if kind == "reduce_scatter" else shard_bytes
    return CollectiveRecord(
        kind=kind,
        op="c10d.x",
        group_size=2,
        group="pg",
        input_bytes=total,
        sent_bytes=shard_bytes,
        start_s=t,
        end_s=t + 0.01,
        wait_s=0.0,
        module=module,
        phase=phase,
        step=0,
    )


def test_backward_serves_the_reverse_of_forward_order() -> None:
    spans = [
        PhaseSpan(module=m, phase=Phase.FORWARD, start_s=t, end_s=t + 0.1, step=0)
        for m, t in (("", 0.0), ("b0", 0.1), ("b1", 0.2))
    ]
    fwd, bwd = Phase.FORWARD, Phase.BACKWARD
    records = [
        _record("all_gather", fwd, 0.05, 120, ""),  # fp32 root
        _record("all_gather", fwd, 0.15, 400, "b0"),
        _record("all_gather", fwd, 0.25, 400, "b1"),
        _record("all_gather", bwd, 0.60, 400, ""),  # b1's, issued under the root
        _record("reduce_scatter", bwd, 0.70, 400, "b1"),
        _record("all_gather", bwd, 0.72, 400, "b1"),  # b0's, prefetched
        _record("reduce_scatter", bwd, 0.80, 400, ""),  # b0's, after its hooks exited
        _record("reduce_scatter", bwd, 0.90, 120, ""),  # the root's, at the final callback
        _record("all_gather", bwd, 0.95, 7, ""),  # fits no group: left alone
        _record("all_reduce", bwd, 0.96, 8, ""),
    ]
    served = attribute(records, GROUPS, spans, forward_ends=[0.5])
    # A forward end inside a backward span (an activation-checkpointed block's recomputation)
    # ends no forward pass: the attribution is the same.
    recompute = PhaseSpan(module="b1", phase=Phase.BACKWARD, start_s=0.55, end_s=0.75, step=0)
    assert attribute(records, GROUPS, [*spans, recompute], forward_ends=[0.5, 0.65]) == served
    assert [r.serves for r in served] == ["", "b0", "b1", "b1", "b1", "b0", "b0", "", None, None]
    assert [r.module for r in served] == [r.module for r in records]  # the running module stays
    assert attribute(records, [], spans, [0.5]) == records
    # The minimum of that schedule, without the unfitting gather, is unpadded fp32 bytes: the
    # root's 59 elements gathered and reduced once, each block's 200 gathered twice, reduced once.
    fitting = [r for r in served if r.serves is not None]
    assert minimum_bytes(fitting, GROUPS) == 2 * (59 * 4 // 2) + 2 * 3 * (200 * 4 // 2)
    assert minimum_bytes(served, GROUPS) is None  # a gather that fits no group: unknown
