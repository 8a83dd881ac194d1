"""What the planner's step simulation is given: the inputs that ``step`` and ``step_ops`` share.

A module of its own so that ``step`` (which drives the simulation) and ``step_ops`` (the
operations it drives) both read it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.core.conditional_schedule import Anchoring
from shardkit.tools.plan.groups import GroupSpec
from shardkit.tools.plan.muon_step import MuonStep
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.tp_comm import TPSchedule
from shardkit.tools.plan.trace import MetaStepTrace

__all__ = ["StepInputs"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepInputs:
    """What the simulation needs."""

    groups: list[GroupSpec]
    """The FSDP groups, root last."""
    root: int | None
    """Index of the root module's group (None when the root holds no parameters)."""
    trace: MetaStepTrace
    """Event order and activations of the forward."""
    options: PlanOptions
    """Dtypes, optimizer, backend and rank."""
    replicas: int
    """HSDP replica groups (1 for plain FSDP)."""
    buffer_bytes: int
    """Module buffers (``model.buffers()``), resident for the whole step."""
    shard_rank: int
    """The planned rank's index on the shard axis."""
    hsdp: bool = False
    """Whether the data-parallel mesh is 2-D (its axes: dp_replicate, dp_shard; else dp)."""
    tp: TPSchedule | None = None
    """The tensor-parallel collectives, placed on the forward's segments (None: no TP)."""
    tp_degree: int = 1
    """Ranks of the tp axis."""
    prefetch: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] | None = None
    """Per group, the groups (indices) of its explicit forward and backward prefetch lists
    (``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``); None: none set."""
    anchoring: Anchoring[int] | None = None
    """The conditional groups (``PlanOptions.conditional``) with their anchors, which issue
    their collectives; None: none marked, the plain driver runs the step."""
    muon: MuonStep | None = None
    """Muon's step on the planned rank (``PlanOptions.optimizer="muon"``): its exchange's
    all-to-alls; None: another optimizer, or no matrices."""
