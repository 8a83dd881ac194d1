"""The check the planner-against-tracker tests share: a step's collectives, axis by axis."""

from __future__ import annotations

from shardkit.tools.plan.planner import Plan
from shardkit.tools.records import RankReport


def assert_comm_matches_plan(
    report: RankReport, predicted: Plan, rank: int
) -> dict[str | None, int]:
    """Every collective of the one tracked step, in issue order, with its kind, mesh axis and
    bytes, and the bytes sent per axis, as planned; returns the measured bytes per axis."""
    measured = [(c.kind, c.axis, c.input_bytes, c.sent_bytes) for c in report.collectives]
    planned = [(c.kind, c.axis, c.input_bytes, c.sent_bytes) for c in predicted.schedule]
    assert measured == planned, f"rank {rank}"
    assert report.comm is not None
    (step,) = report.comm.steps
    by_axis = {a.axis: a.sent_bytes for a in step.by_axis}
    assert by_axis == predicted.sent_bytes_by_axis, f"rank {rank}"
    assert step.sent_bytes == predicted.sent_bytes_per_step
    return by_axis
