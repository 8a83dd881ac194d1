"""What the planner-against-engine tests share: a step's collectives axis by axis, its events
as the engine publishes them, and what the memory tracker saw an optimizer step hold."""

from __future__ import annotations

from typing import Any

from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.records import Category, MemorySample, Phase, RankReport


def assert_comm_matches_plan(
    report: RankReport, predicted: Plan, rank: int
) -> dict[str | None, int]:
    """Every collective of the one tracked step, in issue order, with its kind, mesh axis and
    bytes, and the bytes sent per axis, as planned; returns the measured bytes per axis."""
    measured = [(c.kind, c.axis, c.input_bytes, c.sent_bytes) for c in report.collectives]
    # The step's collectives, then the step check's messages where the backward ends.
    calls = [*predicted.schedule, *predicted.step_check]
    planned = [(c.kind, c.axis, c.input_bytes, c.sent_bytes) for c in calls]
    assert measured == planned, f"rank {rank}"
    assert report.comm is not None
    (step,) = report.comm.steps
    by_axis = {a.axis: a.sent_bytes for a in step.by_axis}
    checked = dict(predicted.sent_bytes_by_axis)
    for c in predicted.step_check:
        checked[c.axis] = checked.get(c.axis, 0) + c.sent_bytes
    assert by_axis == checked, f"rank {rank}"
    assert step.sent_bytes == sum(checked.values())
    # The step check's bytes stand apart: what the step's collectives send is as planned.
    check_bytes = sum(c.sent_bytes for c in predicted.step_check)
    assert step.sent_bytes - check_bytes == predicted.sent_bytes_per_step
    return {
        a: b - sum(c.sent_bytes for c in predicted.step_check if c.axis == a)
        for a, b in by_axis.items()
    }


Event = tuple[str, str]
"""(what, group): an engine event as the plan lists them (``Plan.events``)."""


def event_recorder(events: list[Event]) -> Any:
    """A subscriber appending the engine's transitions and collectives to ``events``."""
    from shardkit.core import CollectiveEvent, StateTransitionEvent

    def record(event: object) -> None:
        if isinstance(event, StateTransitionEvent):
            events.append((event.what, event.module_fqn))
        elif isinstance(event, CollectiveEvent):
            events.append((event.kind, event.module_fqn))

    return record


def optimizer_memory(timeline: list[MemorySample]) -> tuple[int, int]:
    """(the most optimizer-state bytes, the optimizer phase's most comm + other bytes above
    what was live as it began) of a tracked timeline: what a plan's state and its step's
    transient are checked against.

    What the step adds, not what the backward left: the sample before the phase is the base
    (the 8M GPT at W=4 on the fake group: a 2 MiB buffer of the backward's collectives is
    still counted as live when Muon's step begins, and only within it is its free logged).
    """
    state = max(p.by_category[Category.OPTIMIZER_STATE] for p in timeline)
    first = next(i for i, p in enumerate(timeline) if p.phase is Phase.OPTIMIZER)
    base = timeline[max(first - 1, 0)]

    def comm_and_other(p: MemorySample) -> int:
        return p.by_category[Category.COMM_BUFFERS] + p.by_category[Category.OTHER]

    transient = max(comm_and_other(p) for p in timeline if p.phase is Phase.OPTIMIZER)
    return state, transient - comm_and_other(base)
