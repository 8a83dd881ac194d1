"""The step's operations on the engine's groups: what ``schedule.StepDriver`` runs.

The driver decides which operation comes at which hook, for the engine and the planner alike;
this is the engine's side of it, a thin layer over ``FSDPParamGroup``'s methods and the
root's communication context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from shardkit.core import observe
from shardkit.core.engine.comm_context import CommContext
from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.group_options import GroupOptions
from shardkit.core.engine.param import FSDPParam
from shardkit.core.engine.profiler_ranges import fsdp_range
from shardkit.core.engine.step_trace import StepTrace
from shardkit.core.state_machines import TrainingState
from shardkit.core.step_protocols import AfterForward
from shardkit.core.torch_release import ACCUMULATES_IN_GRAD_DTYPE

__all__ = ["EngineOps", "TakenGrads"]

TakenGrads = list[tuple[FSDPParam, torch.Tensor | None]]
"""A group's gradients taken for its reduction (None: zeros), as ``take_grads`` gives them."""


class EngineOps:
    """``step_protocols.StepOps`` on one root's groups, sharing its communication context."""

    def __init__(
        self, comm: CommContext, groups: Sequence[FSDPParamGroup], device: torch.device
    ) -> None:
        """Operate on a root's ``groups``, whose reductions queue in ``comm``.

        ``device``: the root's, where the host's copies to and from pinned memory are queued.
        """
        self.comm = comm
        self._pins_memory = any(g.pin_memory for g in groups)
        self._device = device
        self.trace: StepTrace | None = None
        """Where this iteration's events are recorded, while a ``Join`` is active (``join``)."""

    def settings(self, group: FSDPParamGroup) -> GroupOptions:
        """The group's runtime switches (``FSDPModule.set_*``)."""
        return group.options

    def state(self, group: FSDPParamGroup) -> TrainingState:
        """The group's training state."""
        return group.training_state

    def set_state(self, group: FSDPParamGroup, state: TrainingState) -> None:
        """Move the group to ``state`` (the group checks the transition)."""
        group.training_state = state

    def event(self, what: str, group: FSDPParamGroup) -> None:
        """Tell observers, if any (building the event costs a step's time otherwise)."""
        if self.trace is not None:
            self.trace.record(what, group)
        if observe.has_subscribers():
            observe.emit(observe.StateTransitionEvent(group.fqn, what))

    def name(self, group: FSDPParamGroup) -> str:
        """The group's FQN as the root names it."""
        return group.fqn

    def profiled(
        self, label: str, group: FSDPParamGroup | None = None
    ) -> AbstractContextManager[object]:
        """The profiler range torch names for ``label`` of ``group``, while a profiler records."""
        return fsdp_range(label, group.torch_fqn if group is not None else "")

    def run_step(
        self, name: str, group: FSDPParamGroup, step: Callable[[], None], *args: object
    ) -> None:
        """``step``, or what a tool replaced it with through the torch-facing view."""
        group.replaced.run(name, step, *args)

    def unshard(self, group: FSDPParamGroup, *, prefetch: bool = False) -> None:
        """Issue the group's all-gather."""
        group.unshard()

    def wait(self, group: FSDPParamGroup) -> None:
        """Finish its all-gather and register its full parameters.

        In its pre-backward, then, as torch 2.15 on: autograd's gradients keep their dtype
        where nothing accumulates them. See [Note: post-backward trigger].
        """
        group.wait_for_unshard()
        # Before torch 2.15 nothing is deferred: no walk over the parameters on this hot path.
        if ACCUMULATES_IN_GRAD_DTYPE and group.training_state is TrainingState.PRE_BACKWARD:
            reducing = group.options.reduce_grads
            for p in group.params:
                p.grad_accumulation.defer_upcast(p.unsharded_param, reducing)

    def is_unsharded(self, group: FSDPParamGroup) -> bool:
        """Whether its full parameters are in, or being gathered."""
        return group.is_unsharded

    def reshard(self, group: FSDPParamGroup) -> None:
        """Free its full parameters and register the shards."""
        group.reshard()

    def free_after_forward(self, group: FSDPParamGroup, action: AfterForward) -> None:
        """Free or slice its full parameters, unless freeing them would free nothing."""
        if _stays_unsharded(group):
            return
        if action is AfterForward.FREE:
            group.reshard()
        else:
            group.reshard_post_forward()

    def keep_idle_buffers(self, keep: bool) -> None:
        """The shared pool keeps idle buffers for the next group (forward) or gives them back."""
        pool = self.comm.pool
        pool.retain = keep
        if not keep:
            pool.clear()

    def holds_grads(self, group: FSDPParamGroup) -> bool:
        """Whether a full parameter holds a gradient nobody took."""
        return group.holds_grads()

    def cover_missing_grads(self, group: FSDPParamGroup) -> None:
        """Zeros for the gradients this rank lacks, so that the group's reduction is issued.

        Where its reducer fills missing gradients with zeros (the step check on), the group
        counts as run with gradients even where this rank never ran the module; ``None`` goes
        back where no rank used a parameter (``reduce.unused``). With the step check off,
        torch's switch is set at every reduction (sizes must agree, whatever a recursive
        setter last said), and one zero gradient stands in where none came: the zeros stay.
        """
        if group.reducer.reduces_zeros():
            group.ran_forward_with_grad = True
        elif group.mesh_info.shard_size * group.mesh_info.replicate_size > 1:
            group.options.reduce_scatter_unused_params = True
            if group.options.reduce_grads and not group.holds_grads():
                _stand_in_zero_grad(group)

    def take_grads(self, group: FSDPParamGroup) -> TakenGrads | None:
        """The gradients to reduce, taken off the full parameters (see ``take_grads``)."""
        grads = group.take_grads()
        if self.trace is not None:
            self.trace.took(group, grads)
        return grads

    def reductions_in_flight(self) -> int:
        """Reductions queued in the shared context."""
        return len(self.comm.pending_reduces)

    def finish_oldest_reduction(self) -> None:
        """Finish the oldest reduction (nothing keeps it alive after)."""
        self.comm.finish_oldest()

    def start_reduction(self, group: FSDPParamGroup, grads: object, *, assign_now: bool) -> None:
        """Issue the group's reduction of what ``take_grads`` took."""
        assert isinstance(grads, list)
        group.start_reduction(grads, assign_now=assign_now)

    def finish_reductions(self) -> None:
        """Finish every reduction, then wait for the host copies of offloaded groups.

        The gradients copied back, and the shards copied to the device, are what the optimizer
        step is about to read and write. See [Note: gpu schedule] (CPU offload).
        """
        comm = self.comm
        comm.finish_all()
        if self._pins_memory:
            comm.host_copies.record(self._device)  # after every copy this backward queued
        comm.host_copies.wait()


def _stays_unsharded(group: FSDPParamGroup) -> bool:
    """Whether a group keeps its full parameters from forward to backward whatever its policy.

    A group whose full parameters view its shards (one shard rank, nothing to cast or move)
    frees nothing by resharding: after a forward that backward will follow, resharding would
    only register the DTensors for backward's pre-hook to register the full ones again (at
    W=1 on a model of many small groups, a tenth of the engine's overhead). Backward's end
    reshards it, and a forward without gradients reshards it as any group.
    """
    return group.plan.aliases_shards and torch.is_grad_enabled()


def _stand_in_zero_grad(group: FSDPParamGroup) -> None:
    """One zero gradient, so that a group no rank's backward reached here is still reduced.

    The reducer packs every trainable parameter (zeros for those with none) once one has a
    gradient; with none it would skip the reduction the other ranks issue.
    """
    for p in group.params:
        param = p.unsharded_param
        if p.requires_grad and param is not None:
            param.grad = torch.zeros_like(param)
            return
