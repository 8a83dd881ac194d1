"""The methods ``fully_shard`` adds to a module: ``FSDPModule`` (its handles: ``fsdp_handles``).

A sharded module's class becomes ``FSDP<Cls>``, a subclass of ``FSDPModule`` and its own
class (``api.fully_shard`` makes the swap). The methods act on the module's parameter groups
and options; they validate their arguments before changing anything. Its overrides of
``nn.Module``'s construction, ``_apply`` and ``load_state_dict`` run ``module_overrides``.

The checks and effects of its communication switches (custom collectives, the all-reduce
hook, the reduction's precision, reductions in flight) are ``comm_switches``' functions.

Next to split off: the gradient-division and sync switches (``set_gradient_divide_factor``,
``set_reduce_scatter_divide_factor``, ``set_force_sum_reduction_for_comms``,
``set_requires_gradient_sync``, ``set_requires_all_reduce``) into ``reduce_switches.py``,
functions on the groups as ``comm_switches`` has: each only validates and sets a group option.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.core import comm_switches
from shardkit.core.engine import join
from shardkit.core.engine.conditional import mark_conditional
from shardkit.core.engine.finalization import (
    finalize_backward,
    set_manual_finalization,
    wait_for_gradient_reduction,
)
from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.offthread import claim_training_thread
from shardkit.core.engine.state_registry import state_of, states_under
from shardkit.core.errors import UnsupportedCopyError
from shardkit.core.fsdp_handles import GradientReductionHandle, UnshardHandle
from shardkit.core.module_overrides import apply_resharded, load_all_or_nothing, new_plain_module
from shardkit.core.reduce_precision import ReducePrecision
from shardkit.core.runtime.groups import group_ranks, subgroup_of

__all__ = ["FSDPModule", "GradientReductionHandle", "UnshardHandle"]


class FSDPModule:
    """Methods that ``fully_shard`` adds to a module (by swapping in an ``FSDP<Cls>`` class)."""

    _join_config = join.NO_JOIN  # torch's ``Join`` sets its own on the module it is given

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Build the original class: a new module is not sharded, whatever built it.

        Code that makes a module of its own type (``model[:2]`` on a Sequential builds
        ``type(self)(...)``) gets a plain module, not an FSDP class with no FSDP state.
        """
        return new_plain_module(cls, FSDPModule, args, kwargs)

    def _groups_under(self, recurse: bool) -> list[FSDPParamGroup]:
        assert isinstance(self, nn.Module)
        states = states_under(self) if recurse else [state_of(self)]
        return [g for s in states for g in s.groups]

    def _own_groups(self) -> tuple[FSDPParamGroup, ...]:
        assert isinstance(self, nn.Module)
        return state_of(self).groups

    def _only_group(self, setting: str) -> tuple[FSDPParamGroup, ...]:
        if len(groups := self._own_groups()) > 1:  # as torch: which mesh's group is meant?
            raise ValueError(
                f"{setting} is not supported with multiple param groups (from per-param mesh "
                f"via shard_placement_fn): {type(self).__name__} has {len(groups)}"
            )
        return groups

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's parameters (not its children's); async returns a handle."""
        assert isinstance(self, nn.Module)
        state = state_of(self)
        state.lazy_init(provisional=True)
        assert state.ctx is not None
        claim_training_thread(state.ctx)  # its full parameters: other threads copy the shards
        for group in state.groups:
            group.unshard()
        handle = UnshardHandle(state.groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's full parameters and register the sharded ones."""
        for group in self._own_groups():
            group.reshard()

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward or backward (call on the root)."""
        assert isinstance(self, nn.Module)
        state = state_of(self)
        if not state.is_root:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        state.reset_iter_state()

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """True: backwards finish nothing at their end; :meth:`finalize_backward` does.

        Called on the root, as torch 2.15's. See [Note: torch-facing view].

        Raises:
            RuntimeError: not the root, or the mode would change once backward started.
        """
        assert isinstance(self, nn.Module)
        set_manual_finalization(state_of(self), enabled)

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """End the backward iteration under manual finalization (torch 2.15's API).

        Gradients nobody reduced are reduced, every reduction finished, groups resharded as
        set; a no-op before the first forward. With ``async_op=True`` the reductions are left
        in flight: the returned handle's ``wait()`` finishes them (before the gradients are
        used, or more work starts on this root).

        Raises:
            RuntimeError: not the root, manual finalization is off, a backward is running, or
                the previous handle was not waited on.
        """
        assert isinstance(self, nn.Module)
        state = state_of(self)
        finalize_backward(state, wait=not async_op)
        if not async_op:
            return None
        return GradientReductionHandle(lambda: wait_for_gradient_reduction(state))

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

    def set_conditional(self, conditional: bool, *, recurse: bool = True) -> None:
        """True: this module may be skipped on some ranks, or run in another order than on others.

        Its gathers and reduction are then issued by the root's hooks, which every rank runs,
        in one order on every rank; its gradient is the mean over ranks of each rank's own
        (zeros where it did not run). Call before the first forward, not on the root. See
        ``engine/conditional`` for the schedule and its costs.
        """
        mark_conditional(self._groups_under(recurse), conditional, type(self).__name__)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Let up to ``max_input_buffers`` gradient reductions be in flight at once.

        1 (the default) finishes a group's reduction before the next group allocates its
        send buffer; more lets communication run behind more of backward, at the cost of
        that many send buffers alive at backward's memory peak.
        """
        comm_switches.set_max_input_buffers(self._groups_under(recurse), max_input_buffers)

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
        user-run all-reduce across other ranks goes here. The hook runs with ``stream`` as
        the current stream (a ``torch.cuda.Stream``, or a ``torch.cpu.Stream`` on CPU),
        ordered after the reduction and before the gradients' use; None runs it on the
        current stream. ``stream`` is refused with native HSDP, as torch refuses it (the
        hook then runs where the all-reduce across replicas ran).

        Raises:
            ValueError: ``stream`` is given for a module on an HSDP mesh.
        """
        groups = self._only_group("set_all_reduce_hook")
        comm_switches.set_all_reduce_hook(groups, hook, stream, type(self).__name__)

    def set_custom_all_gather(self, comm: Any) -> None:
        """Gather this module's parameters with ``comm`` (torch's ``AllGather`` interface).

        ``comm.allocate(size, dtype=, device=)`` makes the output buffer and
        ``comm(output, input, group, async_op=)`` runs the gather of the flat uint8 shards.
        """
        for group in self._only_group("set_custom_all_gather"):
            group.options.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce this module's gradients with ``comm`` (torch's ``ReduceScatter`` interface).

        ``comm.allocate`` makes the input and output buffers and
        ``comm(output, input, group, op, async_op=)`` sums the (W * S) input into each rank's
        S elements.
        """
        comm_switches.set_custom_reduce_scatter(self._only_group("set_custom_reduce_scatter"), comm)

    def set_custom_all_reduce(
        self, comm: Callable[[torch.Tensor, dist.ProcessGroup], None] | None
    ) -> None:
        """All-reduce this module's gradients across replicas with ``comm`` (shardkit's own).

        With HSDP or a replicate-only mesh, ``comm(tensor, group)`` runs where the engine's
        all-reduce over the replicate ``group`` would: it must leave the sum over ``group`` in
        ``tensor``, in place, before it returns. The engine then divides as its own all-reduce
        would have (a mean over the replicas, or the factor of
        ``set_gradient_divide_factor``), and the all-reduce hook runs as before. torch has no
        such setting; FSDP1's ``NO_SHARD`` communication hooks need one. None goes back to the
        engine's all-reduce.

        Raises:
            ValueError: the module's group has no replicate axis (nothing would call ``comm``),
                or it compresses its reduction (``set_reduce_precision``).
        """
        groups = self._only_group("set_custom_all_reduce")
        comm_switches.set_custom_all_reduce(groups, comm, type(self).__name__)

    def set_reduce_precision(self, policy: ReducePrecision | None, *, recurse: bool = True) -> None:
        """How gradients travel and are summed (shardkit's own: torch has no such setting).

        ``ReducePrecision(wire_dtype=torch.bfloat16)`` sends bfloat16 and sums in float32 once,
        on the shard's owner; None goes back to torch's way (``reduce_dtype`` end to end).
        Every group is checked before any changes. See [Note: precision-aware reduction].

        Raises:
            TypeError: a parameter whose gradient is not floating point.
            ValueError: a group with a custom reduce-scatter or all-reduce.
        """
        comm_switches.set_reduce_precision(self._groups_under(recurse), policy)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for compatibility; communication buffers come from shardkit's own pool.

        On gloo there is no process-group allocator to use; on NCCL the pool's buffers are
        reused across groups and steps, which is what this option is for. Refused after
        ``set_custom_all_gather``, as torch refuses it (``AssertionError``).
        """
        comm_switches.check_process_group_allocation(self._groups_under(False), type(self).__name__)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted for compatibility; symmetric-memory all-gathers are not used.

        Raises:
            ValueError: ``backend`` is not ``"NCCL"`` (torch's only backend too).
        """
        if backend != "NCCL":
            raise ValueError(f"only the NCCL symmetric memory backend exists, got {backend!r}")

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Keep the full parameters' memory when resharding (torch 2.15's).

        A reshard then registers the sharded parameters but frees nothing, and the next
        unshard gathers into the same memory: the full parameters keep their data pointers
        (what CUDA graph capture needs), at the cost of holding them. False frees them again
        from the next reshard on.
        """
        for group in self._groups_under(recurse):
            group.options.keep_unsharded_storage = bool(keep)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change whether full parameters are freed after forward."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError("set_reshard_after_forward takes a bool")
        for group in self._groups_under(recurse):
            group.options.set_reshard_after_forward(reshard_after_forward)

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
        targets: list[FSDPParamGroup] = []
        for module in modules:
            if not isinstance(module, FSDPModule) or not isinstance(module, nn.Module):
                raise ValueError(f"prefetch targets must be FSDP modules, got {type(module)}")
            # A target's every group, in the order this pass reaches them (as torch's).
            groups = state_of(module).groups
            targets.extend(groups if forward else reversed(groups))
        for group in self._own_groups():
            if forward:
                group.options.forward_prefetch = targets
            else:
                group.options.backward_prefetch = targets

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide summed gradients by ``factor`` instead of the data-parallel world size."""
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        for group in self._own_groups():
            group.options.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Whether the collectives may only sum (True), the division then running after them.

        After an all-reduce hook too, which then sees sums. False (default): fp32 and bf16
        gradients are divided inside the collectives, with no kernel of their own.
        """
        for group in self._own_groups():
            group.options.force_sum_reduction = bool(enable)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: do not gather this module's parameters for backward (unused there)."""
        for group in self._own_groups():
            group.options.unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted for compatibility: collectives are ordered after the optimizer already."""

    def join_hook(self, **kwargs: Any) -> join.FSDPJoinHook:
        """Uneven inputs under torch's ``Join([root], optimizer=...)`` (see ``engine/join``)."""
        return join.join_hook(self, **kwargs)

    @property
    def join_device(self) -> torch.device:
        """Where ``Join`` all-reduces its counts: the root's device."""
        return join.join_device(self)

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The group ``Join`` counts ranks on: every rank of the root's mesh."""
        return join.join_process_group(self)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        assert isinstance(self, nn.Module)
        return apply_resharded(self, self._groups_under(recurse=True), fn, recurse)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load all of ``state_dict`` or nothing: every value is checked before any write.

        Sharded parameters accept DTensors (the sharded state dict) or plain full tensors
        (each rank keeps its own shard). Other dtypes are converted, as torch's
        ``load_state_dict`` does (bf16 weights into an fp32 model). One error lists every
        missing, unexpected or wrongly shaped key and every value that cannot be copied (a
        meta tensor, a DTensor on another mesh or with another shard shape), and leaves the
        module exactly as it was.

        Collective over the ranks of the module's meshes when there are several: every one
        of them must call it (as with torch's DCP). They agree on the checks before anything
        is written (one all-gather of 8 bytes per rank), so a value bad on one rank only
        raises the same error on every rank and no rank loads. See [Note: agreed loads].
        """
        assert isinstance(self, nn.Module)
        groups = self._groups_under(recurse=True)
        return load_all_or_nothing(self, groups, state_dict, strict=strict, assign=assign)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise UnsupportedCopyError(
            "FSDP does not support deepcopy. Please use state dict for serialization. "
            f"({type(self).__name__}: deep-copy the model before fully_shard, or load a copy "
            "through model.state_dict())"
        )
