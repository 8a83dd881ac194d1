"""shardkit.tools: memory and communication profiling of any torch training program.

Trackers (context managers; they observe torch, so they work on shardkit, torch's
``fully_shard``, FSDP1, DDP and plain code alike):

- :class:`CommTracker`: every collective with its kind, group, bytes, time, module and phase;
  per-step totals, exposed vs overlapped communication.
- :class:`MemoryTracker`: live tensor memory by category, its timeline, the peak and the
  peak per module and phase.
- :class:`Profiler`: both, sharing one view of modules and phases.

Planning before launch: :func:`plan` (and the ``shardkit-plan`` command) predicts per-rank
memory by category and the bytes of every collective of a step from a meta-device model.

Reports: :func:`summarize` (terminal tables), :func:`write_report` (a folder with the summary,
JSON, a Perfetto trace and PNG plots), and the ``shardkit-profile`` command.
"""

from shardkit.tools.__about__ import __version__
from shardkit.tools.comm_tracker import CommTracker
from shardkit.tools.memory_tracker import MemoryTracker
from shardkit.tools.plan_options import PlanOptions
from shardkit.tools.plan_records import (
    CollectiveCall,
    CollectivePlan,
    GroupPlan,
    MemoryPlan,
    MemoryPoint,
)
from shardkit.tools.planner import Plan, plan
from shardkit.tools.profiler import Profiler
from shardkit.tools.records import (
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
from shardkit.tools.report import write_report
from shardkit.tools.report_json import load_merged_report, load_rank_reports, write_rank_report
from shardkit.tools.report_text import summarize
from shardkit.tools.scope import ModuleScope

__all__ = [
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
    "Phase",
    "PhaseSpan",
    "Plan",
    "PlanOptions",
    "Profiler",
    "RankReport",
    "StepComm",
    "__version__",
    "load_merged_report",
    "load_rank_reports",
    "plan",
    "summarize",
    "write_rank_report",
    "write_report",
]
