"""A group's upkeep when its parameters change under it: the plan made again, buffers moved.

A dtype move (``model.to(dtype)``), new local storage (``_apply``, ``assign=True`` loads) and
all-gather hooks attached after ``fully_shard`` (or whose sizes are learnt at their first
call) each call for a new plan of the same parameters. ``GroupUpkeep`` makes it, lets the
buffers, the parameters' dtypes, the pool's sizes and the reducer follow, and copies the
values back: the parts of ``FSDPParamGroup`` that change its plan. See [Note: flat group
buffers] and [Note: all-gather extensions].
"""

from __future__ import annotations

from dataclasses import replace

import torch

from shardkit.core.engine.comm_context import CommContext
from shardkit.core.engine.group.plan import GroupConfig, GroupPlan, plan_group
from shardkit.core.engine.group.storage import GroupStorage
from shardkit.core.engine.group_options import GroupOptions
from shardkit.core.engine.mesh_info import MeshInfo
from shardkit.core.engine.param import FSDPParam
from shardkit.core.engine.reduce import GroupReducer
from shardkit.core.state_machines import ShardedState

__all__ = ["GroupUpkeep"]


class GroupUpkeep:
    """Re-planning for ``FSDPParamGroup``, which holds the state below and the three hooks."""

    params: list[FSDPParam]
    plan: GroupPlan
    reducer: GroupReducer
    options: GroupOptions
    mesh_info: MeshInfo
    comm: CommContext | None
    fqn: str
    sharded_state: ShardedState
    registered_unsharded: bool
    grads_in_flat_layout: bool
    _config: GroupConfig
    _storage: GroupStorage

    # The group's own operations, which ``FSDPParamGroup`` defines (called from here).
    def reshard(self) -> None:
        """Free the full parameters and register the sharded ones."""
        raise NotImplementedError

    def attach_comm(self, comm: CommContext) -> None:
        """Use ``comm`` for the group's collectives and tell its pool the buffer sizes."""
        raise NotImplementedError

    def _register(self, *, unsharded: bool) -> None:
        raise NotImplementedError

    def _plan_buffers(self) -> None:
        """Plan anew for the parameters' current dtypes and hooks, and a new reducer."""
        self._replan()
        self.reducer = self._new_reducer()

    def _replan(self) -> None:
        """Replace the plan with one of the parameters as they are now; buffers follow it."""
        before = self.plan
        self.plan = plan_group(self.params, self._config, self.options.reshard_after_forward)
        self._storage.replanned(before, self.plan)
        self._follow_plan()

    def _follow_plan(self) -> None:
        in_param_dtype = self.options.unsynced_grads_in_param_dtype
        reduce_dtype = self._config.mp_policy.reduce_dtype
        for p, param_layout in zip(self.params, self.plan.layout.params, strict=True):
            comm_dtype = param_layout.comm_dtype
            accumulate = comm_dtype if in_param_dtype else self.plan.reduce_dtype
            policy, any_dtype = p.grad_policy, False
            if policy.explicit and reduce_dtype is None and not in_param_dtype:
                # The grad_dtype its user set (None: any; planned as the computed dtype).
                accumulate = comm_dtype if policy.dtype is None else policy.dtype
                any_dtype = policy.dtype is None
            p.follow_plan_dtypes(comm_dtype, accumulate, any_dtype=any_dtype)
        if self.comm is not None:
            self.attach_comm(self.comm)  # the pool learns the new sizes

    def _new_reducer(self) -> GroupReducer:
        plan = self.plan
        reducer = GroupReducer(
            plan.reduce_dtype, self.mesh_info, self.options, (plan.offload, plan.pin_memory)
        )
        if self.grads_in_flat_layout:
            reducer.flat_layout(self.params, plan.layout)
        return reducer

    def accumulate_unsynced_in_param_dtype(self, enabled: bool) -> None:
        """Accumulate gradients without sync in the compute dtype (True) or the reduce dtype."""
        self.options.unsynced_grads_in_param_dtype = enabled
        self._follow_plan()

    def reduce_in_flat_layout(self) -> None:
        """Land reductions in the sharded buffer's layout from now on (one dtype, no hooks).

        For ``layout.GroupView.flat_grad``: the layout survives replanning (a dtype change).
        """
        self.grads_in_flat_layout = True
        self.reducer.flat_layout(self.params, self.plan.layout)

    def resync_sharded_storage(self) -> None:
        """Re-adopt the registered sharded tensors after ``_apply`` or ``assign=True`` loads.

        Those replace a parameter's local tensor with new storage; the group copies the values
        back into one flat buffer (on their new device) and re-points every DTensor at it.
        """
        # A grad_dtype set on a sharded parameter (before lazy init, as torch allows) counts.
        policies = [replace(p.grad_policy) for p in self.params]  # copies
        for p in self.params:
            p.take_grad_policy()
        locals_ = [p.current_local() for p in self.params]
        for p in self.params:  # _apply swaps new tensors in, without it
            p.grad_policy.put_on(p.sharded_param)
        new_policy = policies != [p.grad_policy for p in self.params]
        if any(t.is_meta for t in locals_):
            return
        self._storage.adopt_hooked(self.plan, locals_)
        device = torch.device("cpu") if self.plan.offload else locals_[0].device
        retyped = any(t.dtype != p.orig_dtype for t, p in zip(locals_, self.params, strict=True))
        if self._storage.holds(self.plan, locals_, device) and not retyped:
            if new_policy:
                self._plan_buffers()  # the reduce dtype may be another
            return
        self.reshard()  # any full copy predates the new values
        if retyped:
            # model.to(dtype), .double(), .half(): the buffers follow the new dtypes.
            for p, local in zip(self.params, locals_, strict=True):
                p.retype(local.dtype)
            self._plan_buffers()
        self._storage.refill(self.plan, locals_, device)

    def take_up_new_hooks(self) -> None:
        """Gather through the all-gather hooks that local tensors gained since the last look.

        torch's ``fully_shard`` looks for the hooks at every all-gather, so hooks attached
        after it (on the local tensor, or on its class) take effect at the next one; so here,
        at each unshard and each root forward (before the one-rank shortcuts that gather
        nothing). Those parameters leave the flat buffer, and the group is laid out anew.
        See [Note: all-gather extensions].
        """
        if self.sharded_state is not ShardedState.SHARDED:
            return
        gained = [self.params[i] for i in self.plan.flat if self.params[i].gained_hooks()]
        if not gained:
            return
        if self.registered_unsharded:
            self._register(unsharded=False)
        for p in gained:
            p.take_up_hooks()
        self._plan_buffers()
        locals_ = [p.current_local() for p in self.params]
        self._storage.refill(self.plan, locals_, self._storage.sharded_buffer.device)

    def _hook_inputs(self) -> dict[int, list[torch.Tensor]]:
        """What the pre-all-gather hooks send, by parameter index (flat tensors)."""
        if self.plan.hooks is None:
            return {}
        sent = self.plan.hooks.pre_all_gather(self.fqn)
        if self.plan.layout.hooks_pending:
            # The hooks' sizes are known now (their first call): lay the all-gather out once.
            self._replan()
        return sent
