"""The planner: per-rank memory and communication of a sharded training step, before running it.

``plan(model, world_size=64)`` takes a model built on the meta device (or a factory for one),
decides the FSDP groups as a per-block ``fully_shard`` would (or as a ``ShardingPlan``'s units
say: ``options_for``), asks shardkit.core's layout view
(``shardkit.core.layout.group_layout``) for every buffer size from the parameter shapes, and
simulates one steady-state training step of the engine:

- the collectives it issues (kind, group, bytes per call, calls per step) and the bytes a rank
  sends per step, exactly as the engine reports them in ``shardkit.core.CollectiveEvent``;
- with a tensor-parallel plan on a (dp, tp) mesh, the engine's collectives over the TP-local
  shards (the layout is asked with TP-local shapes: ``tp_styles``) and DTensor's own on the tp
  axis in forward and backward, with their bytes (``tp_comm``), each call naming its axis;
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

from torch import nn

from shardkit.tools.plan import theory
from shardkit.tools.plan.groups import GroupSpec, build_groups
from shardkit.tools.plan.meta_build import build_on_meta
from shardkit.tools.plan.options import ModelSource, PlanOptions
from shardkit.tools.plan.options_json import options_json
from shardkit.tools.plan.recompute import check_checkpoint
from shardkit.tools.plan.records import (
    CollectiveCall,
    CollectivePlan,
    MemoryPlan,
    MemoryPoint,
    PlannedGroup,
)
from shardkit.tools.plan.sharding_plan import prefetch_lists
from shardkit.tools.plan.step import simulate_step
from shardkit.tools.plan.step_inputs import StepInputs
from shardkit.tools.plan.tp_comm import TPTracer
from shardkit.tools.plan.tp_styles import (
    check_shardable,
    param_placements,
    resolve_plan,
    tp_local_shape,
)
from shardkit.tools.plan.trace import assumed_trace, trace_step

__all__ = ["Plan", "plan"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What one rank holds and sends in a training step; see :func:`plan`."""

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
                "category_max": {c.value: n for c, n in self.memory.category_max.items()},
            },
        }


def plan(model: ModelSource, *, world_size: int, options: PlanOptions | None = None) -> Plan:
    """Plan per-rank memory and communication of FSDP training, allocating nothing.

    Args:
        model: An ``nn.Module`` on the meta device, or a callable returning one (called
            inside ``torch.device("meta")``, so it may build on the default device); with
            ``options.tp_plan``, the model before ``parallelize_module``.
        world_size: Ranks in all (replicas x shard for HSDP, times ``options.tp_degree``).
        options: How it is sharded and trained; defaults to ``PlanOptions()`` (fp32, AdamW,
            per-block wrap, the root keeping its parameters after forward).

    Returns:
        The plan.

    Raises:
        TypeError: ``model`` is not a module nor returns one; an option has the wrong type.
        ValueError: bad world size, mesh shape or rank; a parameter not on the meta device,
            0-dim or shared by two groups; a model with no parameters; a TP plan key that
            matches no module, or a style that is not modelled.
    """
    options = options if options is not None else PlanOptions()
    module = _resolve(model)
    mesh = _mesh(world_size, options)
    replicas, shard = mesh.replicas, mesh.shard
    tp = _tensor_parallel(module, options, mesh.tp_rank(options.rank))
    local_shapes = tp.local_shapes if tp is not None else None
    groups = build_groups(module, options, shard, replicas, local_shapes)
    if not groups:
        raise ValueError(f"shardkit.tools.plan: {type(module).__name__} has no parameters")
    if options.checkpoint:
        check_checkpoint(module, options, groups)
    if options.inputs is not None:
        trace = trace_step(module, groups, options, tp.tracer if tp is not None else None)
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
            shard_rank=mesh.shard_rank(options.rank),
            hsdp=options.mesh_shape is not None,
            tp=tp.tracer.schedule() if tp is not None else None,
            tp_degree=options.tp_degree,
            prefetch=(prefetch_lists(options.units, options.prefetch) if options.units else None),
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
        tp_degree=options.tp_degree,
        options=options,
        param_count=sum(p.numel() for p in module.parameters()),
        trainable_count=sum(p.numel() for p in module.parameters() if p.requires_grad),
        groups=tuple(
            _planned_group(g, raf)
            for g, raf in zip(groups, step.reshard_after_forward, strict=True)
        ),
        schedule=step.schedule,
        step_check=step.step_check,
        events=step.events,
        collectives=_summarise(step.schedule),
        sent_bytes_per_step=sent,
        sent_bytes_by_axis=_by_axis(step.schedule),
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
    name = getattr(model, "__qualname__", repr(model))
    return build_on_meta(model, f"shardkit.tools.plan: the model factory {name}")


@dataclass(frozen=True, slots=True)
class _Mesh:
    """The (replicas, shard, tp) mesh, tp innermost as torchtitan lays it out."""

    replicas: int
    shard: int
    tp: int

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def shard_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.shard


def _mesh(world_size: int, options: PlanOptions) -> _Mesh:
    """The mesh, validated against the world size."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"shardkit.tools.plan: world_size must be a positive int: {world_size!r}")
    tp = options.tp_degree
    if world_size % tp:
        raise ValueError(
            f"shardkit.tools.plan: tp_degree {tp} does not divide the world size {world_size}"
        )
    replicas, shard = options.mesh_shape or (1, world_size // tp)
    if replicas * shard * tp != world_size:
        tp_note = f" x tp_degree {tp}" if tp > 1 else ""
        raise ValueError(
            f"shardkit.tools.plan: mesh_shape {options.mesh_shape}{tp_note} has "
            f"{replicas * shard * tp} ranks, not the world size {world_size}"
        )
    if options.rank >= world_size:
        raise ValueError(
            f"shardkit.tools.plan: rank {options.rank} is outside the world size {world_size}"
        )
    return _Mesh(replicas, shard, tp)


@dataclass(frozen=True, slots=True)
class _TensorParallel:
    local_shapes: dict[str, tuple[int, ...]]
    """Parameter FQN -> the planned rank's TP-local shape, for the parameters TP distributes."""
    tracer: TPTracer
    """Records the tp collectives during the meta forward."""


def _tensor_parallel(
    module: nn.Module, options: PlanOptions, tp_rank: int
) -> _TensorParallel | None:
    if options.tp_plan is None:
        return None
    resolved = resolve_plan(module, options.tp_plan)
    params = dict(module.named_parameters())
    local_shapes: dict[str, tuple[int, ...]] = {}
    for name, placement in param_placements(resolved).items():
        if name not in params:
            continue  # a tied parameter is known by its first name
        shape = tuple(params[name].shape)
        check_shardable(f"parameter {name}", shape, placement, options.tp_degree)
        local_shapes[name] = tp_local_shape(shape, placement, tp_rank, options.tp_degree)
    tracer = TPTracer(resolved, options.tp_degree, gloo=options.backend == "gloo")
    return _TensorParallel(local_shapes, tracer)


def _planned_group(group: GroupSpec, reshard_after_forward: bool) -> PlannedGroup:
    return PlannedGroup(
        fqn=group.fqn,
        module_class=type(group.module).__name__,
        param_count=group.param_count,
        trainable_count=sum(p.numel for p in group.trainable),
        sharded_bytes=group.layout.sharded_bytes,
        unsharded_bytes=group.layout.unsharded_bytes,
        gather_input_bytes=group.layout.all_gather_input_bytes,
        reduce_output_bytes=group.layout.reduce_scatter_output_bytes,
        reshard_after_forward=reshard_after_forward,
    )


def _by_axis(schedule: tuple[CollectiveCall, ...]) -> dict[str, int]:
    """Bytes sent per mesh axis, axes in order of first appearance."""
    sent: dict[str, int] = {}
    for call in schedule:
        sent[call.axis] = sent.get(call.axis, 0) + call.sent_bytes
    return sent


def _summarise(schedule: tuple[CollectiveCall, ...]) -> tuple[CollectivePlan, ...]:
    """Count the calls per (kind, group, axis, sizes), in order of first appearance."""
    counts: dict[tuple[str, str, str, int, int, int], int] = {}
    for c in schedule:
        key = (c.kind, c.group, c.axis, c.group_size, c.input_bytes, c.sent_bytes)
        counts[key] = counts.get(key, 0) + 1
    return tuple(
        CollectivePlan(
            kind=kind,
            group=group,
            axis=axis,
            group_size=size,
            input_bytes=inp,
            sent_bytes=sent,
            calls=n,
        )
        for (kind, group, axis, size, inp, sent), n in counts.items()
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
        slice_n = group.reshard_after_forward
        if reshard and not isinstance(slice_n, bool) and slice_n is not None:
            # Backward gathers 1/n slices within n ranks instead.
            total += theory.all_gather_bytes(gathered, slice_n, 1)
            total -= theory.all_gather_bytes(gathered, world, 1)
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
