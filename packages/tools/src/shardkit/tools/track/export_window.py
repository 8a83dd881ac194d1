"""An export's measured cost: the collectives and memory of a stretch of code, from the trackers.

A weight export (``shardkit.core.export``) runs its gathers on process groups of its own,
between training steps, so the trackers record them like any collective: c10d ``gather``
(``to="first"``) or ``all_gather`` (``to="all"``), and the small all-gathers of its agreement
and end. What they cannot tell is which of a step's collectives were the export's. An
:class:`ExportWindow` marks the stretch: entered and left around ``exporter.export(...)``
under a running :class:`~shardkit.tools.track.comm.CommTracker` and/or
:class:`~shardkit.tools.track.memory.MemoryTracker`, it picks their records issued inside it
and sums them (:class:`ExportMeasure`), to set beside the planner's prediction
(:func:`shardkit.tools.plan.export.cost.export_cost`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from shardkit.tools.records import CollectiveRecord
from shardkit.tools.track.comm import CommTracker
from shardkit.tools.track.memory import MemoryTracker
from shardkit.tools.track.tracking import Tracker

__all__ = ["ExportMeasure", "ExportWindow"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportMeasure:
    """What the trackers saw of one export on this rank."""

    seconds: float
    """From entering the window to leaving it."""
    collectives: int
    """Collectives issued inside it (0 without a CommTracker); on gloo each point-to-point
    message of a bucket's gather is one."""
    sent_bytes: int
    """Their payload from this rank (see ``CollectiveRecord.sent_bytes``)."""
    gather_bytes: int
    """Of which the buckets' gathers: every collective but the small ones (``control_bytes``)."""
    control_bytes: int
    """Of which the small all-gathers over the whole mesh (agreement, end, changes)."""
    sent_bytes_by_kind: dict[str, int] = field(default_factory=dict)
    peak_bytes: int | None = None
    """The most live tensor memory inside the window (None without a MemoryTracker)."""
    peak_above_start_bytes: int | None = None
    """Of which above what was live when the window was entered: the export's own peak."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


class ExportWindow(Tracker):
    """Marks a stretch of code (an export) for the running trackers.

    Use inside the trackers' ``with``::

        with CommTracker() as comm, MemoryTracker() as memory:
            with ExportWindow(comm=comm, memory=memory) as window:
                exporter.export(receiver)
        measured = window.measure()

    Args:
        comm: the running communication tracker, or None.
        memory: the running memory tracker, or None.
        control_max_bytes: input bytes at or under which an all-gather counts as the
            export's control traffic (its agreement, end and changes counted are a few int64
            each; a bucket's part is far larger).
    """

    def __init__(
        self,
        *,
        comm: CommTracker | None = None,
        memory: MemoryTracker | None = None,
        control_max_bytes: int = 1024,
    ) -> None:
        self.comm = comm
        self.memory = memory
        self.control_max_bytes = control_max_bytes
        self._start: float | None = None
        self._end: float | None = None
        self._records_before = 0

    def start(self) -> ExportWindow:
        """Open the window (``with`` does it): later records of the trackers fall in it."""
        if self.comm is not None:
            self._records_before = len(self.comm.records)
        self._start = time.perf_counter()
        return self

    def stop(self) -> None:
        """Close the window."""
        self._end = time.perf_counter()

    def records(self) -> list[CollectiveRecord]:
        """The collectives issued inside the window, in issue order."""
        if self.comm is None:
            return []
        return self.comm.records[self._records_before :][: self._count_inside()]

    def _count_inside(self) -> int:
        assert self.comm is not None and self._end is not None
        end = self._end - self.comm.scope.t0
        after = self.comm.records[self._records_before :]
        return sum(1 for r in after if r.start_s <= end)

    def measure(self) -> ExportMeasure:
        """The window's collectives and memory, summed.

        Raises:
            RuntimeError: the window was not entered and left.
        """
        if self._start is None or self._end is None:
            raise RuntimeError("ExportWindow.measure(): enter and leave the window first")
        records = self.records()
        control = [
            r for r in records if r.kind == "all_gather" and r.input_bytes <= self.control_max_bytes
        ]
        by_kind: dict[str, int] = {}
        for record in records:
            by_kind[record.kind] = by_kind.get(record.kind, 0) + record.sent_bytes
        peak, above = self._peak()
        sent = sum(r.sent_bytes for r in records)
        control_bytes = sum(r.sent_bytes for r in control)
        return ExportMeasure(
            seconds=self._end - self._start,
            collectives=len(records),
            sent_bytes=sent,
            gather_bytes=sent - control_bytes,
            control_bytes=control_bytes,
            sent_bytes_by_kind=by_kind,
            peak_bytes=peak,
            peak_above_start_bytes=above,
        )

    def _peak(self) -> tuple[int | None, int | None]:
        """The memory timeline's most inside the window, and that above its start."""
        if self.memory is None:
            return None, None
        assert self._start is not None and self._end is not None
        start = self._start - self.memory.scope.t0
        end = self._end - self.memory.scope.t0
        timeline = self.memory.report().timeline
        before = [s.total for s in timeline if s.t_s < start]
        inside = [s.total for s in timeline if start <= s.t_s <= end]
        base = before[-1] if before else 0
        if not inside:
            return base, 0
        return max(inside), max(0, max(inside) - base)
