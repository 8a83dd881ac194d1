"""A Chrome trace (the JSON event format that Perfetto and chrome://tracing load) of a run.

One process per rank (pid = rank, named "rank N"), and in it these threads:

- ``steps``: one slice per training step, from its first recorded event to its last;
- ``compute``: the phase spans ("forward: blocks.0"), nested as the modules nest;
- ``communication``: one slice per collective, from issue to completion, with its kind, bytes,
  group, module and phase as args, and a nested "exposed wait" slice at its end when the
  training thread was blocked on it;
- counters: live memory by category (MiB), and the total, from the memory timeline.

Timestamps are microseconds on each rank's own clock (seconds since its tracker started), so
ranks line up only as well as their trackers started together.

Trace viewers draw slices on one thread as a stack, so slices that overlap without nesting
(prefetched collectives, for one) go to extra threads ("communication 2", ...) rather than
being drawn wrongly.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.tools.records import Category, CollectiveRecord, PhaseSpan, RankReport, aligned
from shardkit.tools.report.text import module_label
from shardkit.tools.units import MIB

__all__ = ["build_trace", "write_trace"]

_STEPS_TID = 0
_COMPUTE_TID = 1
_COMM_TID = 1000
"""Thread ids of each kind's first lane; compute lanes never reach the communication ones."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Slice:
    """One complete ("X") event before it is given a thread."""

    name: str
    cat: str
    start_us: float
    end_us: float
    args: dict[str, Any]
    wait_us: float = 0.0
    """The exposed wait at the end of a collective, drawn as a nested slice."""


def build_trace(reports: Sequence[RankReport]) -> dict[str, Any]:
    """The Chrome trace of a run, as a JSON-ready dict.

    Args:
        reports: One report per rank.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.
        Ranks are lined up on the wall clock where their reports say when they started.
    """
    events: list[dict[str, Any]] = []
    for report in sorted(aligned(reports), key=lambda r: r.rank):
        pid = report.rank
        events += [
            _meta(pid, 0, "process_name", {"name": f"rank {pid}"}),
            _meta(pid, 0, "process_sort_index", {"sort_index": pid}),
        ]
        events += _place(pid, _step_slices(report), _STEPS_TID, "steps", nest=False)
        compute = [_span_slice(s) for s in report.spans]
        events += _place(pid, compute, _COMPUTE_TID, "compute", nest=True)
        comm = [_collective_slice(c) for c in report.collectives]
        events += _place(pid, comm, _COMM_TID, "communication", nest=False)
        events += _memory_counters(report)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "shardkit-profile",
            "clock": "microseconds since each rank's tracker started",
        },
    }


def write_trace(path: str | os.PathLike[str], reports: Sequence[RankReport]) -> Path:
    """Writes :func:`build_trace` as ``path`` (``trace.json``); creates the parent folder."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(build_trace(reports), separators=(",", ":")), encoding="utf-8")
    return out


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)  # nanosecond resolution is all a perf_counter offers


def _meta(pid: int, tid: int, kind: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": args}


def _span_slice(span: PhaseSpan) -> _Slice:
    return _Slice(
        name=f"{span.phase.value}: {module_label(span.module, span.phase)}",
        cat=span.phase.value,
        start_us=_us(span.start_s),
        end_us=_us(span.end_s),
        args={"module": span.module, "phase": span.phase.value, "step": span.step},
    )


def _collective_slice(c: CollectiveRecord) -> _Slice:
    return _Slice(
        name=f"{c.kind}: {module_label(_for(c), c.phase)}",
        cat="communication",
        start_us=_us(c.start_s),
        end_us=_us(c.end_s),
        args={
            "kind": c.kind,
            "op": c.op,
            "bytes": c.sent_bytes,
            "wire_bytes": c.wire_bytes,
            "input_bytes": c.input_bytes,
            "group": c.group,
            "group_size": c.group_size,
            "axis": c.axis,
            "module": c.module,
            "serves": c.serves,
            "phase": c.phase.value,
            "step": c.step,
            "exposed_us": _us(c.wait_s),
        },
        wait_us=_us(c.wait_s),
    )


def _step_slices(report: RankReport) -> list[_Slice]:
    bounds: dict[int, list[float]] = defaultdict(lambda: [float("inf"), float("-inf")])
    items: list[PhaseSpan | CollectiveRecord] = [*report.spans, *report.collectives]
    for item in items:
        lo_hi = bounds[item.step]
        lo_hi[0], lo_hi[1] = min(lo_hi[0], item.start_s), max(lo_hi[1], item.end_s)
    return [
        _Slice(
            name=f"step {step}",
            cat="step",
            start_us=_us(lo),
            end_us=_us(hi),
            args={"step": step},
        )
        for step, (lo, hi) in sorted(bounds.items())
    ]


def _assign_lanes(intervals: Sequence[tuple[float, float]], *, nest: bool) -> list[int]:
    """The lane of each interval, so that a lane's intervals never partly overlap.

    Greedy in start order: an interval goes to the first lane where it starts after everything
    open has ended, or (with ``nest``) where it fits inside the innermost open interval.
    """
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1]))
    open_ends: list[list[float]] = []  # per lane, the ends of its open intervals, a stack
    lanes = [0] * len(intervals)
    for i in order:
        start, end = intervals[i]
        for lane, stack in enumerate(open_ends):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or (nest and end <= stack[-1]):
                stack.append(end)
                lanes[i] = lane
                break
        else:
            open_ends.append([end])
            lanes[i] = len(open_ends) - 1
    return lanes


def _place(
    pid: int, slices: Sequence[_Slice], base_tid: int, label: str, *, nest: bool
) -> list[dict[str, Any]]:
    """The slices' events, spread over as few threads (lanes) as keeps them drawable."""
    lanes = _assign_lanes([(s.start_us, max(s.start_us, s.end_us)) for s in slices], nest=nest)
    events: list[dict[str, Any]] = []
    for lane in sorted(set(lanes)):
        tid = base_tid + lane
        name = label if lane == 0 else f"{label} {lane + 1}"
        events += [_meta(pid, tid, "thread_name", {"name": name})]
        events += [_meta(pid, tid, "thread_sort_index", {"sort_index": tid})]
    for s, lane in zip(slices, lanes, strict=True):
        tid = base_tid + lane
        dur = round(max(0.0, s.end_us - s.start_us), 3)
        events.append(_complete(pid, tid, s.name, s.cat, s.start_us, dur, s.args))
        if s.wait_us > 0:
            # Blocked from (at latest) the wait's length before completion until completion:
            # the tail of the collective, so the nested slice stays inside its parent.
            wait = min(s.wait_us, dur)
            args = {"exposed_us": s.wait_us, "module": s.args.get("module", "")}
            wait_start = round(s.start_us + dur - wait, 3)
            events.append(_complete(pid, tid, "exposed wait", "exposed", wait_start, wait, args))
    return events


def _complete(
    pid: int, tid: int, name: str, cat: str, ts: float, dur: float, args: dict[str, Any]
) -> dict[str, Any]:
    return {
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "name": name,
        "cat": cat,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def _memory_counters(report: RankReport) -> list[dict[str, Any]]:
    if report.memory is None:
        return []
    timeline = report.memory.timeline
    present = [c for c in Category if any(s.by_category.get(c, 0) for s in timeline)]
    events: list[dict[str, Any]] = []
    for sample in timeline:
        ts = _us(sample.t_s)
        by_category = {c.value: round(sample.by_category.get(c, 0) / MIB, 3) for c in present}
        # Every sample names every category, so a stacked counter view never carries a stale
        # value over from an earlier sample.
        events.append(
            {
                "ph": "C",
                "pid": report.rank,
                "tid": 0,
                "name": "memory [MiB]",
                "ts": ts,
                "args": by_category,
            }
        )
        total = {"total": round(sample.total / MIB, 3)}
        events.append(
            {
                "ph": "C",
                "pid": report.rank,
                "tid": 0,
                "name": "memory total [MiB]",
                "ts": ts,
                "args": total,
            }
        )
    return events


def _for(c: CollectiveRecord) -> str:
    """The module a collective is for: the one it serves where known, else the one running."""
    return c.serves if c.serves is not None else c.module
