"""``shardkit-plan --fit BUDGET``: the search, the chosen plan's check, and what to paste.

:func:`fit` runs the search (``search``) for a model built on the meta device, on a hardware
profile, and hands back the result with the chosen plan's predictions; :func:`format_fit`
writes what the command prints: the chosen plan with its predicted peak and step time and
where the time goes, the runners-up with why each lost, what would fit when nothing does,
the check on the fake process group when one ran, and the plan as a ``parallelize``
function to paste into a training script.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from shardkit.tools.plan.budget import format_bytes
from shardkit.tools.plan.candidates import model_shape
from shardkit.tools.plan.evaluator import PlannedChoice, planner_evaluator
from shardkit.tools.plan.hardware import Hardware
from shardkit.tools.plan.launch_check import PlanCheck
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.parallelize_source import parallelize_source
from shardkit.tools.plan.search import SearchResult, SearchSpace, search
from shardkit.tools.plan.sharding_plan import ShardingPlan
from shardkit.tools.plan.trace_cache import TraceCache

__all__ = ["Fit", "fit", "format_fit"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """A search's answer, with what the command prints beside it."""

    result: SearchResult
    hardware: Hardware
    world_size: int
    seconds: float
    """How long the search took."""
    chosen: PlannedChoice | None
    """The chosen plan's predictions (None when nothing fits)."""
    traces: int
    """Meta-device traces the search ran (the rest of its plans reused one)."""
    check: PlanCheck | None = None
    """The chosen plan run on the fake process group, when checked."""

    @property
    def plan(self) -> ShardingPlan | None:
        """The chosen sharding plan."""
        return self.result.best.plan if self.result.best is not None else None


def fit(
    model: nn.Module,
    *,
    world_size: int,
    budget_bytes: int,
    base: PlanOptions,
    hardware: Hardware,
    space: SearchSpace | None = None,
    progress: Callable[[str], None] | None = None,
) -> Fit:
    """Search for the fastest plan of ``model`` that fits ``budget_bytes`` on every rank.

    ``model`` is built on the meta device; ``base`` holds what the search does not choose
    (inputs, loss, optimizer, mesh, backend). See ``search.search`` for the space searched.
    """
    started = time.perf_counter()
    traces = TraceCache()
    record: dict[ShardingPlan, PlannedChoice] = {}
    evaluate = planner_evaluator(
        model, world_size=world_size, base=base, hardware=hardware, traces=traces, record=record
    )
    result = search(
        model_shape(model), evaluate, budget_bytes=budget_bytes, space=space, progress=progress
    )
    chosen = record[result.best.plan] if result.best is not None else None
    return Fit(
        result=result,
        hardware=hardware,
        world_size=world_size,
        seconds=time.perf_counter() - started,
        chosen=chosen,
        traces=len(traces),
    )


def format_fit(found: Fit, *, title: str, engine: str = "shardkit", runners_up: int = 5) -> str:
    """What ``shardkit-plan --fit`` prints."""
    result = found.result
    budget = format_bytes(result.budget_bytes)
    lines = [
        f"{title} on {found.world_size} ranks, budget {budget} per rank, step time on "
        f"{found.hardware.name}",
        f"searched {len(result.evaluated)} plans ({found.traces} traced on the meta device) "
        f"in {found.seconds:.1f} s",
        "",
    ]
    best = result.best
    if best is None or found.chosen is None:
        closest = result.closest
        lines += [
            f"nothing fits in {budget}: the smallest peak found is "
            f"{format_bytes(closest.estimate.peak_bytes)} ({closest.choice.describe()});",
            "it would fit with that budget, more ranks (the sharded state shrinks as 1/W), "
            "offload (--allow-offload) or a smaller batch",
        ]
        return "\n".join(lines) + "\n"
    time_ = found.chosen.time
    lines += [
        f"chosen: {best.choice.describe()}",
        f"  peak {format_bytes(best.estimate.peak_bytes)} of {budget}, step "
        f"{time_.total_s * 1e3:.1f} ms: compute {time_.compute_s * 1e3:.1f} ms (recomputation "
        f"{time_.recompute_s * 1e3:.1f}), exposed communication "
        f"{time_.exposed_communication_s * 1e3:.1f} ms, optimizer "
        f"{time_.optimizer_s * 1e3:.1f} ms",
    ]
    losers = result.runners_up(runners_up)
    if losers:
        lines.append("runners-up:")
        lines += [f"  {entry.choice.describe()}: {why}" for entry, why in losers]
    if found.check is not None:
        lines += ["", *found.check.summary().splitlines()]
    plan = found.plan
    assert plan is not None
    lines += [
        "",
        f"# the plan as code ({engine}'s fully_shard):",
        parallelize_source(plan, engine=engine),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"
