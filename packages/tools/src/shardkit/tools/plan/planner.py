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

The record it returns, ``Plan``, and its JSON form live in ``plan_record``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from torch import nn

from shardkit.tools import theory
from shardkit.tools.plan.conditional import plan_anchoring
from shardkit.tools.plan.groups import GroupSpec, build_groups
from shardkit.tools.plan.meta_build import build_on_meta
from shardkit.tools.plan.muon_blocks import TPCuts
from shardkit.tools.plan.muon_step import muon_step, newton_schulz_costs
from shardkit.tools.plan.op_costs import optimizer_costs
from shardkit.tools.plan.options import ModelSource, PlanOptions
from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.recompute import check_checkpoint
from shardkit.tools.plan.records import CollectiveCall, CollectivePlan, PlannedGroup
from shardkit.tools.plan.sharding_plan import prefetch_lists
from shardkit.tools.plan.step import simulate_step
from shardkit.tools.plan.step_inputs import StepInputs
from shardkit.tools.plan.tp_comm import TPTracer
from shardkit.tools.plan.tp_styles import (
    check_shardable,
    param_placements,
    resolve_plan,
    tp_dims_of,
    tp_local_shape,
)
from shardkit.tools.plan.trace import assumed_trace, trace_step
from shardkit.tools.plan.trace_cache import TraceCache

__all__ = ["plan"]

logger = logging.getLogger(__name__)


def plan(
    model: ModelSource,
    *,
    world_size: int,
    options: PlanOptions | None = None,
    traces: TraceCache | None = None,
) -> Plan:
    """Plan per-rank memory and communication of FSDP training, allocating nothing.

    Args:
        model: An ``nn.Module`` on the meta device, or a callable returning one (called
            inside ``torch.device("meta")``, so it may build on the default device); with
            ``options.tp_plan``, the model before ``parallelize_module``.
        world_size: Ranks in all (replicas x shard for HSDP, times ``options.tp_degree``).
        options: How it is sharded and trained; defaults to ``PlanOptions()`` (fp32, AdamW,
            per-block wrap, the root keeping its parameters after forward).
        traces: Reuse the meta-device traces of earlier plans of the same model (a search's
            plans differ mostly in what does not change the trace); None traces afresh.

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
    if options.inputs is not None and tp is None and traces is not None:
        trace = traces.get(module, groups, options, lambda: trace_step(module, groups, options))
    elif options.inputs is not None:
        trace = trace_step(module, groups, options, tp.tracer if tp is not None else None)
    else:
        trace = assumed_trace(module, groups)
    root = next((i for i, g in enumerate(groups) if g.module is module), None)
    anchoring = plan_anchoring(module, groups, root, options.conditional)
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    muon = None
    if options.optimizer == "muon":  # this rank's share of Newton-Schulz and the exchange
        replica = options.rank // (mesh.shard * mesh.tp)
        tp_muon = None
        if tp is not None:
            tp_muon = (mesh.tp, mesh.tp_rank(options.rank), _muon_cuts(module, options))
        muon = muon_step(groups, root, mesh.shard_rank(options.rank), replicas, replica, tp_muon)
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
            anchoring=anchoring,
            muon=muon,
        )
    )
    sent = sum(c.sent_bytes for c in step.schedule)
    costs = trace.costs
    shard_rank = mesh.shard_rank(options.rank)
    if costs is not None:
        optimizer = optimizer_costs(groups, options, shard_rank)
        optimizer += newton_schulz_costs(muon) if muon is not None else ()
        costs = replace(costs, optimizer=optimizer)
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
        marks=step.marks,
        costs=costs,
        muon=muon,
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


def _muon_cuts(module: nn.Module, options: PlanOptions) -> TPCuts:
    """Each 2-D parameter's whole shape and the dim TP cuts (None: TP leaves it whole)."""
    assert options.tp_plan is not None
    dims = tp_dims_of(module, options.tp_plan)
    return {
        name: ((int(p.shape[0]), int(p.shape[1])), dims.get(name))
        for name, p in module.named_parameters()
        if p.dim() == 2
    }


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
