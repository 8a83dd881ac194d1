"""The step's operations on sizes: what the planner's step does when the driver runs it.

``shardkit.core.schedule.StepDriver`` decides which operation comes at which hook, for the
engine (``engine/step_ops.py`` in the core) and for the planner alike. This is the planner's
side: each operation on a group index allocates and frees on the ledger what the engine's
allocates and frees, and records the collectives it issues and the events it emits. The
modelling assumptions are ``step``'s.

The reductions (the reduce-scatter's buffers, the replicas' all-reduce, the sharded
gradients' assignment) are ``reductions``'s: a helper these operations hold and call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from shardkit.core.layout import STEP_CHECK_HEADER_BYTES, pooled_sizes, step_checks_on
from shardkit.core.schedule import (
    MAX_REDUCES_IN_FLIGHT,
    AfterForward,
    TrainingState,
    root_reshards_after_forward,
)
from shardkit.tools.plan.ledger import Key, Ledger, Pool
from shardkit.tools.plan.records import CollectiveCall, StepMark
from shardkit.tools.plan.reductions import Reductions
from shardkit.tools.plan.step_inputs import StepInputs
from shardkit.tools.plan.tp_comm import TPCall
from shardkit.tools.records import Category

__all__ = ["OPTIMIZER_STEP", "SLICE_AXIS", "LedgerOps"]

SLICE_AXIS = "dp_post_forward"
"""The axis of backward's all-gather of post-forward slices (``reshard_after_forward=n``): a
subgroup of n ranks of the shard axis, which the engine makes and no mesh names."""

OPTIMIZER_STEP = "(optimizer step)"
"""The group a collective of the optimizer's step is planned under (the comm report's name)."""


@dataclass(frozen=True, slots=True)
class _Settings:
    """A planned group's switches (``schedule.GroupSettings``): the engine's defaults."""

    reshard_after_forward: bool | int
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    reduce_grads: bool = True  # a planned step synchronizes gradients
    max_reduces_in_flight: int = MAX_REDUCES_IN_FLIGHT
    forward_prefetch: Sequence[int] | None = None
    backward_prefetch: Sequence[int] | None = None


def _policy(inputs: StepInputs, index: int) -> bool | int:
    """Group ``index``'s ``reshard_after_forward``, the root's adjusted as the engine does.

    A unit's own (``PlanOptions.units``) is always given, so the root keeps no default.
    """
    own = inputs.groups[index].reshard_after_forward
    if own is not None:
        return own
    value = inputs.options.reshard_after_forward
    policy: bool | int = True if value is None else value
    if index == inputs.root:
        policy = root_reshards_after_forward(policy, is_default=value is None)
    return policy


class LedgerOps:
    """``schedule.StepOps`` on group indices: the bytes each operation allocates and sends."""

    def __init__(self, inputs: StepInputs) -> None:
        """Start from nothing allocated; the step's replay allocates the resident state."""
        self.inputs = inputs
        self.groups = inputs.groups
        self.world = self.groups[0].world
        self.gloo = inputs.options.backend == "gloo"
        self.offload = inputs.options.offload  # shards and their gradients on the host
        self.ledger = Ledger()
        self.pool = Pool(
            self.ledger,
            pooled_sizes((g.layout for g in self.groups), exchange=self.gloo, offload=self.offload),
        )
        self.calls: list[CollectiveCall] = []
        self.check_calls: list[CollectiveCall] = []  # the step check's (record_step_check)
        self.events: list[tuple[str, str]] = []
        self.marks: list[StepMark] = []  # compute, issues and waits in order (``step_time``)
        count = len(self.groups)
        lists = inputs.prefetch or ((None, None),) * count
        self._settings = [
            _Settings(
                reshard_after_forward=_policy(inputs, i),
                forward_prefetch=lists[i][0],
                backward_prefetch=lists[i][1],
            )
            for i in range(count)
        ]
        self.unsharded = [False] * count
        self.pending = [False] * count
        self.held = [False] * count  # the unsharded buffer's memory is allocated
        self.sliced = [False] * count  # holds its post-forward slices (reshard_after_forward=n)
        self.state_of = [TrainingState.IDLE] * count
        self.reductions = Reductions(inputs, self.ledger, self.pool, self._record)

    def settings(self, group: int) -> _Settings:
        """The planned group's switches."""
        return self._settings[group]

    def state(self, group: int) -> TrainingState:
        """The group's training state."""
        return self.state_of[group]

    def set_state(self, group: int, state: TrainingState) -> None:
        """Move the group to ``state``; backward's allocations from here on are its own."""
        self.state_of[group] = state
        if state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            self.ledger.module = self.groups[group].fqn

    def event(self, what: str, group: int) -> None:
        """Record one of the engine's state transitions."""
        self.events.append((what, self.groups[group].fqn))

    def name(self, group: int) -> str:
        """The group's FQN, as the engine names it."""
        return self.groups[group].fqn

    def mark(self, kind: str, index: int = 0, group: str = "") -> None:
        """Note a point of the step for its timing (a ``StepMark``)."""
        self.marks.append(StepMark(kind=kind, phase=self.ledger.phase, index=index, group=group))

    def profiled(self, label: str, group: int | None = None) -> AbstractContextManager[object]:
        """No profiler range: a planned step runs nothing to profile."""
        return contextlib.nullcontext()

    def run_step(self, name: str, group: int, step: Callable[[], None], *args: object) -> None:
        """The step itself: nothing replaces a planned step's hooks."""
        step()

    def keep_idle_buffers(self, keep: bool) -> None:
        """The pool keeps idle buffers (forward), or gives every one back."""
        self.pool.retain = keep
        if not keep:
            self.pool.clear()

    def is_unsharded(self, group: int) -> bool:
        """Whether the group's full parameters are in, or being gathered."""
        return self.unsharded[group] or self.pending[group]

    def free_after_forward(self, group: int, action: AfterForward) -> None:
        """Free the full parameters, or keep this rank's 1/n slice of them (SLICE)."""
        layout = self.groups[group].layout
        if action is not AfterForward.SLICE or layout.post_forward is None:
            self.reshard(group)
            return
        if self.pending[group]:
            self.wait(group)
        if not self.unsharded[group]:
            return
        # The slices are copied out of the full parameters, which are freed after; the engine
        # announces no reshard here (the group is in its own post-forward state). They are a
        # buffer of the group's communication (backward's all-gather sends them), as the
        # engine's trackers count them.
        label = f"post-forward slices {self.groups[group].fqn}"
        self.ledger.alloc(
            ("slices", group), Category.COMM_BUFFERS, layout.post_forward.nbytes, label
        )
        if not self.inputs.options.keep_unsharded_storage:
            self.ledger.free(("unsharded", group))
            self.held[group] = False
        self.unsharded[group] = False
        self.sliced[group] = True

    def _receive_bytes(self, g: int) -> int:
        # gloo gathers by direct exchange, where this rank's own row never needs a buffer.
        layout = self.groups[g].layout
        if self.sliced[g]:
            return layout.post_forward_receive_bytes(exchange=self.gloo)
        return layout.all_gather_receive_bytes(exchange=self.gloo)

    def unshard(self, group: int, *, prefetch: bool = False) -> None:
        """Issue the all-gather: its receive buffer (and staging copy) from the pool."""
        g, label = group, "all-gather (prefetch)" if prefetch else "all-gather"
        if self.unsharded[g] or self.pending[g]:
            return
        self.pending[g] = True
        spec = self.groups[g]
        layout = spec.layout
        if self.sliced[g] and layout.post_forward is not None:
            # Backward gathers the slices within the n ranks that hold them (no staging).
            n, nbytes = layout.post_forward_world or 1, layout.post_forward.nbytes
            self._append("all_gather", spec.fqn, SLICE_AXIS, n, nbytes, nbytes * (n - 1))
            self.pool.get(self._receive_bytes(g), ("gather", g), f"{label} {spec.fqn} (slices)")
            self.event("unshard", g)
            return
        if layout.stages_gather_input(offload=self.offload, exchange=self.gloo):
            nbytes = layout.all_gather_input_bytes
            self.pool.get(nbytes, ("staging", g), f"{label} {spec.fqn}: staging copy")
        if self.world > 1:
            nbytes = layout.all_gather_input_bytes
            self._record("all_gather", g, self.world, nbytes, nbytes * (self.world - 1))
            self.pool.get(self._receive_bytes(g), ("gather", g), f"{label} {spec.fqn}")
        # At W=1 nothing is gathered: the shards are (or are copied into) the parameters.
        self.event("unshard", g)

    def wait(self, group: int) -> None:
        """The gather lands: the unsharded buffer is allocated, the pool's buffers go back."""
        g = group
        if not self.pending[g]:
            if not self.unsharded[g]:
                self.unshard(g)
                self.wait(g)
            return
        self.pending[g] = False
        self.mark("wait", group=self.groups[g].fqn)
        layout = self.groups[g].layout
        if not self.held[g]:
            self.hold_unsharded(g, f"unshard {self.groups[g].fqn}")
        if self.sliced[g]:
            self.pool.put(self._receive_bytes(g), ("gather", g))
            self.ledger.free(("slices", g))
            self.sliced[g] = False
            self.unsharded[g] = True
            return
        if self.world > 1:
            self.pool.put(self._receive_bytes(g), ("gather", g))
        if layout.stages_gather_input(offload=self.offload, exchange=self.gloo):
            self.pool.put(layout.all_gather_input_bytes, ("staging", g))
        self.unsharded[g] = True

    def reshard(self, group: int) -> None:
        """Free the unsharded buffer (landing a gather nobody waited for first)."""
        g = group
        if self.pending[g]:
            self.wait(g)
        if self.sliced[g]:  # the slices kept after forward, never gathered again
            self.ledger.free(("slices", g))
            self.sliced[g] = False
            self.event("reshard", g)
        if self.unsharded[g]:
            if not self.inputs.options.keep_unsharded_storage:
                self.ledger.free(("unsharded", g))
                self.held[g] = False
            self.unsharded[g] = False
            self.event("reshard", g)

    def hold_unsharded(self, group: int, label: str) -> None:
        """Allocate the unsharded buffer's memory (an unshard, or kept from the last step)."""
        layout = self.groups[group].layout
        # One shard rank: the unsharded parameters are views of the shards, unless those are
        # on the host (offload), when they are copied in.
        views = layout.unsharded_views_storage and not self.offload
        nbytes = 0 if views else layout.unsharded_bytes
        self.ledger.alloc(("unsharded", group), Category.UNSHARDED_PARAMS, nbytes, label)
        self.held[group] = True

    def _record(
        self, kind: str, g: int, size: int, input_bytes: int, sent: int, *, replicas: bool = False
    ) -> None:
        # torchtitan's axis names: "dp" alone, "dp_shard" and "dp_replicate" under HSDP.
        axis = "dp_shard" if self.inputs.hsdp else "dp"
        if kind == "all_reduce" or replicas:
            axis = "dp_replicate"
        self._append(kind, self.groups[g].fqn, axis, size, input_bytes, sent)

    def record_step_check(self) -> None:
        """The engine's step check where a backward ends (the core's ``runtime/watch/step_check``).

        For each mesh axis the step's collectives used, in order of first use: every member's
        header and one byte per trainable parameter, point to point on gloo (a receive and a
        send per peer), one all-gather elsewhere. No event: the engine announces none.
        """
        if not step_checks_on():
            return
        nbytes = STEP_CHECK_HEADER_BYTES + sum(len(g.trainable) for g in self.groups)
        sizes: dict[str, int] = {}
        for call in self.calls:
            if call.axis != "tp":
                sizes.setdefault(call.axis, call.group_size)
        for axis, size in sizes.items():
            if self.gloo:
                for _ in range(size - 1):
                    self.check_calls.append(self._made("recv", "", axis, size, nbytes, 0))
                    self.check_calls.append(self._made("send", "", axis, size, nbytes, nbytes))
            else:
                sent = nbytes * (size - 1)
                self.check_calls.append(self._made("all_gather", "", axis, size, nbytes, sent))

    def record_optimizer_call(self, kind: str, size: int, input_bytes: int, sent: int) -> None:
        """A collective of the optimizer's step (Muon's exchange), over every dp rank."""
        self._append(kind, OPTIMIZER_STEP, "dp", size, input_bytes, sent)

    def record_tp(self, calls: list[TPCall]) -> None:
        """Record tensor-parallel collectives (the replay places them on its segments)."""
        for c in calls:
            self._append(c.kind, c.module, "tp", self.inputs.tp_degree, c.input_bytes, c.sent_bytes)

    def _append(
        self, kind: str, group: str, axis: str, size: int, input_bytes: int, sent: int
    ) -> None:
        if axis != "tp":
            self.events.append((kind, group))
        self.mark("collective", len(self.calls))
        self.calls.append(self._made(kind, group, axis, size, input_bytes, sent))

    def _made(
        self, kind: str, group: str, axis: str, size: int, input_bytes: int, sent: int
    ) -> CollectiveCall:
        return CollectiveCall(
            kind=kind,
            group=group,
            axis=axis,
            group_size=size,
            input_bytes=input_bytes,
            sent_bytes=sent,
            phase=self.ledger.phase,
        )

    def grad_key(self, g: int, p: int) -> Key:
        """The key of the unsharded gradient of parameter ``p`` of group ``g``."""
        return ("grad", sum(len(group.params) for group in self.groups[:g]) + p)

    def _grad_keys(self, g: int) -> list[Key]:
        keys = [self.grad_key(g, p) for p in range(len(self.groups[g].params))]
        return [k for k in keys if k in self.ledger.live]

    def holds_grads(self, group: int) -> bool:
        """Whether unsharded gradients of the group are alive, not yet reduced."""
        return bool(self._grad_keys(group))

    def cover_missing_grads(self, group: int) -> None:
        """Nothing to add: the planned rank runs a conditional module as the trace did.

        Its gradients are on the ledger as autograd made them, and the reduction takes them
        (zeros for a parameter without one cost the engine no allocation: it packs them).
        """

    def take_grads(self, group: int) -> list[Key] | None:
        """The group's live unsharded gradients (None: none); tp's partial ones settled.

        The engine's sharding extension all-reduces them over tp as it takes them.
        """
        keys = self._grad_keys(group)
        if not keys:
            return None
        self._settle_partial_grads(group)
        return keys

    def start_reduction(self, group_index: int, grads: object, *, assign_now: bool) -> None:
        """Allocate the reduction's buffers (the gradients packed and freed) and send it."""
        assert isinstance(grads, list)
        self.reductions.start(group_index, grads)

    def reductions_in_flight(self) -> int:
        """Reductions started and not finished."""
        return len(self.reductions.in_flight)

    def finish_oldest_reduction(self) -> None:
        """Finish the oldest reduction; its buffers go before the next one allocates."""
        self.reductions.finish_oldest()

    def finish_reductions(self) -> None:
        """The end-of-backward callback finishes every reduction."""
        while self.reductions.in_flight:
            self.finish_oldest_reduction()

    def _settle_partial_grads(self, g: int) -> None:
        """The engine's sharding extension all-reduces partial tp gradients before dp reduces."""
        tp, size = self.inputs.tp, self.inputs.tp_degree
        if tp is None or size == 1:
            return
        for p, param in enumerate(self.groups[g].params):
            if param.fqn in tp.partial_grads and self.grad_key(g, p) in self.ledger.live:
                n = param.numel * param.comm_dtype.itemsize
                self._append("all_reduce", param.fqn, "tp", size, n, 2 * n * (size - 1) // size)
