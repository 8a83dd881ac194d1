"""The search's judge: a sharding plan's predicted peak and step time, from the two models.

:func:`planner_evaluator` binds a model (built once, on the meta device), a world size, the
options the search does not choose (inputs, loss, optimizer, backend) and a hardware profile,
and returns the ``Evaluate`` function the search calls for each plan: the planner
(``plan()`` with ``options_for``) for the peak, the step-time model (``estimate_step_time``)
for the time. Plans share one :class:`TraceCache`, so a plan that differs from an earlier one
only in what the step does with its groups costs a replay, not a trace.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from shardkit.tools.plan.options import PlanOptions, options_for
from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.planner import plan
from shardkit.tools.plan.search.search import Estimate, Evaluate
from shardkit.tools.plan.sharding_plan import ShardingPlan
from shardkit.tools.plan.timing.hardware import Hardware
from shardkit.tools.plan.timing.step_time import StepTime, estimate_step_time
from shardkit.tools.plan.trace_cache import TraceCache

__all__ = ["PlannedChoice", "estimate_of", "planner_evaluator"]


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedChoice:
    """A plan's two predictions, kept for the report of the chosen plan."""

    plan: Plan
    time: StepTime


def estimate_of(planned: PlannedChoice, *, reserved: bool | None = None) -> Estimate:
    """The search's view of a plan: device peak, step time and the time's parts.

    The peak is the CUDA caching allocator's reserved bytes for a plan on CUDA
    (``PlanOptions.on_cuda``; ``reserved`` says otherwise where given), with the live bytes
    beside it; a CPU plan's is the live bytes.
    Offloaded bytes are the host's, not counted against the device's budget.
    """
    time = planned.time
    memory = planned.plan.memory
    reserved = planned.plan.options.on_cuda if reserved is None else reserved
    return Estimate(
        peak_bytes=memory.reserved_peak if reserved else memory.peak.total,
        live_bytes=memory.peak.total if reserved else None,
        seconds=time.total_s,
        parts={
            "compute": time.compute_s - time.recompute_s,
            "recomputation": time.recompute_s,
            "exposed communication": time.exposed_communication_s,
            "optimizer": time.optimizer_s,
        },
    )


def planner_evaluator(
    model: nn.Module,
    *,
    world_size: int,
    base: PlanOptions,
    hardware: Hardware,
    traces: TraceCache | None = None,
    record: dict[ShardingPlan, PlannedChoice] | None = None,
    reserved: bool | None = None,
) -> Evaluate:
    """The ``Evaluate`` of ``search`` for ``model`` on ``world_size`` ranks.

    Args:
        model: built on the meta device (once: the search plans it many times).
        world_size: ranks in all.
        base: what the search leaves as it is: inputs (needed: activations and operators
            come from them), loss, optimizer, HSDP mesh, backend. Its rank is the one
            planned: rank 0 holds the largest shards when dimensions do not divide evenly.
        hardware: the profile step times are predicted on.
        traces: shared by every plan (a fresh one by default).
        record: where each plan's predictions are kept, when given (the report of the chosen
            plan prints its breakdown from there).
        reserved: whether a plan's peak is what the CUDA caching allocator reserves (True)
            or its live bytes (False); None: reserved for a plan on CUDA (NCCL).

    Raises:
        ValueError: ``base`` has no inputs, or a tensor-parallel plan (the search does not
            choose around tensor parallelism yet).
    """
    if base.inputs is None:
        raise ValueError(
            "search: the options need inputs: activations and the step's operators come from "
            "a forward and backward on the meta device"
        )
    if base.tp_plan is not None:
        raise ValueError("search: tensor-parallel plans are not searched; plan them one by one")
    cache = traces if traces is not None else TraceCache()

    def evaluate(sharding: ShardingPlan) -> Estimate:
        predicted = plan(
            model, world_size=world_size, options=options_for(sharding, base), traces=cache
        )
        planned = PlannedChoice(predicted, estimate_step_time(predicted, hardware))
        if record is not None:
            record[sharding] = planned
        return estimate_of(planned, reserved=reserved)

    return evaluate
