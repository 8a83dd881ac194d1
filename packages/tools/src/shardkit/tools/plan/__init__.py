"""What will happen: the planner, which predicts a sharded training step before it runs.

At the top, the memory model. :func:`plan` (``planner``) builds the model on the meta device
(``meta_build``), decides the FSDP groups as a per-block ``fully_shard`` would (``groups``),
takes every buffer size from the core's layout view (the arithmetic the engine builds its
buffers with), traces the step on the meta device (``trace``) and replays the engine's step
on a ledger of bytes (``step``, ``step_ops``) to predict per-rank memory by category and the
bytes of every collective (a :class:`Plan`, ``plan_record``); with a tensor-parallel plan, on
both axes (``tp_styles`` reads the plan, ``tp_comm`` prices DTensor's collectives). A
``ShardingPlan`` (``sharding_plan``) records the choices around ``fully_shard``; ``gpt`` and
``examples`` are the models that the ``shardkit-plan`` command (``cli``, ``tables``) accepts.

Five wings stand on it (each imports the memory model; only ``search`` imports ``apply``, and
only ``search`` and ``export`` import ``timing``):

- ``timing``: :func:`estimate_step_time` predicts the step's time on a :class:`Hardware`
  profile from the operators the trace counted (``op_costs``), replayed with the
  collectives; :func:`calibrate` measures this machine into a profile.
- ``apply``: :func:`apply_plan` carries a sharding plan out on a model, :func:`dump_plan` and
  :func:`load_plan` write and read it as JSON, :func:`parallelize_source` writes it as a
  ``parallelize(model, mesh)`` function to paste into a training script, and
  :func:`check_plan` runs one rank of its step on torch's fake process group before launch.
- ``search``: :func:`fit` (``shardkit-plan --fit``) searches the units,
  ``reshard_after_forward``, prefetching and recomputation for the fastest plan that fits a
  memory budget, predicting each with the memory model and ``timing`` (:class:`TraceCache`
  shares their meta-device traces), and checks and writes the chosen one with ``apply``.
- ``export``: :func:`export_cost` predicts a weight export's bytes, buckets, collectives,
  peak and time (``shardkit-plan --export-dtype``); ``tp_dims_of`` (``tp_styles``) gives it,
  and ``checkpoint``, the dims a TP plan shards.
- ``checkpoint``: a checkpoint save's bytes per rank, ``.metadata``, planning and write time,
  from the core's own ``SaveLayout`` (``shardkit-plan --checkpoint``).

Each wing with options of ``shardkit-plan`` adds them itself (``add_export_arguments``,
``add_checkpoint_arguments``), and ``cli`` calls it.
"""

from shardkit.tools.plan.apply.apply import apply_plan
from shardkit.tools.plan.apply.launch_check import PlanCheck, check_plan
from shardkit.tools.plan.apply.parallelize_source import parallelize_source
from shardkit.tools.plan.apply.plan_json import PlanFormatError, dump_plan, load_plan
from shardkit.tools.plan.export.axis_gathers import ExportTensor, export_tensors
from shardkit.tools.plan.export.cost import ExportCost, ExportSpec, RankCounts, export_cost
from shardkit.tools.plan.op_costs import OpCost, StepCosts
from shardkit.tools.plan.options import PlanOptions, options_for
from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.planner import plan
from shardkit.tools.plan.records import (
    CollectiveCall,
    CollectivePlan,
    GroupPlan,
    MemoryPlan,
    MemoryPoint,
    PlannedGroup,
    StepMark,
)
from shardkit.tools.plan.search.fit import Fit, fit
from shardkit.tools.plan.search.search import SearchResult, SearchSpace, search
from shardkit.tools.plan.sharding_plan import ROOT, ShardingPlan, Unit
from shardkit.tools.plan.timing.calibrate import calibrate
from shardkit.tools.plan.timing.hardware import H100, H200, Hardware, Link
from shardkit.tools.plan.timing.step_time import StepTime, estimate_step_time
from shardkit.tools.plan.tp_styles import tp_dims_of
from shardkit.tools.plan.trace_cache import TraceCache

__all__ = [
    "ROOT",
    "Fit",
    "SearchResult",
    "SearchSpace",
    "ShardingPlan",
    "TraceCache",
    "Unit",
    "fit",
    "options_for",
    "search",
    "H100",
    "H200",
    "CollectiveCall",
    "CollectivePlan",
    "GroupPlan",
    "Hardware",
    "Link",
    "MemoryPlan",
    "MemoryPoint",
    "OpCost",
    "Plan",
    "PlanCheck",
    "PlanFormatError",
    "PlanOptions",
    "PlannedGroup",
    "apply_plan",
    "check_plan",
    "dump_plan",
    "load_plan",
    "parallelize_source",
    "StepCosts",
    "StepMark",
    "StepTime",
    "calibrate",
    "estimate_step_time",
    "plan",
    "ExportCost",
    "ExportSpec",
    "ExportTensor",
    "RankCounts",
    "export_cost",
    "export_tensors",
    "tp_dims_of",
]
