"""A stand-in for ``apply_plan`` until its branch is merged.

``plan-apply`` writes ``shardkit.tools.apply_plan``; the launch check and the planner
benchmark are written against its signature and use this until then. Delete this module
when it is merged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardkit.tools.plan.sharding_plan import ShardingPlan

__all__ = ["apply_plan"]

_SAVED_OPS = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _wrap(model: nn.Module, fqn: str, mode: str) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name)
    module = parent.get_submodule(child)
    if mode == "full":
        wrapped = checkpoint_wrapper(module)
    else:
        context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        wrapped = checkpoint_wrapper(module, context_fn=context)
    parent.register_module(child, wrapped)
    return wrapped


def apply_plan(
    model: nn.Module,
    sharding_plan: ShardingPlan,
    *,
    mesh: Any = None,
    fully_shard: Callable[..., Any] | None = None,
) -> nn.Module:
    """Checkpoint wrappers, then ``fully_shard`` per unit, prefetch and reduce precision."""
    import shardkit.core as core

    shard = fully_shard if fully_shard is not None else core.fully_shard
    found = {fqn: model.get_submodule(fqn) for fqn in sharding_plan.module_names}
    for fqn, mode in sharding_plan.checkpoint:
        found[fqn] = _wrap(model, fqn, mode)
    mp = core.MixedPrecisionPolicy(
        param_dtype=sharding_plan.param_dtype, reduce_dtype=sharding_plan.reduce_dtype
    )
    extra: dict[str, Any] = (
        {"offload_policy": core.CPUOffloadPolicy()} if sharding_plan.offload else {}
    )
    units: list[Any] = []
    for unit in sharding_plan.units:
        modules = [found[m] for m in unit.modules]
        target: Any = modules[0] if len(modules) == 1 else modules
        done = shard(
            target,
            mesh=mesh,
            reshard_after_forward=unit.reshard_after_forward,
            mp_policy=mp,
            **extra,
        )
        units.append(done[0] if isinstance(done, list) else done)
    lists = sharding_plan.prefetch_lists()
    for module, (forward, backward) in zip(units, lists or (), strict=False):
        module.set_modules_to_forward_prefetch([units[i] for i in forward])
        module.set_modules_to_backward_prefetch([units[i] for i in backward])
    if sharding_plan.reduce_precision is not None:
        for module in units:
            module.set_reduce_precision(sharding_plan.reduce_precision, recurse=False)
    return model
