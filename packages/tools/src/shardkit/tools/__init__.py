"""shardkit.tools: memory and communication profiling of any torch training program.

The tools live in three rooms, with the records they share (:mod:`shardkit.tools.records`,
:mod:`shardkit.tools.units`) at the top:

- :mod:`shardkit.tools.track`, what happened. Trackers are context managers that observe
  torch, so they work on shardkit, torch's ``fully_shard``, FSDP1, DDP and plain code alike:
  :class:`CommTracker` (every collective, c10d's and the functional ones of DTensor, with
  its kind, group, mesh axis, bytes, time, module and phase; per-step totals, per axis too,
  exposed vs overlapped communication), :class:`MemoryTracker` (live tensor
  memory by category, its timeline, the peak and the peak per module and phase) and
  :class:`Profiler` (both, sharing one view of modules and phases); :class:`OpCounter`
  (the operators a step dispatches: on a GPU, its kernel launches).
- :mod:`shardkit.tools.plan`, what will happen: :func:`plan` (and the ``shardkit-plan``
  command) predicts per-rank memory by category and the bytes of every collective of a step
  from a meta-device model; :func:`apply_plan` carries out a sharding plan (units,
  prefetch, activation checkpointing, offload, precision) with the calls a script would make.
- :mod:`shardkit.tools.report`, showing it: :func:`summarize` (terminal tables),
  :func:`write_report` (a folder with the summary, JSON, a Perfetto trace and PNG plots), and
  the ``shardkit-profile`` command.
"""

from shardkit.tools.__about__ import __version__
from shardkit.tools.plan.apply.apply import apply_plan
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.planner import plan
from shardkit.tools.plan.records import (
    CollectiveCall,
    CollectivePlan,
    GroupPlan,
    MemoryPlan,
    MemoryPoint,
    PlannedGroup,
)
from shardkit.tools.records import (
    AxisComm,
    Category,
    CollectiveRecord,
    CommSummary,
    MemoryReport,
    MemorySample,
    ModulePeak,
    Phase,
    PhaseSpan,
    RankReport,
    StepComm,
)
from shardkit.tools.report.folder import write_report
from shardkit.tools.report.json_io import load_merged_report, load_rank_reports, write_rank_report
from shardkit.tools.report.text import summarize
from shardkit.tools.track.comm import CommTracker
from shardkit.tools.track.memory import MemoryTracker
from shardkit.tools.track.ops import OpCounter
from shardkit.tools.track.profiler import Profiler
from shardkit.tools.track.scope import ModuleScope

__all__ = [
    "AxisComm",
    "Category",
    "CollectiveCall",
    "CollectivePlan",
    "CollectiveRecord",
    "CommSummary",
    "CommTracker",
    "GroupPlan",
    "MemoryPlan",
    "MemoryPoint",
    "MemoryReport",
    "MemorySample",
    "MemoryTracker",
    "ModulePeak",
    "ModuleScope",
    "OpCounter",
    "Phase",
    "PhaseSpan",
    "Plan",
    "PlanOptions",
    "PlannedGroup",
    "Profiler",
    "RankReport",
    "StepComm",
    "__version__",
    "apply_plan",
    "load_merged_report",
    "load_rank_reports",
    "plan",
    "summarize",
    "write_rank_report",
    "write_report",
]
