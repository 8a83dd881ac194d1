"""``apply_plan``: carry out a :class:`ShardingPlan` on a model, as a script would by hand.

A training script that follows a plan writes, in this order: wrap the checkpointed modules
(``checkpoint_wrapper``, replacing each in its parent), call ``fully_shard`` on each unit in
the plan's order with the plan's policies, set the forward and backward prefetch lists when
the plan prefetches more than one unit ahead, and set the reduce precision. ``apply_plan``
makes those same calls, after checking everything it can before changing anything: a plan
that names a missing module, a model already sharded or an option the engine lacks raises
and leaves the model as it was.
:func:`~shardkit.tools.plan.apply.parallelize_source.parallelize_source` writes the same calls
out as source.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh

import shardkit.core as shardkit_core
from shardkit.tools.plan.apply.plan_json import load_plan
from shardkit.tools.plan.sharding_plan import ROOT, CheckpointMode, ShardingPlan

__all__ = ["SELECTIVE_SAVED_OPS", "apply_plan", "selective_context_fn"]

logger = logging.getLogger(__name__)

EngineName = Literal["shardkit", "torch"]

SELECTIVE_SAVED_OPS: tuple[str, ...] = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
"""The aten ops whose outputs selective checkpointing saves (their ``.default`` overloads);
every other op of the module is recomputed in backward. The matrix multiplies and attention
are where the compute is, the rest (norms, activations, adds, views) is cheap to redo.
``nn.Linear`` is covered by ``mm``/``addmm``: the policy sees ops after ``aten.linear`` has
decomposed into them. Names this torch lacks are skipped."""


def _saved_ops() -> list[Any]:
    packets = (getattr(torch.ops.aten, name, None) for name in SELECTIVE_SAVED_OPS)
    return [packet.default for packet in packets if packet is not None]


def selective_context_fn() -> Any:
    """The ``context_fn`` of a ``selective`` checkpoint: save :data:`SELECTIVE_SAVED_OPS`."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_saved_ops())


class _Sharded(Protocol):
    """The setters ``apply_plan`` calls on a sharded module (both engines have them)."""

    def set_modules_to_forward_prefetch(self, modules: list[Any]) -> None: ...
    def set_modules_to_backward_prefetch(self, modules: list[Any]) -> None: ...
    def set_reduce_precision(self, policy: Any, *, recurse: bool = True) -> None: ...
    def set_conditional(self, conditional: bool, *, recurse: bool = True) -> None: ...


@dataclass(frozen=True, slots=True)
class _Engine:
    """One ``fully_shard`` and the policy classes it takes."""

    name: EngineName
    fully_shard: Callable[..., Any]
    mixed_precision: type[Any]
    offload: type[Any]


def _engine(fully_shard: Callable[..., Any] | None) -> _Engine:
    # shardkit first: with torch patched (``patch_torch``) torch's name is shardkit's function.
    if fully_shard is None or fully_shard is shardkit_core.fully_shard:
        return _Engine(
            "shardkit",
            shardkit_core.fully_shard,
            shardkit_core.MixedPrecisionPolicy,
            shardkit_core.CPUOffloadPolicy,
        )
    if fully_shard is torch_fsdp.fully_shard:
        # torch's fully_shard calls private methods of its own policy classes: give it those.
        return _Engine(
            "torch", fully_shard, torch_fsdp.MixedPrecisionPolicy, torch_fsdp.CPUOffloadPolicy
        )
    raise TypeError(
        "apply_plan: fully_shard must be None (shardkit.core.fully_shard) or "
        f"torch.distributed.fsdp.fully_shard, got {fully_shard!r}"
    )


@dataclass(frozen=True, slots=True)
class _Checkpointed:
    """A module to wrap, and where it hangs (resolved before anything is replaced)."""

    module: nn.Module
    parent: nn.Module
    attr: str
    mode: CheckpointMode


@dataclass(frozen=True, slots=True)
class _Resolved:
    """The plan's names turned into the model's module objects, every check passed."""

    units: list[list[nn.Module]]
    checkpointed: list[_Checkpointed]


def apply_plan(
    model: nn.Module,
    plan: ShardingPlan | str | os.PathLike[str],
    *,
    mesh: DeviceMesh | None = None,
    fully_shard: Callable[..., Any] | None = None,
) -> nn.Module:
    """Shard ``model`` as ``plan`` says, with the calls a script would write by hand.

    In order: each checkpointed module is replaced in its parent by torch's non-reentrant
    ``checkpoint_wrapper`` (its parameters' names gain ``_checkpoint_wrapped_module``); each
    unit is passed to ``fully_shard`` in plan order (a unit naming a checkpointed module
    shards its wrapper) with ``reshard_after_forward`` as the unit gives it, and the plan's
    mixed precision and offload policies; with ``prefetch`` k > 1, each non-root unit gathers
    the next k units in forward and the previous k (nearest first) in backward; the reduce
    precision is set on every unit, and the conditional units are marked
    (``set_conditional(True, recurse=False)``). A root unit's ``reshard_after_forward`` is passed as
    given: True frees the root's parameters after forward too (``fully_shard``'s default
    would keep them).

    Args:
        model: the model, not yet sharded; plan names are its ``named_modules()`` FQNs.
        plan: a :class:`ShardingPlan`, or the path of one written by ``dump_plan``.
        mesh: the data-parallel mesh for every ``fully_shard`` call; default: all ranks.
        fully_shard: None for shardkit's engine, or ``torch.distributed.fsdp.fully_shard``.

    Returns:
        ``model``, sharded (the root module: ``fully_shard`` changes classes in place).

    Raises:
        ValueError: a name the model lacks (with close matches), units out of ``fully_shard``
            order, a module already sharded or checkpoint-wrapped, a ``reshard_after_forward``
            that does not divide the shard size, an option the engine or torch lacks; a plan
            file ``load_plan`` refuses. Before the model is changed.
        TypeError: a ``fully_shard`` or ``mesh`` of the wrong kind (before any change).
        RuntimeError: no mesh and no initialised process group (before any change).

    An error ``fully_shard`` itself raises, one these checks do not foresee, can leave the
    model partly sharded.
    """
    plan = plan if isinstance(plan, ShardingPlan) else load_plan(plan)
    engine = _engine(fully_shard)
    resolved = _resolve(model, plan, engine, mesh)
    wrappers = {id(c.module): _wrap(c) for c in resolved.checkpointed}
    kwargs = _shard_kwargs(plan, engine, mesh)
    firsts: list[_Sharded] = []
    for unit, targets in zip(plan.units, resolved.units, strict=True):
        modules = [wrappers.get(id(m), m) for m in targets]
        engine.fully_shard(
            modules[0] if len(modules) == 1 else modules,
            reshard_after_forward=unit.reshard_after_forward,
            **kwargs,
        )
        # A unit's modules share one state: its first stands for the unit in the setters.
        firsts.append(cast(_Sharded, modules[0]))
    ordered = [m for unit, m in zip(plan.units, firsts, strict=True) if unit.modules != (ROOT,)]
    if plan.prefetch > 1:
        _set_prefetch(ordered, plan.prefetch)
    if plan.reduce_precision is not None:
        for module in firsts:
            module.set_reduce_precision(plan.reduce_precision, recurse=False)
    for unit, module in zip(plan.units, firsts, strict=True):
        if any(fqn in plan.conditional for fqn in unit.modules):
            module.set_conditional(True, recurse=False)
    logger.info(
        "apply_plan: %d units sharded (%s engine), %d modules checkpointed, prefetch %d",
        len(plan.units),
        engine.name,
        len(plan.checkpoint),
        plan.prefetch,
    )
    return model


def _wrap(entry: _Checkpointed) -> nn.Module:
    """Replace the module by its checkpoint wrapper in its parent; the wrapper."""
    kwargs: dict[str, Any] = {}
    if entry.mode == "selective":
        kwargs["context_fn"] = selective_context_fn
    wrapper = checkpoint_wrapper(
        entry.module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs
    )
    setattr(entry.parent, entry.attr, wrapper)
    return wrapper


def _shard_kwargs(plan: ShardingPlan, engine: _Engine, mesh: DeviceMesh | None) -> dict[str, Any]:
    """The keywords every unit's ``fully_shard`` call shares; defaults left out, as by hand."""
    kwargs: dict[str, Any] = {}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if plan.param_dtype is not None or plan.reduce_dtype is not None:
        kwargs["mp_policy"] = engine.mixed_precision(
            param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype
        )
    if plan.offload:
        kwargs["offload_policy"] = engine.offload()
    return kwargs


def _set_prefetch(ordered: Sequence[_Sharded], k: int) -> None:
    """Each unit gathers the next k in forward and the previous k, nearest first, in backward.

    An empty list is not set: it would switch off the engine's own backward prefetch where a
    script would have left the default.
    """
    for i, module in enumerate(ordered):
        ahead = list(ordered[i + 1 : i + 1 + k])
        behind = list(reversed(ordered[max(0, i - k) : i]))
        if ahead:
            module.set_modules_to_forward_prefetch(ahead)
        if behind:
            module.set_modules_to_backward_prefetch(behind)


def _resolve(
    model: nn.Module, plan: ShardingPlan, engine: _Engine, mesh: DeviceMesh | None
) -> _Resolved:
    """Every check ``apply_plan`` makes, before it changes anything; the modules to act on."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_plan: model must be an nn.Module, got {type(model).__name__}")
    _check_not_sharded(model)
    names = [name for name, _ in model.named_modules()]
    units = [
        [_module_at(model, fqn, names, f"units[{i}]") for fqn in unit.modules]
        for i, unit in enumerate(plan.units)
    ]
    _check_unit_order(plan)
    checkpointed = [
        _checkpointed(model, fqn, mode, names, f"checkpoint[{i}]")
        for i, (fqn, mode) in enumerate(plan.checkpoint)
    ]
    if plan.conditional and engine.name != "shardkit":
        raise ValueError(
            "apply_plan: the plan marks conditional modules, which only shardkit's engine "
            "has (FSDPModule.set_conditional); apply it with fully_shard=None"
        )
    _check_reshard(plan, _shard_size(mesh))
    if plan.reduce_precision is not None and engine.name != "shardkit":
        raise ValueError(
            "apply_plan: the plan sets reduce_precision, which only shardkit's engine has "
            "(FSDPModule.set_reduce_precision); apply it with fully_shard=None"
        )
    if plan.offload and engine.name == "torch" and not torch.accelerator.is_available():
        # torch's CPUOffloadPolicy pins host memory, which fails mid-way without one.
        raise ValueError(
            "apply_plan: the plan offloads, and torch's CPUOffloadPolicy pins host memory, "
            "which needs an accelerator (none here); apply it with shardkit's engine"
        )
    return _Resolved(units, checkpointed)


def _check_not_sharded(model: nn.Module) -> None:
    sharded_types: tuple[type[Any], ...] = (shardkit_core.FSDPModule, torch_fsdp.FSDPModule)
    legacy = getattr(torch_fsdp, "FullyShardedDataParallel", None)
    if isinstance(legacy, type):
        sharded_types += (legacy,)
    for name, module in model.named_modules():
        if isinstance(module, sharded_types):
            raise ValueError(
                f"apply_plan: module {name or '<root>'!r} is already sharded "
                f"({type(module).__name__}); apply a plan to a model not yet sharded"
            )


def _module_at(model: nn.Module, fqn: str, names: list[str], where: str) -> nn.Module:
    """The module named ``fqn``; a missing name raises with the closest names the model has."""
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        close = difflib.get_close_matches(fqn, names, n=3, cutoff=0.6)
        hint = f"; close matches: {', '.join(repr(c) for c in close)}" if close else ""
        raise ValueError(
            f"apply_plan: {where} names {fqn!r}, not a module of the model{hint}"
        ) from None


def _check_unit_order(plan: ShardingPlan) -> None:
    """``fully_shard`` goes inner modules first: no unit may hold a later unit's module.

    Each module's ancestors are looked up among the units' modules (linear in the plan's
    size: a plan read from a file may hold many units).
    """
    unit_of = {fqn: i for i, unit in enumerate(plan.units) for fqn in unit.modules}
    for j, unit in enumerate(plan.units):
        for inner in unit.modules:
            parts = inner.split(".") if inner else []
            for depth in range(len(parts)):
                outer = ".".join(parts[:depth])
                i = unit_of.get(outer)
                if i is not None and i <= j:
                    where = "the same unit" if i == j else f"units[{j}], a later unit"
                    raise ValueError(
                        f"apply_plan: units[{i}] module {outer or '<root>'!r} contains "
                        f"{inner!r} of {where}; fully_shard is called on inner modules "
                        "first, each module in one unit"
                    )


def _checkpointed(
    model: nn.Module, fqn: str, mode: CheckpointMode, names: list[str], where: str
) -> _Checkpointed:
    if fqn == ROOT:
        raise ValueError(f"apply_plan: {where}: the root module cannot be checkpointed")
    module = _module_at(model, fqn, names, where)
    if isinstance(module, CheckpointWrapper):
        raise ValueError(f"apply_plan: {where}: module {fqn!r} is already checkpoint-wrapped")
    if mode == "selective" and not _has_selective():
        raise ValueError(
            f"apply_plan: {where}: selective checkpointing of {fqn!r} needs "
            f"torch.utils.checkpoint.create_selective_checkpoint_contexts (torch "
            f"{torch.__version__} lacks it); use 'full'"
        )
    parent_fqn, _, attr = fqn.rpartition(".")
    return _Checkpointed(module, model.get_submodule(parent_fqn), attr, mode)


def _has_selective() -> bool:
    import torch.utils.checkpoint as checkpoint

    return hasattr(checkpoint, "create_selective_checkpoint_contexts")


def _shard_size(mesh: DeviceMesh | None) -> int:
    """Ranks one parameter is sharded over: the mesh's last axis, or the whole world."""
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"apply_plan: mesh must be a DeviceMesh, got {type(mesh).__name__}")
        return int(mesh.shape[-1])
    if not dist.is_initialized():
        raise RuntimeError(
            "apply_plan: no mesh given and no process group initialised "
            "(torch.distributed.init_process_group, or torchrun)"
        )
    return dist.get_world_size()


def _check_reshard(plan: ShardingPlan, shard_size: int) -> None:
    for i, unit in enumerate(plan.units):
        value = unit.reshard_after_forward
        if not isinstance(value, bool) and shard_size % value != 0:
            raise ValueError(
                f"apply_plan: units[{i}] ({unit.name}) reshard_after_forward={value} must "
                f"divide the shard size {shard_size}"
            )
