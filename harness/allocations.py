"""The CPU allocator's peak as torch's profiler saw it: exact bytes, never a reading of RSS.

With ``profile(activities=[ProfilerActivity.CPU], profile_memory=True)`` the profiler records
every allocation and free; replaying them in time order gives the running total of the bytes
allocated since profiling began, as CUDA's allocator counts ``max_memory_allocated``. A free of
memory allocated before profiling is not counted (its allocation was never seen).
"""

from __future__ import annotations

from torch._C._profiler import _EventType
from torch.profiler import profile

__all__ = ["allocated_left", "allocated_peak"]


def allocated_left(prof: profile) -> int:
    """Bytes allocated while profiling and still allocated at its end (what the work kept)."""
    live: dict[int, int] = {}
    for _, ptr, size in sorted(_allocations(prof)[0]):
        if size > 0:
            live[ptr] = size
        else:
            live.pop(ptr, None)
    return sum(live.values())


def _allocations(
    prof: profile, within: str | None = None
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Every CPU allocation (size > 0) and free (size < 0), and the ``within`` ranges.

    Allocations as (time, pointer, size); ranges as (start, end), in the tree's walk order.
    """
    events: list[tuple[int, int, int]] = []
    spans: list[tuple[int, int]] = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation:
            fields = event.typed[1]
            if fields.device.type == "cpu":
                events.append((event.start_time_ns, fields.ptr, fields.alloc_size))
        elif within is not None and event.name == within:
            spans.append((event.start_time_ns, event.end_time_ns))
    return events, spans


def allocated_peak(prof: profile, within: str | None = None) -> int:
    """The peak of the running sum of CPU allocations and frees.

    ``within``: the name of a ``record_function`` range; only the total inside it counts
    toward the peak (allocations before it still count toward the total).
    """
    events, spans = _allocations(prof, within)
    start, end = spans[-1] if spans else (None, None)  # the last walked, as before
    if within is not None:
        assert start is not None and end is not None, f"no {within!r} range in the profile"
    live: dict[int, int] = {}
    total = peak = 0
    for at, ptr, size in sorted(events):
        if size > 0:
            live[ptr] = size
            total += size
        else:
            total -= live.pop(ptr, 0)
        if start is None or (end is not None and start <= at <= end):
            peak = max(peak, total)
    return peak
