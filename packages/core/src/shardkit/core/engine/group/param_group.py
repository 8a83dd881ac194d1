"""FSDPParamGroup: one communication bucket and its state machine.

unshard -> wait_for_unshard -> (compute) -> reshard, one all-gather per unshard; after
backward, one reduce-scatter of all the group's gradients. See [Note: flat group buffers].
Parameters with all-gather hooks join the same all-gather: see [Note: all-gather extensions].
Its re-planning when its parameters change under it is the ``upkeep.GroupUpkeep`` it holds;
its gradients' bookkeeping without sync is ``unsynced``'s.

Next to split off: the all-gather in flight (``_PendingGather``, the collective half of
``_issue_gather``, the copy-out of ``wait_for_unshard``, ``_post_forward_slices``), as a helper
object the group holds, as it holds ``GroupUpkeep``, into ``group/gather.py``: it needs only the
plan, the storage and the comm context, and the group keeps the state transitions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardkit.core import observe
from shardkit.core.engine.buffer_layout import GroupLayout
from shardkit.core.engine.comm_context import CommContext
from shardkit.core.engine.group.plan import GroupConfig, plan_group
from shardkit.core.engine.group.storage import GroupStorage
from shardkit.core.engine.group.unsynced import stash_unsynced
from shardkit.core.engine.group.upkeep import GroupUpkeep
from shardkit.core.engine.group_options import GroupOptions
from shardkit.core.engine.param import FSDPParam
from shardkit.core.engine.param_listing import set_listed
from shardkit.core.engine.profiler_ranges import fsdp_range
from shardkit.core.engine.replaceable_hooks import ReplacedSteps
from shardkit.core.errors import DesyncError
from shardkit.core.policies import MixedPrecisionPolicy
from shardkit.core.runtime.collectives import gathers_by_exchange
from shardkit.core.runtime.protocol import GatheredRows
from shardkit.core.state_machines import (
    SHARDED_TRANSITIONS,
    TRAINING_TRANSITIONS,
    ShardedState,
    TrainingState,
    check_transition,
)

__all__ = ["FSDPParamGroup", "GroupWiring"]


@dataclass(frozen=True, slots=True)
class GroupWiring:
    """What the root gives each of its groups at its lazy init."""

    fqn: str
    """The group's module(s), named from the root (messages, profiles, collectives)."""
    param_fqns: list[str]
    """Its parameters' names from the root, as torch names them in messages."""
    comm: CommContext
    """The communication context the root's groups share."""
    grad_hook: Callable[[torch.Tensor], None]
    """The post-accumulate-grad hook of its trainable unsharded parameters (``backward``)."""


@dataclass(slots=True)
class _PendingGather:
    handle: GatheredRows
    from_post_forward: bool  # gathered within the post-forward subgroup


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call, gathered and reduced together."""

    def __init__(self, params: list[FSDPParam], config: GroupConfig, options: GroupOptions):
        self.params = params
        self.modules = config.modules
        self.mesh_info = config.mesh_info
        self.options = options
        self.fqn = ""  # set at the root's lazy init, for messages
        self.torch_fqn = ""  # the same names as torch's engine gives them (profiles, its view)
        self.replaced = ReplacedSteps()  # its backward steps as a tool replaced them, if any
        # Named from the root at its lazy init, as torch names them in messages.
        self.param_fqns = [p.fqn for p in params]
        self.comm: CommContext | None = None  # set at the root's lazy init
        self.sharded_state = ShardedState.SHARDED
        self._training_state = TrainingState.IDLE
        self.registered_unsharded = False
        self._pending_gather: _PendingGather | None = None
        self._grad_hook: Callable[[torch.Tensor], None] = _not_attached
        self.grads_in_flat_layout = False  # see reduce_in_flat_layout
        self.ran_forward_with_grad = False  # since its last reduction: see holds_grads
        # While unlisted (list_params), each module's _parameters names as they were.
        self._listing_order: dict[int, list[str]] = {}
        # Everything derived from the parameters and config: read it, a re-plan replaces it.
        self._config = config
        self.plan = plan_group(params, config, options.reshard_after_forward)
        self._storage = GroupStorage(params)  # the buffers, read against the plan
        self._upkeep = GroupUpkeep(config, self._storage)  # its re-planning
        self._post_forward_slices: torch.Tensor | None = None  # see reshard_post_forward
        self._upkeep.follow_plan(self)
        self.reducer = self._upkeep.new_reducer(self)
        self._storage.init_sharded(self.plan)

    @property
    def training_state(self) -> TrainingState:
        """What the group is doing now, as its hooks see it."""
        return self._training_state

    @training_state.setter
    def training_state(self, new: TrainingState) -> None:
        check_transition(TRAINING_TRANSITIONS, self._training_state, new, self.fqn)
        self._training_state = new

    # --- what other modules read --------------------------------------------------------

    @property
    def layout(self) -> GroupLayout:
        """The group's buffer layout (its plan's)."""
        return self.plan.layout

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        """The mixed precision policy ``fully_shard`` was given (torch's class or shardkit's)."""
        return self._config.mp_policy

    @property
    def pin_memory(self) -> bool:
        """Whether the offloaded sharded parameters are in pinned memory."""
        return self.plan.pin_memory

    @property
    def sharded_buffer(self) -> torch.Tensor:
        """This rank's shards of the flat parameters, as bytes laid out by ``layout.storage``.

        The optimizer steps it through the parameters; it is replaced when the shards move
        (``resync_sharded_storage``, ``take_up_new_hooks``).
        """
        return self._storage.sharded_buffer

    @property
    def holds_staging(self) -> bool:
        """Whether an all-gather's staging copy is borrowed from the pool now."""
        return self._storage.holds_staging

    # --- construction -----------------------------------------------------------------------

    def list_params(self, listed: bool) -> None:
        """Register the parameters in ``_parameters`` (True) or as plain attributes (False).

        See ``param_listing``: unlisted, ``parameters()``, ``state_dict()`` and ``module.to()``
        walk past them; the engine registers and swaps them as before.
        """
        set_listed(self.params, listed, self._listing_order)

    def attach(self, wiring: GroupWiring) -> None:
        """Take what the root gives its groups at its lazy init (see ``GroupWiring``)."""
        self.fqn = wiring.fqn
        # shardkit names the root module "<root>" in its messages; torch names it "".
        self.torch_fqn = ", ".join("" if n == "<root>" else n for n in wiring.fqn.split(", "))
        self.param_fqns = wiring.param_fqns
        self._grad_hook = wiring.grad_hook
        self.attach_comm(wiring.comm)

    def attach_comm(self, comm: CommContext) -> None:
        """Use ``comm`` for this group's collectives and tell its pool our buffer sizes."""
        self.comm = comm
        for nbytes in self.comm_buffer_sizes():
            comm.pool.add_user(nbytes, self)

    def comm_buffer_sizes(self) -> frozenset[int]:
        """Byte sizes of the buffers its all-gathers borrow, which the pool may keep for reuse.

        Exactly those the backend's collective will request (the core's layout view says
        which: receive buffers, and the staging copy of a cast, a move or hooks).

        Reduce-scatter send buffers are left out on purpose: they live through backward,
        when activations peak, and an idle one kept there costs more peak memory than the
        allocation it saves (measured: +4% peak RSS on a 35M-parameter GPT).
        """
        exchange = gathers_by_exchange(self.mesh_info.shard_group)
        return self.plan.layout.pool_sizes(exchange=exchange, offload=self.plan.offload)

    # --- re-planning when the parameters change under it (upkeep.GroupUpkeep) -------------

    def resync_sharded_storage(self) -> None:
        """Re-adopt the registered sharded tensors after ``_apply`` or ``assign=True`` loads."""
        self._upkeep.resync_sharded_storage(self)

    def take_up_new_hooks(self) -> None:
        """Gather through the all-gather hooks that local tensors gained since the last look."""
        self._upkeep.take_up_new_hooks(self)

    def accumulate_unsynced_in_param_dtype(self, enabled: bool) -> None:
        """Accumulate gradients without sync in the compute dtype (True) or the reduce dtype."""
        self._upkeep.accumulate_unsynced_in_param_dtype(self, enabled)

    def reduce_in_flat_layout(self) -> None:
        """Land reductions in the sharded buffer's layout from now on (one dtype, no hooks)."""
        self._upkeep.reduce_in_flat_layout(self)

    # --- unshard / reshard ----------------------------------------------------------------

    def check_materialized(self) -> None:
        """Raise if parameters are still on the meta device at the first collective."""
        if self._storage.sharded_buffer.is_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {self.param_fqns}\n"
                "For example, call module.to_empty(device) to materialize to device and "
                "call module.reset_parameters() on each module to initialize values. "
                f"(FSDP module {self.fqn or '<root>'})"
            )

    def unshard(self) -> None:
        """Issue the all-gather of this group's parameters (async; ``wait_for_unshard`` ends it)."""
        if self.sharded_state is ShardedState.UNSHARDED or self._pending_gather is not None:
            return
        with fsdp_range("all_gather", self.torch_fqn):
            self._issue_gather()

    def _issue_gather(self) -> None:
        assert self.comm is not None, f"{self.fqn}: unshard before lazy init"
        self.check_materialized()
        self.take_up_new_hooks()
        plan = self.plan
        if plan.aliases_shards or plan.copies_shards:
            self._storage.unshard_locally(plan)
            self._mark_unsharded()
            if observe.has_subscribers():
                observe.emit(observe.StateTransitionEvent(self.fqn, "unshard"))
            return
        pf = plan.post_forward
        runtime = self.comm.runtime
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD and pf is not None:
            slices = self._post_forward_slices
            assert slices is not None
            handle = runtime.all_gather(
                slices, pf.subgroup(), label=self.fqn, custom=self.options.custom_all_gather
            )
            self._pending_gather = _PendingGather(handle, from_post_forward=True)
        else:
            sent, group = self._upkeep.hook_inputs(self), self.mesh_info.shard_group
            custom = self.options.custom_all_gather
            sends, into = self._storage.gather_input(
                self.plan, runtime, group, sent, in_place=custom is None
            )
            handle = runtime.all_gather(sends, group, label=self.fqn, custom=custom, into=into)
            self._pending_gather = _PendingGather(handle, from_post_forward=False)
        if observe.has_subscribers():
            observe.emit(observe.StateTransitionEvent(self.fqn, "unshard"))

    def wait_for_unshard(self) -> None:
        """Finish a pending all-gather: copy out into the full parameters and register them."""
        pending = self._pending_gather
        if pending is None:
            if self.sharded_state is not ShardedState.UNSHARDED:
                self.unshard()
                self.wait_for_unshard()
            elif not self.registered_unsharded:
                self._register(unsharded=True)
            return
        self._pending_gather = None
        with fsdp_range("all_gather_copy_out", self.torch_fqn):
            blocks = pending.handle.wait()  # every rank's rows; ours may be the input itself
            from_pf = pending.from_post_forward and self.plan.post_forward is not None
            self._storage.copy_out(self.plan, blocks, from_post_forward=from_pf)
            pending.handle.release()
            assert self.comm is not None
            self._storage.return_staging(self.comm.pool)
            if from_pf:
                self._post_forward_slices = None
            self._mark_unsharded()

    def _mark_unsharded(self) -> None:
        check_transition(SHARDED_TRANSITIONS, self.sharded_state, ShardedState.UNSHARDED, self.fqn)
        self.sharded_state = ShardedState.UNSHARDED
        self._register(unsharded=True)

    def reshard(self) -> None:
        """Free the full parameters and register the sharded ones."""
        if self._pending_gather is not None:
            # An unshard (e.g. a prefetch) that nobody consumed: finish it so buffers return.
            self.wait_for_unshard()
        if self.sharded_state is ShardedState.SHARDED:
            if self.registered_unsharded:
                self._register(unsharded=False)
            return
        check_transition(SHARDED_TRANSITIONS, self.sharded_state, ShardedState.SHARDED, self.fqn)
        self._register(unsharded=False)
        self._storage.free_unsharded(self.plan, self.options)
        self._post_forward_slices = None
        self.sharded_state = ShardedState.SHARDED
        if observe.has_subscribers():
            observe.emit(observe.StateTransitionEvent(self.fqn, "reshard"))

    def reshard_post_forward(self) -> None:
        """After forward: keep this rank's 1/n slices, free the full parameters."""
        pf = self.plan.post_forward
        if pf is None or self.sharded_state is not ShardedState.UNSHARDED:
            self.reshard()
            return
        if self._pending_gather is not None:
            self.wait_for_unshard()
        buffer = self._storage.unsharded.tensor
        assert buffer is not None
        unsharded = self.plan.layout.unsharded
        self._post_forward_slices = pf.slices_of(
            [unsharded.view(buffer, i) for i in range(len(self.params))]
        )
        check_transition(
            SHARDED_TRANSITIONS, self.sharded_state, ShardedState.SHARDED_POST_FORWARD, self.fqn
        )
        self._register(unsharded=False)
        self._storage.free_unsharded(self.plan, self.options)
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def _register(self, *, unsharded: bool) -> None:
        for p in self.params:
            if unsharded:
                p.follow_requires_grad(self._grad_ready)
            p.register(unsharded)
        self.registered_unsharded = unsharded

    def _grad_ready(self, param: torch.Tensor) -> None:
        # The parameters' hooks call this bound method (held weakly, so a dropped model is
        # freed), and through it whatever hook the root's latest attach gave the group.
        self._grad_hook(param)

    @property
    def trainable(self) -> list[FSDPParam]:
        """The parameters that train now (``requires_grad`` as the user last set it)."""
        return [p for p in self.params if p.requires_grad]

    def register_sharded_for_state_dict(self) -> None:
        """Show the sharded DTensors to ``state_dict``/``load_state_dict`` without freeing."""
        if self.registered_unsharded:
            self._register(unsharded=False)

    @property
    def is_unsharded(self) -> bool:
        """Whether the full parameters are materialised (or being gathered)."""
        return self.sharded_state is ShardedState.UNSHARDED or self._pending_gather is not None

    # --- backward ---------------------------------------------------------------------------

    def holds_grads(self) -> bool:
        """Whether a gradient no reduction took is held (in ``.grad``, or accumulated).

        So is one that ran forward with gradients since its last reduction, where missing
        gradients are reduced as zeros: another rank may reduce it though this one got no
        gradient at all (``reduce.unused``).
        """
        if self.ran_forward_with_grad and self.reducer.reduces_zeros() and self.trainable:
            return True
        return any(
            p.accumulated_grad is not None
            or (p.unsharded_param is not None and p.unsharded_param.grad is not None)
            for p in self.params
        )

    def ends_where_every_rank_does(self) -> bool:
        """Whether its backward ends where every rank's does, not at this rank's count.

        So it must where a trainable parameter with no gradient here is reduced (zeros); see
        ``schedule.count_can_end_backward``.
        """
        if self.options.ends_at_last_grad:
            return False
        return self.reducer.fills_missing(self.trainable)

    def take_grads(self) -> list[tuple[FSDPParam, torch.Tensor | None]] | None:
        """Take the full gradients for a reduction; None when none starts.

        Without gradient sync (``set_requires_gradient_sync(False)``), they are kept as
        unsharded gradients for the next backward to add to, and nothing is reduced. The
        schedule's driver calls this where a group's backward ends: see
        [Note: post-backward trigger].
        """
        if not self.options.reduce_grads:
            stash_unsynced(self.trainable, self.options, self.plan.reduce_dtype)
            return None
        ran_forward, self.ran_forward_with_grad = self.ran_forward_with_grad, False
        return self.reducer.take_grads(self.trainable, ran_forward=ran_forward) or None

    def start_reduction(
        self, grads: list[tuple[FSDPParam, torch.Tensor | None]], *, assign_now: bool
    ) -> None:
        """Issue the reduction of what :meth:`take_grads` took.

        Args:
            grads: the taken gradients (emptied once packed).
            assign_now: a local tree's end of backward: gradients that are their own
                reduction are assigned at once, not queued for the callback to finish right
                after.
        """
        assert self.comm is not None
        self.reducer.start(grads, self.comm, self.fqn, assign_now=assign_now)

    def drop_pending_state(self) -> None:
        """Forget in-flight work and unreduced gradients (recovery after an exception)."""
        pending, self._pending_gather = self._pending_gather, None
        if pending is not None:
            try:
                pending.handle.wait()
            except DesyncError:
                # Abandoned by a desync error (raised on every rank): its rows may never come,
                # or come late from a peer in step, so neither buffer goes back to the pool.
                self._storage.abandon_staging()
            else:
                pending.handle.release()
                assert self.comm is not None
                self._storage.return_staging(self.comm.pool)
        for p in self.trainable:
            p.take_unsharded_grad()
        self.reducer.partial = None
        self.reducer.unused.forget()
        self.ran_forward_with_grad = False
        self.reshard()
        self.training_state = TrainingState.IDLE

    def __repr__(self) -> str:
        return f"FSDPParamGroup({self.fqn or '<root>'}, params={len(self.params)})"


def _not_attached(_param: torch.Tensor) -> None:
    raise AssertionError("a gradient hook ran before the root attached its groups")
