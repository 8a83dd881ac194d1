"""A group's upkeep when its parameters change under it: the plan made again, buffers moved.

A dtype move (``model.to(dtype)``), new local storage (``_apply``, ``assign=True`` loads) and
all-gather hooks attached after ``fully_shard`` (or whose sizes are learnt at their first
call) each call for a new plan of the same parameters. ``GroupUpkeep`` makes it, lets the
buffers, the parameters' dtypes, the pool's sizes and the reducer follow, and copies the
values back: the parts of ``FSDPParamGroup`` that change its plan. The group holds one, made
with the config its plans come from and the storage that follows them, and hands itself
(``ReplannedGroup``: what re-planning reads and sets of it) to each call. See [Note: flat
group buffers] and [Note: all-gather extensions].
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from shardkit.core.engine.comm_context import CommContext
from shardkit.core.engine.grad_dtype_policy import take_grad_policy
from shardkit.core.engine.group.plan import GroupConfig, GroupPlan, plan_group
from shardkit.core.engine.group.storage import GroupStorage
from shardkit.core.engine.group_options import GroupOptions
from shardkit.core.engine.mesh_info import MeshInfo
from shardkit.core.engine.param import FSDPParam
from shardkit.core.engine.reduce import GroupReducer
from shardkit.core.state_machines import ShardedState

__all__ = ["GroupUpkeep", "ReplannedGroup"]


class ReplannedGroup(Protocol):
    """What re-planning reads and sets of a group (``FSDPParamGroup``), and the three calls."""

    params: list[FSDPParam]
    plan: GroupPlan
    reducer: GroupReducer
    options: GroupOptions
    mesh_info: MeshInfo
    comm: CommContext | None
    fqn: str
    sharded_state: ShardedState
    grads_in_flat_layout: bool

    def reshard(self) -> None:
        """Free the full parameters and register the sharded ones."""

    def attach_comm(self, comm: CommContext) -> None:
        """Use ``comm`` for the group's collectives and tell its pool the buffer sizes."""

    def register_sharded_for_state_dict(self) -> None:
        """Register the sharded parameters where the full ones are, freeing nothing."""


class GroupUpkeep:
    """Re-planning for one ``FSDPParamGroup``, which passes itself to each call."""

    def __init__(self, config: GroupConfig, storage: GroupStorage) -> None:
        """Re-plan from ``config`` (the group's), moving the group's buffers in ``storage``."""
        self._config = config
        self._storage = storage

    def _plan_buffers(self, group: ReplannedGroup) -> None:
        """Plan anew for the parameters' current dtypes and hooks, and a new reducer."""
        self._replan(group)
        group.reducer = self.new_reducer(group)

    def _replan(self, group: ReplannedGroup) -> None:
        """Replace the plan with one of the parameters as they are now; buffers follow it."""
        before = group.plan
        group.plan = plan_group(group.params, self._config, group.options.reshard_after_forward)
        self._storage.replanned(before, group.plan)
        self.follow_plan(group)

    def follow_plan(self, group: ReplannedGroup) -> None:
        """Give the parameters the plan's dtypes, and the pool its sizes (once attached)."""
        in_param_dtype = group.options.unsynced_grads_in_param_dtype
        reduce_dtype = self._config.mp_policy.reduce_dtype
        for p, param_layout in zip(group.params, group.plan.layout.params, strict=True):
            comm_dtype = param_layout.comm_dtype
            accumulate = comm_dtype if in_param_dtype else group.plan.reduce_dtype
            policy, any_dtype = p.grad_policy, False
            if policy.explicit and reduce_dtype is None and not in_param_dtype:
                # The grad_dtype its user set (None: any; planned as the computed dtype).
                accumulate = comm_dtype if policy.dtype is None else policy.dtype
                any_dtype = policy.dtype is None
            p.follow_plan_dtypes(comm_dtype, accumulate, any_dtype=any_dtype)
        if group.comm is not None:
            group.attach_comm(group.comm)  # the pool learns the new sizes

    def new_reducer(self, group: ReplannedGroup) -> GroupReducer:
        """A reducer for the group's plan as it is now (in the flat layout, where asked)."""
        plan = group.plan
        reducer = GroupReducer(
            plan.reduce_dtype, group.mesh_info, group.options, (plan.offload, plan.pin_memory)
        )
        if group.grads_in_flat_layout:
            reducer.flat_layout(group.params, plan.layout)
        return reducer

    def accumulate_unsynced_in_param_dtype(self, group: ReplannedGroup, enabled: bool) -> None:
        """Accumulate gradients without sync in the compute dtype (True) or the reduce dtype."""
        group.options.unsynced_grads_in_param_dtype = enabled
        self.follow_plan(group)

    def reduce_in_flat_layout(self, group: ReplannedGroup) -> None:
        """Land reductions in the sharded buffer's layout from now on (one dtype, no hooks).

        For ``layout.GroupView.flat_grad``: the layout survives replanning (a dtype change).
        """
        group.grads_in_flat_layout = True
        group.reducer.flat_layout(group.params, group.plan.layout)

    def resync_sharded_storage(self, group: ReplannedGroup) -> None:
        """Re-adopt the registered sharded tensors after ``_apply`` or ``assign=True`` loads.

        Those replace a parameter's local tensor with new storage; the group copies the values
        back into one flat buffer (on their new device) and re-points every DTensor at it.
        """
        # A grad_dtype set on a sharded parameter (before lazy init, as torch allows) counts.
        policies = [replace(p.grad_policy) for p in group.params]  # copies
        for p in group.params:
            take_grad_policy(p)
        locals_ = [p.current_local() for p in group.params]
        for p in group.params:  # _apply swaps new tensors in, without it
            p.grad_policy.put_on(p.sharded_param)
        new_policy = policies != [p.grad_policy for p in group.params]
        if any(t.is_meta for t in locals_):
            return
        self._storage.adopt_hooked(group.plan, locals_)
        device = torch.device("cpu") if group.plan.offload else locals_[0].device
        retyped = any(t.dtype != p.orig_dtype for t, p in zip(locals_, group.params, strict=True))
        if self._storage.holds(group.plan, locals_, device) and not retyped:
            if new_policy:
                self._plan_buffers(group)  # the reduce dtype may be another
            return
        group.reshard()  # any full copy predates the new values
        if retyped:
            # model.to(dtype), .double(), .half(): the buffers follow the new dtypes.
            for p, local in zip(group.params, locals_, strict=True):
                p.retype(local.dtype)
            self._plan_buffers(group)
        self._storage.refill(group.plan, locals_, device)

    def take_up_new_hooks(self, group: ReplannedGroup) -> None:
        """Gather through the all-gather hooks that local tensors gained since the last look.

        torch's ``fully_shard`` looks for the hooks at every all-gather, so hooks attached
        after it (on the local tensor, or on its class) take effect at the next one; so here,
        at each unshard and each root forward (before the one-rank shortcuts that gather
        nothing). Those parameters leave the flat buffer, and the group is laid out anew.
        See [Note: all-gather extensions].
        """
        if group.sharded_state is not ShardedState.SHARDED:
            return
        gained = [group.params[i] for i in group.plan.flat if group.params[i].gained_hooks()]
        if not gained:
            return
        group.register_sharded_for_state_dict()  # the sharded ones, where the full were
        for p in gained:
            p.take_up_hooks()
        self._plan_buffers(group)
        locals_ = [p.current_local() for p in group.params]
        self._storage.refill(group.plan, locals_, self._storage.sharded_buffer.device)

    def hook_inputs(self, group: ReplannedGroup) -> dict[int, list[torch.Tensor]]:
        """What the pre-all-gather hooks send, by parameter index (flat tensors)."""
        if group.plan.hooks is None:
            return {}
        sent = group.plan.hooks.pre_all_gather(group.fqn)
        if group.plan.layout.hooks_pending:
            # The hooks' sizes are known now (their first call): lay the all-gather out once.
            self._replan(group)
        return sent
