"""The :class:`Plan` record (what :func:`~shardkit.tools.plan.planner.plan` returns), as JSON too.

A plan says what one rank holds and sends in a training step: its groups, its collectives in
issue order and summed up, its memory over the step, and the closed-form minima beside them.
``Plan.to_dict`` writes it as JSON (what ``shardkit-plan --json`` prints), the memory timeline
left out. The planned options go with it (:func:`options_json`): dtypes and enums as strings,
functions by ``module:qualname``, units as their modules and policy; callables that only feed
the trace (inputs, loss, TP plan) are left out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.core import ReducePrecision
from shardkit.tools.plan.muon_step import MuonStep
from shardkit.tools.plan.op_costs import StepCosts
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.records import (
    CollectiveCall,
    CollectivePlan,
    MemoryPlan,
    MemoryPoint,
    PlannedGroup,
    StepMark,
)

__all__ = ["Plan", "options_json"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What one rank holds and sends in a training step.

    See :func:`~shardkit.tools.plan.planner.plan`.
    """

    world_size: int
    """Ranks in all."""
    shard_size: int
    """Ranks each parameter is sharded over (the data-parallel size, or the HSDP shard axis)."""
    replicas: int
    """HSDP replica groups (1 for FSDP)."""
    tp_degree: int
    """Ranks of the tensor-parallel axis (1: no tensor parallelism)."""
    options: PlanOptions
    """What was planned."""
    param_count: int
    """Parameters of the model (unique elements, before any sharding)."""
    trainable_count: int
    """Of which trainable."""
    groups: tuple[PlannedGroup, ...]
    """One per ``fully_shard`` call, root last."""
    schedule: tuple[CollectiveCall, ...]
    """Every collective of one step, in the engine's issue order."""
    step_check: tuple[CollectiveCall, ...]
    """The engine's step check where the backward ends, after the schedule: a few dozen bytes
    per peer, which a tracker sees (``sent_bytes_per_step`` leaves them out)."""
    collectives: tuple[CollectivePlan, ...]
    """The schedule summed up per (kind, group)."""
    sent_bytes_per_step: int
    """Bytes one rank sends per step, on every axis."""
    sent_bytes_by_axis: dict[str, int]
    """The same by mesh axis ('dp', or 'dp_shard' and 'dp_replicate'; 'tp')."""
    comm_seconds: float
    """``sent_bytes_per_step`` at ``options.bandwidth_gbps``, with no overlap."""
    memory: MemoryPlan
    """Per-rank memory over the step."""
    theory_sent_bytes: int
    """The data-parallel schedule's bytes without padding or alignment (``theory``)."""
    theory_memory_bytes: int
    """Sharded parameters, gradients and optimizer state without padding: 16Ψ/W for fp32
    AdamW (``theory.zero_memory_per_rank`` at stage 3)."""
    activations_traced: bool
    """Whether activations were measured by a meta forward (False: not counted)."""
    events: tuple[tuple[str, str], ...] = ()
    """The engine's events of the step, in order, as (what, group): the transitions of
    ``shardkit.core.StateTransitionEvent`` and the data-parallel collectives (see
    ``shardkit.core.schedule``, which the plan and the engine both run)."""
    marks: tuple[StepMark, ...] = ()
    """Compute segments, collectives and waits in program order (``step_time`` replays them)."""
    costs: StepCosts | None = None
    """The step's operators by segment and module (None: no ``inputs``, nothing traced)."""
    muon: MuonStep | None = None
    """``optimizer="muon"``: the planned rank's Newton-Schulz share and exchange (None
    otherwise, and with tensor parallelism, which the plan does not place Muon on yet)."""

    @property
    def host_bytes(self) -> int:
        """The most host memory the step holds (0 without CPU offload).

        Offloaded: sharded parameters, gradients and optimizer state, and the optimizer's
        step; ``memory.peak`` is the device's alone.
        """
        return self.memory.host_peak

    @property
    def sent_over_theory(self) -> float | None:
        """Planned data-parallel bytes over their minimum (1.0 is optimal; None: none sent).

        Tensor parallelism's bytes are what its plan asks for, with no minimum: left out.
        """
        if not self.theory_sent_bytes:
            return None
        dp_bytes = self.sent_bytes_per_step - self.sent_bytes_by_axis.get("tp", 0)
        return dp_bytes / self.theory_sent_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (dtypes and enums as strings; the memory timeline left out)."""
        return {
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "replicas": self.replicas,
            "tp_degree": self.tp_degree,
            "options": options_json(self.options),
            "param_count": self.param_count,
            "trainable_count": self.trainable_count,
            "groups": [_fields(g) for g in self.groups],
            "schedule": [{**_fields(c), "phase": c.phase.value} for c in self.schedule],
            "collectives": [
                {**_fields(c), "sent_bytes_per_step": c.sent_bytes_per_step}
                for c in self.collectives
            ],
            "sent_bytes_per_step": self.sent_bytes_per_step,
            "sent_bytes_by_axis": self.sent_bytes_by_axis,
            "comm_seconds": self.comm_seconds,
            "theory_sent_bytes": self.theory_sent_bytes,
            "theory_memory_bytes": self.theory_memory_bytes,
            "activations_traced": self.activations_traced,
            "memory": {
                "peak": _point(self.memory.peak),
                "host_peak": self.memory.host_peak,
                "allocated_peak": self.memory.allocated_peak,
                "reserved_peak": self.memory.reserved_peak,
                "category_max": {c.value: n for c, n in self.memory.category_max.items()},
            },
        }


def options_json(options: PlanOptions) -> dict[str, Any]:
    """``options`` as a JSON-ready dict."""
    units = options.units
    return {
        "reshard_after_forward": options.reshard_after_forward,
        "units": None
        if units is None
        else [
            {"modules": list(u.modules), "reshard_after_forward": u.reshard_after_forward}
            for u in units
        ],
        "prefetch": options.prefetch,
        "checkpoint": [list(c) for c in options.checkpoint],
        "offload": options.offload,
        "param_dtype": _dtype_name(options.param_dtype),
        "param_dtype_override_fn": _function_name(options.param_dtype_override_fn),
        "reduce_dtype": _dtype_name(options.reduce_dtype),
        "reduce_precision": _precision(options.reduce_precision),
        "optimizer": options.optimizer,
        "bandwidth_gbps": options.bandwidth_gbps,
        "backend": options.backend,
        "rank": options.rank,
    }


def _precision(policy: ReducePrecision | None) -> dict[str, Any] | None:
    """A ``ReducePrecision`` as JSON: its fields, the wire dtype by name."""
    if policy is None:
        return None
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    wire = fields["wire_dtype"]
    fields["wire_dtype"] = _dtype_name(wire) if isinstance(wire, torch.dtype) else wire
    return fields


def _function_name(fn: Any) -> str | None:
    """``module:qualname`` of a function option, as the CLI names one (None if unset)."""
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _fields(record: Any) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__slots__}


def _point(point: MemoryPoint) -> dict[str, Any]:
    return {
        "label": point.label,
        "module": point.module,
        "phase": point.phase.value,
        "total": point.total,
        "by_category": {c.value: n for c, n in point.by_category.items()},
    }
