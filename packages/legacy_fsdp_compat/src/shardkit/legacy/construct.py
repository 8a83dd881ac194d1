"""What one ``FullyShardedDataParallel(...)`` call does, step by step, in FSDP1's order.

1. Translate the arguments (torch's own FSDP1 objects too) and resolve the mesh.
2. Auto-wrap: every target submodule becomes a wrapper of its own, innermost first.
3. Materialize what is still on the meta device (``param_init_fn`` or ``reset_parameters``).
4. Move to ``device_id``; broadcast rank 0's values (``sync_module_states``).
5. ``fully_shard`` the module: one group of the parameters no inner wrapper holds.

Steps 3 and 4 touch only the wrapper's own part of the tree: inner wrappers did theirs.

Next to split off: step 1, reading the arguments (``Fsdp1Args``, ``_ignored``,
``_compute_device``, ``_one_rank_is_no_shard``) into ``construct_args.py``: they read only the
arguments and the module, before anything is wrapped, and ``build_unit`` calls each function
once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardkit.core import FSDPModule, fully_shard
from shardkit.core.layout import layout_of
from shardkit.legacy import configs
from shardkit.legacy.comm import broadcast_from_first
from shardkit.legacy.configs import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from shardkit.legacy.flat_params import check_flattenable
from shardkit.legacy.mapping import STRATEGIES, core_args, resolve_mesh
from shardkit.legacy.orig_params import record_replaced
from shardkit.legacy.torch_compat import root_mesh, translate
from shardkit.legacy.wrap import auto_wrap_targets

__all__ = ["Fsdp1Args", "Unit", "build_unit", "own_modules"]

_OURS: dict[str, type[Any]] = {name: getattr(configs, name) for name in configs.__all__}


@dataclass(frozen=True, kw_only=True, slots=True)
class Fsdp1Args:
    """FSDP1's constructor arguments (besides the module), as given."""

    process_group: Any = None
    sharding_strategy: ShardingStrategy | None = None
    cpu_offload: CPUOffload | None = None
    auto_wrap_policy: Any = None
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    mixed_precision: MixedPrecision | None = None
    ignored_modules: Iterable[nn.Module] | None = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    device_id: int | torch.device | None = None
    sync_module_states: bool = False
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = False
    ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None
    device_mesh: DeviceMesh | None = None

    def translated(self) -> Fsdp1Args:
        """The same arguments with torch's FSDP1 enums and configs turned into ours."""
        values = {f.name: translate(getattr(self, f.name), _OURS) for f in fields(self)}
        return Fsdp1Args(**values)

    def child_kwargs(self) -> dict[str, Any]:
        """What an auto-wrapped unit is built with: the same, without the policy."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        kwargs["auto_wrap_policy"] = None
        return kwargs


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    """One wrapper, once built: what the rest of the package needs to know of it."""

    strategy: ShardingStrategy
    mesh: DeviceMesh
    """The data-parallel mesh of its group."""
    process_group: dist.ProcessGroup
    """FSDP1's ``process_group``: the group its parameters are sharded over."""
    mixed_precision: MixedPrecision | None
    cpu_offload: CPUOffload
    device: torch.device
    """The compute device."""
    device_mesh_given: bool
    """Whether the user passed ``device_mesh`` (sharded state dicts are then DTensors)."""
    two_d: bool
    """Whether ``device_mesh`` is a slice of a larger mesh (FSDP x TP): FSDP1 then shapes
    sharded state dicts with its DTensor extensions (``shardkit.tp.DTensorExtensions``)."""
    ignored_modules: frozenset[nn.Module]
    ignored_params: frozenset[nn.Parameter]
    has_params: bool
    """Whether its own group has parameters."""
    use_orig_params: bool
    backward_prefetch: BackwardPrefetch | None
    """FSDP1's argument, kept for its attribute: the engine always prefetches the next group."""
    forward_prefetch: bool
    """FSDP1's argument, kept for its attribute."""
    limit_all_gathers: bool
    """FSDP1's argument, kept for its attribute: buffers come from a bounded pool anyway."""


def build_unit(module: nn.Module, given: Fsdp1Args, wrapper_cls: type[nn.Module]) -> Unit:
    """Auto-wrap, materialize, sync and shard ``module``; describe the resulting unit.

    Raises:
        ValueError: arguments FSDP1 refuses too (both ignored_modules and ignored_states,
            a wrapper inside a module to auto-wrap, bad process groups...).
    """
    args = given.translated()
    strategy = args.sharding_strategy or ShardingStrategy.FULL_SHARD
    ignored_modules, ignored_params = _ignored(module, args, wrapper_cls)
    device = _compute_device(module, args)
    mesh = resolve_mesh(strategy, args.process_group, args.device_mesh, device.type)
    strategy, mesh = _one_rank_is_no_shard(strategy, mesh, args, device.type)
    if args.auto_wrap_policy is not None:
        _auto_wrap(module, args, ignored_modules, ignored_params, wrapper_cls)
    own = list(own_modules(module, ignored_modules, wrapper_cls))
    _materialize(own, args.param_init_fn, device)
    managed = [p for m in own for p in m.parameters(recurse=False) if p not in ignored_params]
    check_flattenable(managed, args.use_orig_params)
    if args.device_id is not None and device.type != "cpu":
        for m in own:
            m.to(device)
    if args.sync_module_states:
        _sync(own, ignored_params, mesh)
    core = core_args(strategy, mesh, args.mixed_precision, args.cpu_offload)
    sharded_modules = _group_modules(module, own, {id(p) for p in managed})
    if sharded_modules:
        record_replaced(own, set(ignored_params))
        fully_shard(
            sharded_modules,
            mesh=core.mesh,
            reshard_after_forward=core.reshard_after_forward,
            mp_policy=core.mp_policy,
            offload_policy=core.offload_policy,
            ignored_params=set(ignored_params),
        )
        _reduce_as_fsdp1(sharded_modules, strategy)
    mp = args.mixed_precision
    if mp is not None and mp.keep_low_precision_grads and mp.param_dtype is not None:
        _round_grads(_sharded_params(own, ignored_params), mp.param_dtype)
    shard_group = mesh.get_group(mesh.ndim - 1)
    return Unit(
        strategy=strategy,
        mesh=mesh,
        process_group=mesh.get_group(0) if strategy is ShardingStrategy.NO_SHARD else shard_group,
        mixed_precision=args.mixed_precision,
        cpu_offload=args.cpu_offload or CPUOffload(),
        device=device,
        device_mesh_given=args.device_mesh is not None,
        two_d=args.device_mesh is not None and root_mesh(args.device_mesh) != args.device_mesh,
        ignored_modules=frozenset(ignored_modules),
        ignored_params=frozenset(ignored_params),
        has_params=bool(managed),
        use_orig_params=args.use_orig_params,
        backward_prefetch=args.backward_prefetch,
        forward_prefetch=args.forward_prefetch,
        limit_all_gathers=args.limit_all_gathers,
    )


def _reduce_as_fsdp1(modules: nn.Module | list[nn.Module], strategy: ShardingStrategy) -> None:
    """The unit's group reduces and accumulates gradients as FSDP1's flat parameter does.

    A backward reduces the whole unit: a trainable parameter it did not reach gets a zero
    gradient (FSDP1's flat gradient holds zeros there, and its ``use_orig_params=True``
    views give them to the parameters), and ranks may reach different parameters. Between
    backwards without sync, gradients accumulate in the forward's dtype (autograd's, on the
    flat parameter), not the reduce dtype; and ``NO_SHARD`` adds a backward's gradient to the
    reduced one already there and reduces the sum again. See [Note: FSDP1's gradient
    accumulation]. Its backward ends at its last gradient, as the flat parameter's hook ends
    FSDP1's, not where every rank's backward does (which watches the unit's inputs through an
    autograd node of its own: autograd would then sum some gradients in another order).
    """
    first = modules[0] if isinstance(modules, list) else modules
    if isinstance(first, FSDPModule):
        first.set_reduce_scatter_unused_params(True, recurse=False)
    for view in layout_of(first):
        if any(m is first for m in view.modules):
            view.accumulate_unsynced_grads_in_param_dtype(True)
            view.end_at_last_grad(True)
            view.reduce_accumulated_grads(strategy is ShardingStrategy.NO_SHARD)


def _one_rank_is_no_shard(
    strategy: ShardingStrategy, mesh: DeviceMesh, args: Fsdp1Args, device_type: str
) -> tuple[ShardingStrategy, DeviceMesh]:
    """FSDP1's clamp: a unit sharded over one rank is ``NO_SHARD``, with FSDP1's warnings.

    FSDP1 also clamps a hybrid strategy whose shard group has one rank, and then reduces over
    that group alone: the replicas never exchange gradients (pytorch/pytorch#154888). Hybrid
    units keep their all-reduce across replicas here.
    """
    kind = STRATEGIES[strategy].mesh
    if kind == "hybrid":
        return strategy, mesh
    if mesh.size() == 1:
        if strategy is not ShardingStrategy.NO_SHARD:
            warnings.warn(
                f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world "
                "size is 1.",
                stacklevel=4,
            )
            strategy = ShardingStrategy.NO_SHARD
            mesh = resolve_mesh(strategy, args.process_group, args.device_mesh, device_type)
    elif strategy is ShardingStrategy.NO_SHARD:
        warnings.warn(
            "The `NO_SHARD` sharding strategy is deprecated. If having issues, please use "
            "`DistributedDataParallel` instead.",
            FutureWarning,
            stacklevel=4,
        )
    return strategy, mesh


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _group_modules(
    module: nn.Module, own: list[nn.Module], managed: set[int]
) -> nn.Module | list[nn.Module]:
    """What the unit's group hooks: the module, or the modules that run for it.

    FSDP1 wraps a container with no forward of its own (an ``nn.ModuleList`` that a policy
    picked, say) and its parent then calls the modules inside it. The engine's hooks sit on
    forwards, so the group is then the outermost modules of the unit that have one; a
    container with no parameters to shard gives no group at all (an empty list).

    Raises:
        ValueError: a module with no forward holds parameters itself: nothing would gather
            them before use.
    """
    if _has_forward(module):
        return module
    allowed = {id(m) for m in own}
    found: list[nn.Module] = []
    queue = [module]
    while queue:
        container = queue.pop(0)
        if any(id(p) in managed for p in container.parameters(recurse=False)):
            raise ValueError(
                f"FullyShardedDataParallel cannot shard {type(container).__name__}'s own "
                "parameters: it has no forward, so nothing would gather them before they are "
                "used; wrap the module that uses them instead"
            )
        for child in container.children():
            if id(child) not in allowed:
                continue
            if not _has_forward(child):
                queue.append(child)
            elif any(id(p) in managed for p in child.parameters()):
                found.append(child)
    return found


def _sharded_params(own: list[nn.Module], ignored: set[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters of ``own`` that the unit's group manages (after sharding: the DTensors)."""
    return [p for m in own for p in m.parameters(recurse=False) if p not in ignored]


def _round_grads(params: list[nn.Parameter], dtype: torch.dtype) -> None:
    """``keep_low_precision_grads``: gradients with ``param_dtype``'s values, as FSDP1's.

    FSDP1 hands the optimizer gradients in ``param_dtype``; a DTensor parameter cannot hold a
    gradient of another dtype, so each reduced gradient is rounded to ``param_dtype`` in place
    and keeps the parameter's dtype (the values FSDP1's optimizer sees, not its memory).
    """

    def round_in_place(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.copy_(local.to(dtype))

    for param in params:
        param.register_post_accumulate_grad_hook(round_in_place)


def own_modules(
    root: nn.Module, ignored: set[nn.Module], wrapper_cls: type[nn.Module]
) -> Iterator[nn.Module]:
    """The modules of ``root``'s tree that no inner wrapper holds and that are not ignored."""
    queue = [root]
    seen = {id(root)}
    while queue:
        module = queue.pop(0)
        yield module
        for child in module.children():
            if id(child) in seen or child in ignored or isinstance(child, wrapper_cls):
                continue
            seen.add(id(child))
            queue.append(child)


def _ignored(
    module: nn.Module, args: Fsdp1Args, wrapper_cls: type[nn.Module]
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    if args.ignored_modules is not None and args.ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time. Please just "
            "pass ignored_states."
        )
    states = list(args.ignored_states or args.ignored_modules or ())
    if not all(isinstance(s, nn.Parameter) for s in states) and not all(
        isinstance(s, nn.Module) for s in states
    ):
        raise ValueError(
            "ignored_states expects all nn.Parameter or all nn.Module list elements, got "
            f"{[type(s).__name__ for s in states]}"
        )
    modules = {m for s in states if isinstance(s, nn.Module) for m in s.modules()}
    if any(isinstance(m, wrapper_cls) for m in modules):
        raise ValueError("ignored_modules should not include FSDP modules")
    params = {p for s in states if isinstance(s, nn.Parameter) for p in (s,)}
    params |= {p for m in modules for p in m.parameters()}
    return modules, params


def _compute_device(module: nn.Module, args: Fsdp1Args) -> torch.device:
    device_id = args.device_id
    if isinstance(device_id, int):
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            raise ValueError(f"device_id={device_id} names an accelerator, and there is none")
        return torch.device(accelerator.type, device_id)
    if device_id is not None:
        return torch.device(device_id)
    if args.device_mesh is not None:
        return torch.device(args.device_mesh.device_type)
    for tensor in module.parameters():
        if tensor.device.type not in ("cpu", "meta"):
            return tensor.device
    group = args.process_group[0] if isinstance(args.process_group, tuple) else args.process_group
    if not isinstance(group, dist.ProcessGroup):
        group = None  # a wrong argument: resolve_mesh names it
    return torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")


def _auto_wrap(
    module: nn.Module,
    args: Fsdp1Args,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    wrapper_cls: type[nn.Module],
) -> None:
    for name, sub in module.named_modules():
        if isinstance(sub, wrapper_cls):
            raise ValueError(
                "FSDP auto wrapping requires modules to not already have FSDP applied but "
                f"found {name} in\n{module}"
            )
    root_kwargs = args.child_kwargs()
    targets = auto_wrap_targets(
        module, args.auto_wrap_policy, ignored_modules, ignored_params, root_kwargs
    )
    _wrap_post_order(module, targets, wrapper_cls, {id(module)})


def _wrap_post_order(
    module: nn.Module,
    targets: dict[nn.Module, dict[str, Any]],
    wrapper_cls: type[nn.Module],
    seen: set[int],
) -> None:
    # Innermost first: a unit's group must exist before the one around it takes the rest.
    for name, child in list(module.named_children()):
        if id(child) in seen:
            continue
        seen.add(id(child))
        _wrap_post_order(child, targets, wrapper_cls, seen)
        if child in targets:
            setattr(module, name, wrapper_cls(child, **targets[child]))


def _materialize(
    own: list[nn.Module],
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
) -> None:
    on_meta = any(
        t.is_meta for m in own for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
    )
    if not on_meta:
        return
    target = device if device.type != "meta" else torch.device("cpu")
    with torch.no_grad():
        for module in own:
            if param_init_fn is not None:
                param_init_fn(module)
                continue
            states = (*module.parameters(recurse=False), *module.buffers(recurse=False))
            if not states:
                continue
            module.to_empty(device=target, recurse=False)
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


def _sync(own: list[nn.Module], ignored: set[nn.Parameter], mesh: DeviceMesh) -> None:
    tensors: list[torch.Tensor] = [
        p for m in own for p in m.parameters(recurse=False) if p not in ignored
    ]
    tensors += [b for m in own for b in m.buffers(recurse=False)]
    # The shard group first, then the replicas: every rank ends with rank 0's values.
    for axis in reversed(range(mesh.ndim)):
        broadcast_from_first(tensors, mesh.get_group(axis))
