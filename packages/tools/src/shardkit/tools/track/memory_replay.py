"""Replaying the storage log into live bytes by category: the timeline, the peak, module peaks.

A storage's category is its most specific hint; without one, a storage made during forward
that outlives that forward is an activation (saved for backward, or the output), and anything
else is "other" (temporaries, inputs, the loss). Replays run at step boundaries, when the
categories of the step's storages are settled.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from shardkit.tools.records import Category, MemorySample, ModulePeak, Phase
from shardkit.tools.track.storage_ledger import Entry, Event, StorageLedger

__all__ = ["Replay"]

_ZERO = dict.fromkeys(Category, 0)


class Replay:
    """Live bytes by category, advanced one logged event at a time."""

    def __init__(self, max_samples: int = 20_000) -> None:
        self.live = dict(_ZERO)
        self.timeline: list[MemorySample] = []
        self.peak: MemorySample | None = None
        self.module_peaks: dict[tuple[str, Phase], MemorySample] = {}
        self._max_samples = max_samples
        # key -> (category its live bytes are counted in, those bytes)
        self._counted: dict[int, tuple[Category, int]] = {}

    def category(self, entry: Entry, forward_ends: Sequence[float]) -> Category:
        """What ``entry`` is for, given every hint so far."""
        if entry.hint is not None:
            return entry.hint
        if entry.created_phase is Phase.FORWARD:
            end = bisect.bisect_left(forward_ends, entry.created_s)
            outlives = end == len(forward_ends) or (
                entry.freed_s is None or entry.freed_s > forward_ends[end]
            )
            if outlives:
                return Category.ACTIVATIONS
        return Category.OTHER

    def advance(self, ledger: StorageLedger, forward_ends: Sequence[float]) -> None:
        """Apply the events logged since the last call."""
        events = ledger.take_events()
        if events:
            self._recategorize(ledger, forward_ends, events[0])
        for event in events:
            entry = ledger.entries.get(event.key)
            if entry is None:
                continue
            category, counted = self._counted.get(event.key, (None, 0))
            if category is None:
                category = self.category(entry, forward_ends)
            self.live[category] += event.delta
            if counted + event.delta > 0:
                self._counted[event.key] = (category, counted + event.delta)
            else:
                self._counted.pop(event.key, None)
            self._sample(event)
        ledger.forget_freed()
        self._thin()

    def _recategorize(
        self, ledger: StorageLedger, forward_ends: Sequence[float], first: Event
    ) -> None:
        # Live bytes counted under a category learnt to be wrong since move to the right one.
        moved = False
        for key, (counted, nbytes) in list(self._counted.items()):
            entry = ledger.entries.get(key)
            if entry is None:
                continue
            now = self.category(entry, forward_ends)
            if now is not counted:
                self.live[counted] -= nbytes
                self.live[now] += nbytes
                self._counted[key] = (now, nbytes)
                moved = True
        if moved:
            self._sample(first)

    def _sample(self, event: Event) -> None:
        sample = MemorySample(
            t_s=event.t_s,
            by_category=dict(self.live),
            module=event.module,
            phase=event.phase,
            step=event.step,
        )
        total = sample.total
        if self.peak is None or total > self.peak.total:
            self.peak = sample
        slot = (event.module, event.phase)
        best = self.module_peaks.get(slot)
        if best is None or total > best.total:
            self.module_peaks[slot] = sample
        if self.timeline and self.timeline[-1].t_s == event.t_s:
            self.timeline[-1] = sample  # several changes at one instant: keep the last
        else:
            self.timeline.append(sample)

    def _thin(self) -> None:
        # Halve the resolution when too long, keeping the higher of each pair (peaks survive).
        while len(self.timeline) > self._max_samples:
            pairs = zip(self.timeline[::2], self.timeline[1::2], strict=False)
            thinned = [a if a.total >= b.total else b for a, b in pairs]
            if len(self.timeline) % 2:
                thinned.append(self.timeline[-1])
            self.timeline = thinned

    def module_peak_list(self) -> list[ModulePeak]:
        """Per (module, phase) peaks, highest first."""
        peaks = [
            ModulePeak(module=module, phase=phase, peak=sample)
            for (module, phase), sample in self.module_peaks.items()
        ]
        return sorted(peaks, key=lambda p: -p.peak.total)
