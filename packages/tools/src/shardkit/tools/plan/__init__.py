"""What will happen: the planner, which predicts a sharded training step before it runs.

:func:`plan` builds the model on the meta device, decides the FSDP groups as a per-block
``fully_shard`` would, takes every buffer size from the core's layout view (the arithmetic
the engine builds its buffers with) and replays the engine's step to predict per-rank memory
by category and the bytes of every collective; with a tensor-parallel plan, on both axes
(``tp_styles`` reads the plan, ``tp_comm`` prices DTensor's collectives). ``theory`` holds the
closed-form minima it compares with, ``gpt`` and ``examples`` the models that the
``shardkit-plan`` command (``cli``) accepts. :func:`estimate_step_time` predicts the step's
time on a :class:`Hardware` profile (``hardware``; ``calibrate`` measures this machine) from
the operators the meta-device trace counted (``op_costs``), replayed with the collectives
(``step_time``).

A ``ShardingPlan`` (``sharding_plan``) records the choices around ``fully_shard``:
:func:`apply_plan` carries one out on a model, ``plan_json`` (:func:`dump_plan`,
:func:`load_plan`) writes and reads it as JSON, and :func:`parallelize_source` writes it as a
``parallelize(model, mesh)`` function to paste into a training script. :func:`check_plan`
(``launch_check``) runs one rank of a plan's step on torch's fake process group before launch
and measures it against the prediction. :func:`fit` (``shardkit-plan --fit``) searches the
units, ``reshard_after_forward``, prefetching and recomputation for the fastest plan that fits
a memory budget (``candidates`` builds the plans, ``search`` compares them, ``evaluator``
predicts each with the two models, ``trace_cache`` shares their meta-device traces).
"""

from shardkit.tools.plan.apply import apply_plan
from shardkit.tools.plan.calibrate import calibrate
from shardkit.tools.plan.fit import Fit, fit
from shardkit.tools.plan.hardware import H100, H200, Hardware, Link
from shardkit.tools.plan.launch_check import PlanCheck, check_plan
from shardkit.tools.plan.op_costs import OpCost, StepCosts
from shardkit.tools.plan.options import PlanOptions, options_for
from shardkit.tools.plan.parallelize_source import parallelize_source
from shardkit.tools.plan.plan_json import PlanFormatError, dump_plan, load_plan
from shardkit.tools.plan.planner import Plan, plan
from shardkit.tools.plan.records import (
    CollectiveCall,
    CollectivePlan,
    GroupPlan,
    MemoryPlan,
    MemoryPoint,
    PlannedGroup,
    StepMark,
)
from shardkit.tools.plan.search import SearchResult, SearchSpace, search
from shardkit.tools.plan.sharding_plan import ROOT, ShardingPlan, Unit
from shardkit.tools.plan.step_time import StepTime, estimate_step_time
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
]
