"""FSDPState: the hooks of one ``fully_shard`` call, and the root's lazy init.

The first state to run forward becomes the root: it collects every state in its module tree
into one RootContext, and queues the end-of-backward callback that finishes reductions.
RootContext itself, the default communication context and the names a root gives its
parameters are ``root_context``'s.

Its hooks on state dicts and loads are ``state_dict_hooks``'. Next to split off: the end of
backward (``_ensure_final_callback``, ``root_final_callback``, ``end_backward``,
``check_step_end``) into a module of its own beside ``backward``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, cast

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils import _pytree as pytree

from shardkit.core.engine.backward import BackwardTracker
from shardkit.core.engine.collectives_agree import check_step
from shardkit.core.engine.comm_context import CommContext
from shardkit.core.engine.conditional import new_driver
from shardkit.core.engine.forward_io import cast_floats, move_to
from shardkit.core.engine.group.param_group import FSDPParamGroup, GroupWiring
from shardkit.core.engine.join import notify as notify_join
from shardkit.core.engine.local_step import restore_all
from shardkit.core.engine.local_tree import enter_local_forward, is_local_tree
from shardkit.core.engine.offthread import claim_training_thread, install_step_marks
from shardkit.core.engine.replaceable_hooks import ForwardHooks
from shardkit.core.engine.root_context import RootContext, comm_context_for, name_from_root
from shardkit.core.engine.state_dict_hooks import register_state_dict_hooks
from shardkit.core.engine.state_registry import states_under
from shardkit.core.engine.step_ops import EngineOps
from shardkit.core.engine.usage_checks import (
    check_backward_finished,
    in_backward,
    refuse_second_root,
    warn_if_replaced_params_are_held,
)
from shardkit.core.errors import DesyncError
from shardkit.core.policies import MixedPrecisionPolicy
from shardkit.core.runtime.device import is_accelerator
from shardkit.core.runtime.dynamo import eager_hook
from shardkit.core.runtime.protocol import CollectiveRuntime
from shardkit.core.runtime.watch import step_check
from shardkit.core.runtime.watch.progress import PROGRESS
from shardkit.core.schedule import root_reshards_after_forward, watches_inputs
from shardkit.core.state_machines import ShardedState, TrainingState

__all__ = ["FSDPState"]

logger = logging.getLogger(__name__)


class FSDPState:
    """Forward/backward hooks for the module(s) of one ``fully_shard`` call."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        groups: tuple[FSDPParamGroup, ...],
        mp_policy: MixedPrecisionPolicy,
        device: torch.device,
    ) -> None:
        self.modules = modules
        # One group per mesh, in the order of their first parameters: usually one, several
        # where shard_placement_fn put parameters on meshes of their own (``placement``).
        # Every hook runs for each, in this order (backward's, in reverse). See
        # [Note: per-parameter meshes].
        self.groups = groups
        self.mp_policy = mp_policy
        self.device = device
        self.is_root: bool | None = None
        self.ctx: RootContext | None = None
        # Set by share_comm_ctx before the first forward: the communication context to use.
        self.shared_comm: CommContext | None = None
        self.fqn = ""
        # set_manual_backward_finalization's setting: read when a backward starts.
        self.manual_finalization = False
        self._forward_pending: set[int] = set()
        # Run eagerly under torch.compile, fullgraph=True included (see eager_hook).
        # Kept with their handles: a tool may swap them for wrappers (torch_view).
        self.forward_hooks = ForwardHooks(
            modules, eager_hook(self._pre_forward), eager_hook(self._post_forward)
        )
        register_state_dict_hooks(self, modules)

    # --- lazy init --------------------------------------------------------------------------

    def lazy_init(
        self, runtime: CollectiveRuntime | None = None, *, provisional: bool = False
    ) -> None:
        """Make this state the root of every state in its tree (first forward only).

        Args:
            runtime: the collective runtime every group under this root uses; default a
                ``ProcessGroupRuntime`` on c10d. Tests pass a recording one.
            provisional: for ``unshard()`` before any forward: a root that holds this state
                may take it over later (torch's ``unshard`` makes no root).
        """
        if self.is_root is not None:
            if not provisional and self.ctx is not None and self.is_root:
                self.ctx.provisional = False  # a forward through it: a root for good
            return
        root_module = self.modules[0]
        states = states_under(root_module)
        refuse_second_root(self, states, provisional=provisional)
        self.is_root = True
        comm = comm_context_for(runtime, self.shared_comm)
        groups = [g for s in states for g in s.groups]
        ops = EngineOps(comm, groups, self.device)
        driver = new_driver(ops, root_module, self.groups, groups, lambda: tracker)
        tracker = BackwardTracker(
            driver,
            self._ensure_final_callback,
            lambda: ctx.local,
            lambda: ctx.final_callback_queued,
        )
        ctx = RootContext(
            states=states, comm=comm, driver=driver, backward=tracker, provisional=provisional
        )
        names = {id(m): name for name, m in root_module.named_modules()}
        param_names = {id(p): name for name, p in root_module.named_parameters()}
        for state in states:
            if state is not self:
                state.is_root = False
            state.ctx = ctx
            state.fqn = ", ".join(names.get(id(m), "") or "<root>" for m in state.modules)
            for group in state.groups:
                fqns = [name_from_root(p, param_names, names) for p in group.params]
                wiring = GroupWiring(state.fqn, fqns, ctx.comm, tracker.grad_hook(group))
                group.attach(wiring)
                group.resync_sharded_storage()
        for group in self.groups:
            options = group.options
            options.reshard_after_forward = root_reshards_after_forward(
                options.reshard_after_forward, is_default=options.reshard_after_forward_is_default
            )
        self.ctx = ctx
        install_step_marks()
        warn_if_replaced_params_are_held(self.all_groups)
        PROGRESS.count_optimizer_steps()  # the step that hang reports and desync checks show

    @property
    def all_groups(self) -> list[FSDPParamGroup]:
        """Every parameter group under this root."""
        assert self.ctx is not None
        return [g for s in self.ctx.states for g in s.groups]

    @property
    def forward_pending(self) -> list[nn.Module]:
        """This call's modules whose forward has yet to run in the current pass."""
        return [m for m in self.modules if id(m) in self._forward_pending]

    # --- forward ----------------------------------------------------------------------------

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # A forward inside backward is activation checkpointing's recomputation. Outside one, a
        # group left in PRE_BACKWARD is what a failed backward leaves: the root says so below.
        # In a local tree's forward, the root did this group's work.
        recompute = in_backward() and self._gathered_for_recompute()
        nothing_to_do = self._in_local_forward() or recompute
        if not nothing_to_do:
            self.lazy_init()
            if self.is_root:
                self._root_pre_forward()
                if is_accelerator(self.device):
                    args, kwargs = move_to(args, kwargs, self.device)
            partial = bool(self.groups) and self._groups_pre_forward(module)
            for group in self.groups:
                assert self.ctx is not None
                if partial and torch.is_grad_enabled():
                    args, kwargs = self.ctx.backward.wrap_partial_call(group, args, kwargs)
                frozen = len(group.trainable) < len(group.params)
                if watches_inputs(frozen=frozen, fills_missing=group.ends_where_every_rank_does()):
                    # Every call's inputs, a list group's first (partial so far) included:
                    # backward is through the group only once it is through all of them.
                    recomputable = self.ctx.in_root_forward and self.ctx.forward_with_grad
                    args, kwargs = self.ctx.backward.wrap_inputs(group, args, kwargs, recomputable)
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = cast_floats((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def _in_local_forward(self) -> bool:
        """Whether this (non-root) state's hooks have nothing to do: a local tree's forward."""
        ctx = self.ctx
        if ctx is None or not ctx.local or not ctx.in_root_forward:
            return False
        if self.is_root or self._forward_pending:
            return False
        # Registered by the root's pre-forward; a state dict in between shows the shards.
        return all(g.registered_unsharded for g in self.groups)

    def _gathered_for_recompute(self) -> bool:
        """Whether backward reached this state's groups; those it already ended gathered again."""
        if self.ctx is not None:
            for group in self.groups:
                self.ctx.driver.regather(group)
        return self._in_pre_backward()

    def _in_pre_backward(self) -> bool:
        """Whether backward reached this state's groups (they move together)."""
        return any(g.training_state is TrainingState.PRE_BACKWARD for g in self.groups)

    def _root_pre_forward(self) -> None:
        assert self.ctx is not None
        check_backward_finished(self.ctx.final_callback_queued, self.fqn)
        verdict, self.ctx.verdict = self.ctx.verdict, None
        if verdict is not None:
            verdict.settle()  # the last step's check, on an accelerator
        notify_join(self)  # before this iteration's collectives; nothing without a Join
        groups = self.all_groups
        # An optimizer step that raised left its optimizer on local tensors: this root's.
        restore_all(p.sharded_param for group in groups for p in group.params)
        claim_training_thread(self.ctx)  # before any full parameter is registered
        PROGRESS.enter("forward")
        for group in groups:
            group.take_up_new_hooks()  # the local tree gathers nothing: look for them here
        self.ctx.local = is_local_tree(groups)
        self.ctx.in_root_forward = True
        self.ctx.forward_with_grad = torch.is_grad_enabled()
        enter_local_forward(groups, self.ctx.local)
        for group in groups:
            if group.sharded_state is ShardedState.SHARDED_POST_FORWARD:
                group.reshard()  # its slices predate any optimizer step since: drop them
        self.ctx.driver.root_pre_forward()

    def _groups_pre_forward(self, module: nn.Module) -> bool:
        """Gather the groups for this call; whether it is a partial list-group call.

        A call of some of a list group's modules that does not complete the group is partial:
        as torch's ``fully_shard`` (its "partial path"), its output gets no pre-backward hook,
        and a backward of it ends the group through its inputs (``backward``, rule 5).
        """
        assert self.ctx is not None
        entering = not self._forward_pending
        if entering:
            self._forward_pending = {id(m) for m in self.modules}
            PROGRESS.ran_forward(self.fqn)
        for group in self.groups:
            group.ran_forward_with_grad |= torch.is_grad_enabled()
            if entering:
                self.ctx.driver.pre_forward(group)
            elif group.training_state is not TrainingState.FORWARD:
                self.ctx.driver.resume_forward(group)  # an earlier partial call's backward ran
            elif not group.registered_unsharded:
                group.wait_for_unshard()
        return bool(self._forward_pending - {id(module)})

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self._in_pre_backward():
            return output  # recomputation under activation checkpointing: keep parameters
        if self._in_local_forward():
            # The root's output hook queues the end-of-backward callback, which takes this
            # group's gradients: no hook on this output.
            return self._cast_output(output)
        if self.groups:
            self._forward_pending.discard(id(module))
            if self._forward_pending:  # a partial list-group call: no pre-backward hook
                return self._cast_output(output)
            assert self.ctx is not None
            for group in self.groups:
                self.ctx.driver.post_forward(group)
                self.ctx.backward.forward_completed(group)
        output = self._register_pre_backward(output)
        if self.is_root:
            output = self._root_post_forward(output)
        return self._cast_output(output)

    def _cast_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is None:
            return output
        return cast_floats(output, self.mp_policy.output_dtype)

    def _root_post_forward(self, output: Any) -> Any:
        assert self.ctx is not None
        self.ctx.in_root_forward = False
        # List groups only partly run (a chunked loss calls the head later): their forward
        # ends here, and backward reaches them through the root's output, as with torch's.
        for state in reversed(_states(self.ctx)):
            if state is not self and state._forward_pending:
                for group in state.groups:
                    self.ctx.driver.post_forward(group)
                    self.ctx.backward.forward_completed(group)
                output = state._register_pre_backward(output)
                state._forward_pending.clear()
        # Groups that were prefetched but never ran. A local tree's stay unsharded: each is
        # its shards.
        self.ctx.driver.root_post_forward([] if self.ctx.local else self.all_groups)
        if not torch.is_grad_enabled():
            self.check_step_end()  # no backward follows to check this forward's collectives
        return output

    def _register_pre_backward(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        for tensor in pytree.tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._pre_backward)
                if self.ctx is not None:
                    for group in self.groups:
                        self.ctx.driver.output_needs_grad(group)
        return output

    # --- backward ---------------------------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> None:
        PROGRESS.enter("backward")
        self._ensure_final_callback()
        # In reverse, as backward runs: the last group's pre-backward prefetches the one
        # before it, of this state or the previous one.
        for group in reversed(self.groups):
            assert self.ctx is not None
            self.ctx.driver.pre_backward(group)

    def _ensure_final_callback(self) -> None:
        ctx = self.ctx
        assert ctx is not None
        if ctx.final_callback_queued:
            return
        ctx.final_callback_queued = True
        root = next(s for s in _states(ctx) if s.is_root)
        if ctx.manual_finalization is None:
            ctx.manual_finalization = root.manual_finalization
        Variable._execution_engine.queue_callback(root.root_final_callback)

    def root_final_callback(self) -> None:
        """The end of one backward, run by autograd or by a pipeline schedule.

        A schedule that ends a stage's backward outside autograd calls it (see
        [Note: torch-facing view]). Under manual finalization it finishes no reduction:
        ``finalization.finalize_backward`` does.
        """
        ctx = self.ctx
        assert ctx is not None
        ctx.final_callback_queued = False
        manual = bool(ctx.manual_finalization)
        self.end_backward(
            last=not manual and all(g.options.is_last_backward for g in self.all_groups)
        )
        if not manual:
            ctx.manual_finalization = None

    def end_backward(self, *, last: bool) -> None:
        """The driver's end of backward for every group; ``last``: finish every reduction."""
        ctx = self.ctx
        assert ctx is not None
        # A local tree's gradients are all taken here (none were counted), and assigned at
        # once unless a later backward finalizes. See ``backward`` (rule 4).
        at_end, ctx.local = ctx.local and last, False
        ctx.driver.final_callback(self.all_groups, last=last, assign_now=at_end)
        ctx.backward.reset()
        for state in _states(ctx):
            state._forward_pending.clear()  # partial list-group calls since: the next starts afresh
        PROGRESS.enter("idle")
        if last:
            self.check_step_end()

    def check_step_end(self) -> None:
        """The step check (``collectives_agree``): on the CPU, raises before the optimizer step."""
        assert self.ctx is not None
        self.ctx.verdict = check_step(self.all_groups, self.device)

    def reset_iter_state(self) -> None:
        """Recover after an exception mid-step: finish or drop in-flight work, reshard all."""
        assert self.ctx is not None
        pending = self.ctx.comm.pending_reduces
        while pending:
            # One abandoned by a desync error (raised on every rank) is dropped: its rows may
            # never come.
            with contextlib.suppress(DesyncError):
                self.ctx.comm.finish_oldest()
        self.ctx.comm.host_copies.wait()  # nothing may land in pinned memory after recovery
        for group in self.all_groups:
            group.drop_pending_state()
        self.ctx.backward.reset()
        for state in _states(self.ctx):
            state._forward_pending.clear()
        self.ctx.driver.schedule.reset()
        self.ctx.final_callback_queued = False
        self.ctx.manual_finalization = None
        self.ctx.reduction_pending = False
        self.ctx.verdict = None
        step_check.forget()  # what each rank issued before the exception may differ
        self.ctx.local = self.ctx.in_root_forward = False
        PROGRESS.enter("idle")


def _states(ctx: RootContext) -> list[FSDPState]:
    """Every state under ``ctx``'s root, as the ``FSDPState`` it is."""
    # The context holds them as RootState, what the helpers below read; build makes no other.
    return cast("list[FSDPState]", ctx.states)
