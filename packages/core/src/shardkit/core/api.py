"""The public entry point: ``fully_shard`` and the FSDPModule methods it adds to a module.

Everything is validated before anything is changed, so a failed call leaves the module as it
was. The class swap (``Linear`` -> ``FSDPLinear``) happens here and nowhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from types import MethodType
from typing import Any, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import DataParallelMeshDims as TorchDataParallelMeshDims
from torch.distributed.tensor import Shard

from shardkit.core.errors import FullyShardUsageError, UnsupportedCopyError
from shardkit.core.mesh_info import MeshInfo, mesh_info_for
from shardkit.core.options import GroupOptions
from shardkit.core.param import FSDPParam
from shardkit.core.param_group import FSDPParamGroup, GroupConfig
from shardkit.core.policies import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from shardkit.core.runtime.groups import default_mesh, group_ranks, subgroup_of
from shardkit.core.sharding import (
    check_hooked_params,
    collect_params,
    mark_owned,
    validate_reshard_after_forward,
)
from shardkit.core.spmd import spmd_mesh_info
from shardkit.core.state import FSDPState, is_managed, register_state, state_of, states_under
from shardkit.core.state_dict.validation import (
    check_state_dict,
    format_problems,
    param_keys,
    shard_full_tensors,
)

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]

logger = logging.getLogger(__name__)

_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard."""

    def __init__(self, group: FSDPParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        """Block until the full parameters are gathered and registered."""
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Methods that ``fully_shard`` adds to a module (by swapping in an ``FSDP<Cls>`` class)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Build the original class: a new module is not sharded, whatever built it.

        Code that makes a module of its own type (``model[:2]`` on a Sequential builds
        ``type(self)(...)``) gets a plain module, not an FSDP class with no FSDP state.
        """
        original = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
        if original.__new__ is object.__new__:
            module = object.__new__(original)
        else:
            module = original.__new__(original, *args, **kwargs)
        original.__init__(module, *args, **kwargs)
        return module

    def _groups_under(self, recurse: bool) -> list[FSDPParamGroup]:
        assert isinstance(self, nn.Module)
        states = states_under(self) if recurse else [state_of(self)]
        return [s.group for s in states if s.group is not None]

    def _own_group(self) -> FSDPParamGroup | None:
        assert isinstance(self, nn.Module)
        return state_of(self).group

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's parameters (not its children's); async returns a handle."""
        assert isinstance(self, nn.Module)
        state = state_of(self)
        state.lazy_init()
        group = state.group
        if group is not None:
            group.unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's full parameters and register the sharded ones."""
        group = self._own_group()
        if group is not None:
            group.reshard()

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward or backward (call on the root)."""
        assert isinstance(self, nn.Module)
        state = state_of(self)
        if not state.is_root:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        state.reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backward leaves gradient reductions to a later one (microbatches)."""
        for group in self._groups_under(recurse=True):
            group.options.is_last_backward = is_last_backward

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: accumulate full gradients locally instead of reducing them (no_sync)."""
        for group in self._groups_under(recurse):
            group.options.reduce_grads = requires_gradient_sync
            group.options.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but defers the all-reduce across replicas."""
        for group in self._groups_under(recurse):
            group.options.all_reduce_grads = requires_all_reduce

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """True: trainable parameters unused in a backward are reduced as zeros.

        They then get a zero gradient on every rank, and ranks whose control flow uses
        different parameters (mixture of experts) still issue the same collective. By default
        (False) an unused parameter's gradient stays None and optimizers skip it.
        """
        for group in self._groups_under(recurse):
            group.options.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Let up to ``max_input_buffers`` gradient reductions be in flight at once.

        1 (the default) finishes a group's reduction before the next group allocates its
        send buffer; more lets communication run behind more of backward, at the cost of
        that many send buffers alive at backward's memory peak.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for group in self._groups_under(recurse):
            group.options.max_reduces_in_flight = max_input_buffers

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Reduce gradients on a process group of their own, so they overlap all-gathers.

        One group per set of shard ranks is created (collectively: call it on every rank of
        the mesh); False goes back to sharing the shard group.
        """
        for group in self._groups_under(recurse):
            shard_group = group.mesh_info.shard_group
            group.options.reduce_scatter_group = (
                subgroup_of(shard_group, tuple(group_ranks(shard_group))) if enable else None
            )

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """Run ``hook(reduced)`` on this module's reduced gradient, in place.

        ``reduced`` is the reduce-scatter output with plain FSDP, or the all-reduce output
        with HSDP: the sum over ranks, before the division by the data-parallel size. A
        user-run all-reduce across other ranks goes here. ``stream`` (CUDA) is refused with
        HSDP, as torch's; the hook runs where the reduction finishes.
        """
        for group in self._groups_under(recurse=False):
            info = group.mesh_info
            if stream is not None and info.replicate_group is not None and info.has_shard_axis:
                raise ValueError("stream cannot be set when using native HSDP")
            group.options.all_reduce_hook = hook

    def set_custom_all_gather(self, comm: Any) -> None:
        """Gather this module's parameters with ``comm`` (torch's ``AllGather`` interface).

        ``comm.allocate(size, dtype=, device=)`` makes the output buffer and
        ``comm(output, input, group, async_op=)`` runs the gather of the flat uint8 shards.
        """
        for group in self._groups_under(recurse=False):
            group.options.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce this module's gradients with ``comm`` (torch's ``ReduceScatter`` interface).

        ``comm.allocate`` makes the input and output buffers and
        ``comm(output, input, group, op, async_op=)`` sums the (W * S) input into each rank's
        S elements.
        """
        for group in self._groups_under(recurse=False):
            group.options.custom_reduce_scatter = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for compatibility; communication buffers come from shardkit's own pool.

        On gloo there is no process-group allocator to use; on NCCL the pool's buffers are
        reused across groups and steps, which is what this option is for.
        """

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted for compatibility; symmetric-memory all-gathers are not used.

        Raises:
            ValueError: ``backend`` is not ``"NCCL"`` (torch's only backend too).
        """
        if backend != "NCCL":
            raise ValueError(f"only the NCCL symmetric memory backend exists, got {backend!r}")

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change whether full parameters are freed after forward."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError("set_reshard_after_forward takes a bool")
        for group in self._groups_under(recurse):
            group.options.reshard_after_forward = reshard_after_forward
            group.options.reshard_after_forward_is_default = False

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """False keeps full parameters after backward (saves the next forward's all-gather)."""
        for group in self._groups_under(recurse):
            group.options.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' parameters right after this module's pre-forward."""
        self._set_prefetch(modules, forward=True)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' parameters right after this module's pre-backward."""
        self._set_prefetch(modules, forward=False)

    def _set_prefetch(self, modules: list[FSDPModule], *, forward: bool) -> None:
        group = self._own_group()
        targets: list[FSDPParamGroup] = []
        for module in modules:
            if not isinstance(module, FSDPModule) or not isinstance(module, nn.Module):
                raise ValueError(f"prefetch targets must be FSDP modules, got {type(module)}")
            target = state_of(module).group
            if target is not None:
                targets.append(target)
        if group is not None:
            if forward:
                group.forward_prefetch = targets
            else:
                group.backward_prefetch = targets

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide summed gradients by ``factor`` instead of the data-parallel world size."""
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        group = self._own_group()
        if group is not None:
            group.options.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for compatibility: shardkit always sums in the collective, then divides."""

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: do not gather this module's parameters for backward (unused there)."""
        group = self._own_group()
        if group is not None:
            group.options.unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted for compatibility: collectives are ordered after the optimizer already."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # .to(), .to_empty(), .float() replace local tensors: reshard first, re-adopt after.
        groups = self._groups_under(recurse=True)
        for group in groups:
            group.reshard()
        assert isinstance(self, nn.Module)
        result = nn.Module._apply(self, fn, recurse)
        for group in groups:
            group.resync_sharded_storage()
        return result

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load all of ``state_dict`` or nothing: every value is checked before any write.

        Sharded parameters accept DTensors (the sharded state dict) or plain full tensors
        (each rank keeps its own shard). Other dtypes are converted, as torch's
        ``load_state_dict`` does (bf16 weights into an fp32 model). One error lists every
        missing, unexpected or wrongly shaped key and every value that cannot be copied (a
        meta tensor, a DTensor on another mesh), and leaves the module exactly as it was.
        """
        assert isinstance(self, nn.Module)
        groups = self._groups_under(recurse=True)
        by_key = {key: g.params[i] for key, (g, i) in param_keys(self, groups).items()}
        expected = self.state_dict(keep_vars=True)
        cpu_only = any(g.offload for g in groups)
        problems = check_state_dict(expected, state_dict, strict=strict, cpu_only=cpu_only)
        if problems:
            raise RuntimeError(format_problems(self, problems))
        converted = shard_full_tensors(state_dict, by_key)
        return nn.Module.load_state_dict(self, converted, strict=strict, assign=assign)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise UnsupportedCopyError(
            "FSDP does not support deepcopy. Please use state dict for serialization. "
            f"({type(self).__name__}: deep-copy the model before fully_shard, or load a copy "
            "through model.state_dict())"
        )


_Placement = Callable[[nn.Parameter], Shard | None] | None
# Code written for torch passes torch's class; ours has the same fields.
_MeshDims = DataParallelMeshDims | TorchDataParallelMeshDims | None


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: _Placement = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: _MeshDims = ...,
) -> FSDPModule: ...
@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: _Placement = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: _MeshDims = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: _Placement = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008  (frozen)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008  (frozen)
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: _MeshDims = None,
) -> FSDPModule | list[FSDPModule]:
    """Shard a module's parameters across the data-parallel mesh (a drop-in for torch's).

    Args:
        module: a module, or a list of modules whose parameters form one group.
        mesh: a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh with dim names (HSDP);
            default: every rank of the default process group. With ``dp_mesh_dims``, the
            whole SPMD mesh the parameters are DTensors on.
        reshard_after_forward: True frees full parameters after forward, False keeps them,
            None means True except for the root; an int n keeps a 1/n slice.
        shard_placement_fn: returns ``Shard(dim)`` for a parameter, or None for ``Shard(0)``.
        mp_policy: mixed precision.
        offload_policy: ``CPUOffloadPolicy()`` keeps shards and gradients on the CPU.
        ignored_params: parameters left alone: not sharded, not moved, not reduced.
        dp_mesh_dims: the data-parallel axes of ``mesh`` (``DataParallelMeshDims``, ours or
            torch's), when the parameters are already DTensors on the whole mesh,
            ``Replicate()`` on those axes; sharding them takes an extension (shardkit.tp).

    Returns:
        The same module(s), now also instances of ``FSDPModule``.
    """
    modules = tuple(module) if isinstance(module, list) else (module,)
    _check_modules(modules)
    mesh = mesh if mesh is not None else default_mesh()
    if dp_mesh_dims is not None:
        mesh_info = spmd_mesh_info(mesh, dp_mesh_dims)
    else:
        mesh_info = mesh_info_for(mesh)
    options = GroupOptions(
        reshard_after_forward=validate_reshard_after_forward(reshard_after_forward, mesh_info),
        reshard_after_forward_is_default=reshard_after_forward is None,
    )
    managed = collect_params(modules, set(ignored_params or ()), shard_placement_fn, mesh_info)
    check_hooked_params(managed, options.reshard_after_forward, type(modules[0]).__name__)
    group = _build_group(managed, modules, mesh_info, mp_policy, offload_policy, options)
    # Nothing above changed the modules; from here on it cannot fail on user input.
    _move_buffers(modules, mesh_info, set(ignored_params or ()))
    if group is not None:
        for p in group.params:
            p.register(unsharded=False)
        mark_owned(group.params, type(modules[0]).__name__)
    state = FSDPState(modules, group, mp_policy, mesh_info.device)
    for m in modules:
        register_state(m, state)
        m.__class__ = _fsdp_class(type(m))
    fsdp_modules: list[FSDPModule] = [m for m in modules if isinstance(m, FSDPModule)]
    return fsdp_modules if isinstance(module, list) else fsdp_modules[0]


def _check_modules(modules: tuple[nn.Module, ...]) -> None:
    for m in modules:
        name = type(m).__name__
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects nn.Module(s), got {type(m).__name__}")
        if is_managed(m):
            raise FullyShardUsageError(
                "fully_shard has already been applied to the following module: "
                f"{name}; apply it once per module"
            )
        if _managed_by_torch_fsdp(m):
            raise ValueError(f"{name} is already managed by torch's FSDP; apply one FSDP only")
        if type(m).forward is nn.Module.forward:
            raise ValueError(
                "fully_shard does not support containers that do not implement forward: "
                f"{name} has no forward; apply fully_shard to the modules inside it"
            )


def _managed_by_torch_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, TorchFSDPModule | FullyShardedDataParallel) for m in module.modules())


def _build_group(
    managed: list[FSDPParam],
    modules: tuple[nn.Module, ...],
    mesh_info: MeshInfo,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    options: GroupOptions,
) -> FSDPParamGroup | None:
    if not managed:
        return None
    config = GroupConfig(modules, mesh_info, mp_policy, offload_policy)
    return FSDPParamGroup(managed, config, options)


def _move_buffers(
    modules: Iterable[nn.Module], mesh_info: MeshInfo, ignored: set[nn.Parameter]
) -> None:
    device = mesh_info.device
    for m in modules:
        for sub in m.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and not buf.is_meta and buf.device != device:
                    sub._buffers[name] = buf.to(device)


def _fsdp_class(cls: type[nn.Module]) -> type[nn.Module]:
    if issubclass(cls, FSDPModule):
        return cls
    fsdp_cls = _FSDP_CLASSES.get(cls)
    if fsdp_cls is None:
        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _FSDP_CLASSES[cls] = fsdp_cls
    return fsdp_cls


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run FSDP's pre/post-forward logic around ``module.<method_name>`` (e.g. ``generate``)."""
    if not isinstance(module, FSDPModule):
        return
    state = state_of(module)
    original = getattr(type(module), method_name)

    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(self, args, kwargs)
        out = original(self, *args, **kwargs)
        return state._post_forward(self, args, out)

    setattr(module, method_name, MethodType(wrapped, module))
