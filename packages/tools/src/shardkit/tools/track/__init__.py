"""What happened: trackers that observe a running torch program.

:class:`CommTracker` records every collective, :class:`MemoryTracker` live tensor memory by
category, and :class:`Profiler` runs both over one :class:`ModuleScope` (which module runs, in
which phase and step). They watch torch itself (operator dispatch, module hooks), so they work
on shardkit, torch's ``fully_shard``, FSDP1, DDP and plain code alike. What they record is the
shared vocabulary in :mod:`shardkit.tools.records`. :class:`LivePeak` keeps one figure, the
peak of live tensor bytes, and counts fake tensors too (``FakeTensorMode``: a step too large
to run here, measured by its storages' sizes). :class:`ExportWindow` marks a weight export
under the trackers and sums its collectives and memory (:class:`ExportMeasure`).
"""

from shardkit.tools.track.comm import CommTracker
from shardkit.tools.track.export_window import ExportMeasure, ExportWindow
from shardkit.tools.track.live_peak import LivePeak
from shardkit.tools.track.memory import MemoryTracker
from shardkit.tools.track.profiler import Profiler
from shardkit.tools.track.scope import ModuleScope

__all__ = [
    "CommTracker",
    "ExportMeasure",
    "ExportWindow",
    "LivePeak",
    "MemoryTracker",
    "ModuleScope",
    "Profiler",
]
