"""Per-step communication totals from collective records."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from shardkit.tools.records import AxisComm, CollectiveRecord, CommSummary, StepComm
from shardkit.tools.track.scope import ModuleScope

__all__ = ["busy_time", "by_axis", "summarize", "total_wire_bytes"]


def busy_time(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def total_wire_bytes(records: Sequence[CollectiveRecord]) -> int | None:
    """The records' wire bytes summed; None if one of them does not know its own."""
    wires = [r.wire_bytes for r in records]
    return None if any(w is None for w in wires) else sum(w for w in wires if w is not None)


def by_axis(records: Sequence[CollectiveRecord]) -> list[AxisComm]:
    """Totals per mesh axis: named axes in alphabetical order, then the unknown one (None)."""
    rows: dict[str | None, list[CollectiveRecord]] = defaultdict(list)
    for record in records:
        rows[record.axis].append(record)
    order = sorted(rows, key=lambda axis: (axis is None, axis or ""))
    return [
        AxisComm(
            axis=axis,
            collectives=len(rows[axis]),
            sent_bytes=sum(r.sent_bytes for r in rows[axis]),
            comm_s=busy_time([(r.start_s, r.end_s) for r in rows[axis]]),
            exposed_s=sum(r.wait_s for r in rows[axis]),
        )
        for axis in order
    ]


def summarize(
    records: Sequence[CollectiveRecord], scope: ModuleScope, theoretical_min_bytes: int | None
) -> CommSummary:
    """One StepComm per training step that ran collectives.

    Only completed steps (those ended by an optimizer step) are reported when there are any;
    otherwise the one partial stretch is.
    """
    by_step: dict[int, list[CollectiveRecord]] = defaultdict(list)
    for record in records:
        by_step[record.step].append(record)
    complete = [s for s in by_step if s < scope.step]
    steps = []
    for step in sorted(complete or by_step):
        rows = by_step[step]
        begin = scope.step_ends[step - 1] if step > 0 else min(r.start_s for r in rows)
        end = scope.step_ends[step] if step < len(scope.step_ends) else max(r.end_s for r in rows)
        kinds: dict[str, int] = defaultdict(int)
        for r in rows:
            kinds[r.kind] += r.sent_bytes
        steps.append(
            StepComm(
                step=step,
                collectives=len(rows),
                sent_bytes=sum(r.sent_bytes for r in rows),
                comm_s=busy_time([(r.start_s, r.end_s) for r in rows]),
                exposed_s=sum(r.wait_s for r in rows),
                step_s=end - begin,
                sent_bytes_by_kind=dict(kinds),
                by_axis=by_axis(rows),
                wire_bytes=total_wire_bytes(rows),
            )
        )
    return CommSummary(steps=steps, theoretical_min_bytes=theoretical_min_bytes)
