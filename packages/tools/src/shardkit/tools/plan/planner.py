"""The planner: per-rank memory and communication of a sharded training step, before running it.

``plan(model, world_size=64)`` takes a model built on the meta device (or a factory for one),
decides the FSDP groups as a per-block ``fully_shard`` would, asks shardkit.core's layout view
(``shardkit.core.layout.group_layout``) for every buffer size from the parameter shapes, and
simulates one steady-state training step of the engine:

- the collectives it issues (kind, group, bytes per call, calls per step) and the bytes a rank
  sends per step, exactly as the engine reports them in ``shardkit.core.CollectiveEvent``;
- the communication time at a given bandwidth (bytes / bandwidth, nothing overlapped);
- per-rank memory by category over the step: its peak, the breakdown at the peak and each
  category's maximum (see ``step`` for what is modelled and what is approximate);
- the theoretical minimum of both (``theory``), for comparison.

Nothing is allocated: parameters stay on the meta device, and activations, when example
inputs are given, come from a forward, the loss and backward run on the meta device
(``trace``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardkit.tools.plan import theory
from shardkit.tools.plan.groups import GroupSpec, build_groups
from shardkit.tools.plan.options import ModelSource, PlanOptions
from shardkit.tools.plan.records import (
    CollectiveCall,
    CollectivePlan,
    GroupPlan,
    MemoryPlan,
    MemoryPoint,
)
from shardkit.tools.plan.step import StepInputs, simulate_step
from shardkit.tools.plan.trace import assumed_trace, trace_step

__all__ = ["Plan", "plan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What one rank holds and sends in a training step; see :func:`plan`."""

    world_size: int
    """Ranks in all."""
    shard_size: int
    """Ranks each parameter is sharded over (the world size, or the HSDP shard axis)."""
    replicas: int
    """HSDP replica groups (1 for FSDP)."""
    options: PlanOptions
    """What was planned."""
    param_count: int
    """Parameters of the model (unique elements)."""
    trainable_count: int
    """Of which trainable."""
    groups: tuple[GroupPlan, ...]
    """One per ``fully_shard`` call, root last."""
    schedule: tuple[CollectiveCall, ...]
    """Every collective of one step, in the engine's issue order."""
    collectives: tuple[CollectivePlan, ...]
    """The schedule summed up per (kind, group)."""
    sent_bytes_per_step: int
    """Bytes one rank sends per step."""
    comm_seconds: float
    """``sent_bytes_per_step`` at ``options.bandwidth_gbps``, with no overlap."""
    memory: MemoryPlan
    """Per-rank memory over the step."""
    theory_sent_bytes: int
    """The same schedule's bytes without padding or alignment (``theory``)."""
    theory_memory_bytes: int
    """Sharded parameters, gradients and optimizer state without padding: 16Ψ/W for fp32
    AdamW (``theory.zero_memory_per_rank`` at stage 3)."""
    activations_traced: bool
    """Whether activations were measured by a meta forward (False: not counted)."""

    @property
    def sent_over_theory(self) -> float | None:
        """Planned bytes over the theoretical minimum (1.0 is optimal; None if nothing sent)."""
        return self.sent_bytes_per_step / self.theory_sent_bytes if self.theory_sent_bytes else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (dtypes and enums as strings; the memory timeline left out)."""
        options = self.options
        return {
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "replicas": self.replicas,
            "options": {
                "reshard_after_forward": options.reshard_after_forward,
                "param_dtype": _dtype_name(options.param_dtype),
                "reduce_dtype": _dtype_name(options.reduce_dtype),
                "optimizer": options.optimizer,
                "bandwidth_gbps": options.bandwidth_gbps,
                "backend": options.backend,
                "rank": options.rank,
            },
            "param_count": self.param_count,
            "trainable_count": self.trainable_count,
            "groups": [_fields(g) for g in self.groups],
            "schedule": [{**_fields(c), "phase": c.phase.value} for c in self.schedule],
            "collectives": [
                {**_fields(c), "sent_bytes_per_step": c.sent_bytes_per_step}
                for c in self.collectives
            ],
            "sent_bytes_per_step": self.sent_bytes_per_step,
            "comm_seconds": self.comm_seconds,
            "theory_sent_bytes": self.theory_sent_bytes,
            "theory_memory_bytes": self.theory_memory_bytes,
            "activations_traced": self.activations_traced,
            "memory": {
                "peak": _point(self.memory.peak),
                "category_max": {c.value: n for c, n in self.memory.category_max.items()},
            },
        }


def plan(model: ModelSource, *, world_size: int, options: PlanOptions | None = None) -> Plan:
    """Plan per-rank memory and communication of FSDP training, allocating nothing.

    Args:
        model: An ``nn.Module`` on the meta device, or a callable returning one.
        world_size: Ranks in all (replicas x shard for HSDP).
        options: How it is sharded and trained; defaults to ``PlanOptions()`` (fp32, AdamW,
            per-block wrap, the root keeping its parameters after forward).

    Returns:
        The plan.

    Raises:
        TypeError: ``model`` is not a module nor returns one; an option has the wrong type.
        ValueError: bad world size, mesh shape or rank; a parameter not on the meta device,
            0-dim or shared by two groups; a model with no parameters.
    """
    options = options if options is not None else PlanOptions()
    module = _resolve(model)
    replicas, shard = _mesh(world_size, options)
    groups = build_groups(module, options, shard, replicas)
    if not groups:
        raise ValueError(f"shardkit.tools.plan: {type(module).__name__} has no parameters")
    if options.inputs is not None:
        trace = trace_step(module, groups, options)
    else:
        trace = assumed_trace(module, groups)
    root = next((i for i, g in enumerate(groups) if g.module is module), None)
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    step = simulate_step(
        StepInputs(
            groups=groups,
            root=root,
            trace=trace,
            options=options,
            replicas=replicas,
            buffer_bytes=buffers,
        )
    )
    sent = sum(c.sent_bytes for c in step.schedule)
    logger.debug(
        "planned %s on %d ranks: %d groups, %d collectives, peak %d bytes",
        type(module).__name__,
        world_size,
        len(groups),
        len(step.schedule),
        step.memory.peak.total,
    )
    return Plan(
        world_size=world_size,
        shard_size=shard,
        replicas=replicas,
        options=options,
        param_count=sum(g.param_count for g in groups),
        trainable_count=sum(p.numel for g in groups for p in g.trainable),
        groups=tuple(
            _group_plan(g, raf) for g, raf in zip(groups, step.reshard_after_forward, strict=True)
        ),
        schedule=step.schedule,
        collectives=_summarise(step.schedule),
        sent_bytes_per_step=sent,
        comm_seconds=theory.comm_seconds(sent, options.bandwidth_gbps),
        memory=step.memory,
        theory_sent_bytes=_theory_bytes(groups, step.reshard_after_forward, replicas),
        theory_memory_bytes=_theory_memory(groups, options),
        activations_traced=trace.traced,
    )


def _resolve(model: ModelSource) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    if not callable(model):
        raise TypeError(
            f"shardkit.tools.plan: model must be an nn.Module or a callable returning one, "
            f"got {type(model).__name__}"
        )
    built = model()
    if not isinstance(built, nn.Module):
        name = getattr(model, "__qualname__", repr(model))
        raise TypeError(
            f"shardkit.tools.plan: the model factory {name} returned {type(built).__name__}, "
            "not an nn.Module"
        )
    return built


def _mesh(world_size: int, options: PlanOptions) -> tuple[int, int]:
    """(replicas, shard) of the data-parallel mesh, validated against the world size."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"shardkit.tools.plan: world_size must be a positive int: {world_size!r}")
    replicas, shard = options.mesh_shape or (1, world_size)
    if replicas * shard != world_size:
        raise ValueError(
            f"shardkit.tools.plan: mesh_shape {options.mesh_shape} has {replicas * shard} "
            f"ranks, not the world size {world_size}"
        )
    if options.rank >= world_size:
        raise ValueError(
            f"shardkit.tools.plan: rank {options.rank} is outside the world size {world_size}"
        )
    return replicas, shard


def _group_plan(group: GroupSpec, reshard_after_forward: bool) -> GroupPlan:
    return GroupPlan(
        fqn=group.fqn,
        param_count=group.param_count,
        trainable_count=sum(p.numel for p in group.trainable),
        sharded_bytes=group.layout.sharded_bytes,
        unsharded_bytes=group.layout.unsharded_bytes,
        gather_input_bytes=group.layout.all_gather_input_bytes,
        reduce_output_bytes=group.layout.reduce_scatter_output_bytes,
        reshard_after_forward=reshard_after_forward,
    )


def _summarise(schedule: tuple[CollectiveCall, ...]) -> tuple[CollectivePlan, ...]:
    """Count the calls per (kind, group, sizes), in order of first appearance."""
    counts: dict[tuple[str, str, int, int, int], int] = {}
    for c in schedule:
        key = (c.kind, c.group, c.group_size, c.input_bytes, c.sent_bytes)
        counts[key] = counts.get(key, 0) + 1
    return tuple(
        CollectivePlan(
            kind=kind, group=group, group_size=size, input_bytes=inp, sent_bytes=sent, calls=n
        )
        for (kind, group, size, inp, sent), n in counts.items()
    )


def _theory_bytes(groups: list[GroupSpec], reshards: tuple[bool, ...], replicas: int) -> int:
    """The schedule's bytes with no padding or alignment: the formulas of ``theory``."""
    total = 0
    for group, reshard in zip(groups, reshards, strict=True):
        world = group.world
        # Counted in bytes (bytes_per_element=1) so that groups mixing dtypes stay exact.
        gathered = sum(p.numel * p.comm_dtype.itemsize for p in group.params)
        reduced = sum(p.numel for p in group.trainable) * group.layout.reduce_dtype.itemsize
        total += (2 if reshard else 1) * theory.all_gather_bytes(gathered, world, 1)
        if reduced:
            total += theory.reduce_scatter_bytes(reduced, world, 1)
            total += theory.all_reduce_bytes(reduced // world, replicas, 1)
    return total


def _theory_memory(groups: list[GroupSpec], options: PlanOptions) -> int:
    """Stage-3 ZeRO model state per rank: parameters, gradients and optimizer state / W."""
    total = 0
    for group in groups:
        for p in group.params:
            size = p.dtype.itemsize
            trained = p.requires_grad
            total += theory.zero_memory_per_rank(
                p.numel,
                p.shard_world,
                stage=3,
                param_bytes=size,
                grad_bytes=size if trained else 0,
                optimizer_bytes=options.num_states * size if trained else 0,
            )
    return total


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
