"""The engine's schedule: when each group is gathered, prefetched, freed and reduced.

Pure decisions over group handles of any hashable type: the engine runs them on its
``FSDPParamGroup`` objects (``engine/fsdp_state.py``, ``engine/backward.py``), and the planner in
``shardkit.tools`` on group indices, with no model and no process group. So the planner
predicts the step that happens: one schedule, run by both, never two copies kept in step.

A step, as this module decides it:

- **Forward.** A group gathers at its pre-forward (or finds its prefetched gather). It then
  prefetches the group after it in the *previous* step's forward order (a first step has
  none: it prefetches nothing), or the modules set with ``set_modules_to_forward_prefetch``.
  That order ends with the root's forward: a call after it (a chunked loss calling the
  output head) gathers at its own pre-forward, and so, from then on, does a group that was
  prefetched and then not run (a dropped layer): no gather is wasted twice (``step_orders``).
  At its post-forward it frees its full parameters, keeps them, or keeps a 1/n slice, as
  ``reshard_after_forward`` says (:func:`after_forward`); the root keeps its own where the
  user left the default, since backward needs them first (:func:`root_reshards_after_forward`).
  The root's post-forward applies the same to the groups gathered but never run.
- **Backward.** A group whose outputs needed gradients gathers at its pre-backward, then
  prefetches the group before it in post-forward order, if backward will reach that one and
  has not yet (:meth:`StepSchedule.backward_prefetch`), or the modules set with
  ``set_modules_to_backward_prefetch``. A group's backward ends by one of the rules of
  ``backward.py`` (:func:`count_ends_backward`, :func:`inputs_end_backward`,
  :func:`ends_at_callback`), which frees it and starts its reduction. At most
  ``max_reduces_in_flight`` reductions run at once (:data:`MAX_REDUCES_IN_FLIGHT` unless set):
  starting one first finishes the oldest beyond that (:func:`reductions_to_finish`). The
  end-of-backward callback ends the groups left, finishes every reduction, and frees every
  group (``reshard_after_backward``).

Which decision runs at which hook, and in what order, is written once: :class:`StepDriver`.
The engine and the planner each implement :class:`StepOps` (what a decision does: gather,
free, reduce, on real groups or on a ledger) and call the driver's hooks; neither restates the
sequence. A pipeline schedule that ends a stage's backward outside autograd calls the same
hooks (:meth:`StepDriver.end_backward`, :meth:`StepDriver.final_callback`). The two
protocols (:class:`StepOps`, and the :class:`GroupSettings` it hands the driver) and
:class:`AfterForward` are ``step_protocols``'s; this seam publishes them to the other packages,
as it does ``TrainingState`` and :class:`StepSchedule`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Generic, TypeVar

from shardkit.core.state_machines import TrainingState
from shardkit.core.step_orders import StepSchedule
from shardkit.core.step_protocols import AfterForward, GroupSettings, StepOps

__all__ = [
    "MAX_REDUCES_IN_FLIGHT",
    "AfterForward",
    "GroupSettings",
    "StepDriver",
    "StepOps",
    "StepSchedule",
    "TrainingState",
    "after_forward",
    "count_can_end_backward",
    "count_ends_backward",
    "ends_at_callback",
    "inputs_end_backward",
    "partial_call_ends_backward",
    "reductions_to_finish",
    "root_reshards_after_forward",
    "watches_inputs",
]

G = TypeVar("G", bound=Hashable)

MAX_REDUCES_IN_FLIGHT = 1
"""Gradient reductions left in flight by default before the oldest is finished: one, so two
send buffers never coexist at backward's memory peak (``set_reduce_scatter_max_input_buffers``
raises it per group)."""


def after_forward(policy: bool | int) -> AfterForward:
    """What ``reshard_after_forward=policy`` does at a group's post-forward."""
    if policy is False:
        return AfterForward.KEEP
    if policy is True:
        return AfterForward.FREE
    return AfterForward.SLICE


def root_reshards_after_forward(policy: bool | int, *, is_default: bool) -> bool | int:
    """The root's policy: it keeps its parameters where the user left the default.

    Backward starts with the root's own parameters (its outputs are the last made), so
    freeing them after forward would only gather them again at once.
    """
    return False if is_default else policy


def count_ends_backward(state: TrainingState, *, inputs_pending: bool) -> bool:
    """Whether a group whose every trainable gradient is in ends its backward now.

    In PRE_BACKWARD as usual, or FORWARD / IDLE where its gradients came though its
    pre-backward hook never ran (its outputs reached the loss through tensors made outside
    its forward hooks); never while a forward call's inputs still wait for their gradients
    (frozen parameters may still be read).
    """
    ends = state in (TrainingState.PRE_BACKWARD, TrainingState.FORWARD, TrainingState.IDLE)
    return ends and not inputs_pending


def count_can_end_backward(*, fills_missing: bool) -> bool:
    """Whether a group's count of gradients may end its backward (rule 1).

    Not where a parameter with no gradient is reduced as zeros (``reduce.unused``): a rank
    that did not use it never completes the count that another rank completes, so the count
    would end the group at other points on different ranks, and its reduction would pair
    with another group's. Such a group ends where every rank's backward ends it, whatever it
    used: when backward is through its forward inputs (rule 2, :func:`watches_inputs`), or at
    the end-of-backward callback where no input needed a gradient (rule 3), as torch's
    ``fully_shard`` ends every group.
    """
    return not fills_missing


def watches_inputs(*, frozen: bool, fills_missing: bool) -> bool:
    """Whether backward through a group's forward inputs is watched (rule 2).

    ``frozen``: it has frozen parameters, which autograd may read after its last gradient;
    ``fills_missing``: its count ends nothing (:func:`count_can_end_backward`).
    """
    return frozen or fills_missing


def inputs_end_backward(state: TrainingState, *, count_complete: bool) -> bool:
    """Whether backward through a group's inputs ends its backward (it has frozen parameters).

    ``count_complete``: every trainable parameter's gradient is in (vacuously, with none).
    """
    return state is TrainingState.PRE_BACKWARD and count_complete


def partial_call_ends_backward(state: TrainingState) -> bool:
    """Whether backward through the inputs of a partial list-group call ends the group's backward.

    A call of some of a list group's modules, not completing the group, gets no pre-backward
    hook and its gradients queue nothing (torch's rule): its inputs' gradients end it, as
    backward reaches them, unless its backward already ended.
    """
    return state is not TrainingState.POST_BACKWARD


def ends_at_callback(
    state: TrainingState, *, reduces: bool, holds_grads: Callable[[], bool]
) -> bool:
    """Whether the end-of-backward callback ends a group's backward.

    So it does for a group that backward reached but whose count never completed (a
    parameter got no gradient), and for one holding gradients nobody took, unless they are
    kept without gradient sync by its own end in this backward (``reduces`` False): they wait
    for the next backward, and ending it again would only look at them. ``holds_grads`` (a
    walk over the group's parameters) is asked only where it decides.
    """
    if state is TrainingState.PRE_BACKWARD:
        return True
    if state is TrainingState.POST_BACKWARD and not reduces:
        return False
    return holds_grads()


def reductions_to_finish(in_flight: int, limit: int) -> int:
    """How many of the oldest reductions in flight to finish before starting another."""
    return max(0, in_flight - limit + 1)


class StepDriver(Generic[G]):
    """The step's sequence: each hook's operations, in order, written once.

    The engine's module hooks and the planner's replay call these methods; the decisions are
    this module's functions and :class:`StepSchedule`, the effects the ``ops``'.
    """

    def __init__(self, ops: StepOps[G], schedule: StepSchedule[G] | None = None) -> None:
        """Drive ``ops`` with ``schedule``'s orders (a new schedule if None)."""
        self.ops = ops
        self.schedule: StepSchedule[G] = schedule if schedule is not None else StepSchedule()

    # --- forward ----------------------------------------------------------------------------

    def root_pre_forward(self) -> None:
        """The root's pre-forward: buffers may wait for reuse; a new forward order starts."""
        with self.ops.profiled("root_pre_forward"):
            self.ops.keep_idle_buffers(True)
            self.schedule.begin_forward()

    def pre_forward(self, group: G) -> None:
        """A group's (first) pre-forward: gather it, then prefetch what comes next."""
        ops = self.ops
        with ops.profiled("pre_forward", group):
            self._gather_for_forward(group)
            targets = self.schedule.ran_forward(group, ops.settings(group).forward_prefetch)
            ops.event("pre_forward", group)
            # After this group's wait, before its compute is queued: on CUDA the next
            # all-gather runs beside this compute. See [Note: gpu schedule].
            self._prefetch("forward_prefetch", targets)

    def _gather_for_forward(self, group: G) -> None:
        self.ops.set_state(group, TrainingState.FORWARD)
        self.ops.unshard(group)
        self.ops.wait(group)

    def _prefetch(self, label: str, targets: Iterable[G]) -> None:
        for target in targets:
            with self.ops.profiled(label, target):
                self.ops.unshard(target, prefetch=True)

    def post_forward(self, group: G) -> None:
        """A group's (last) post-forward: free, keep or slice it; backward's order grows."""
        with self.ops.profiled("post_forward", group):
            self._after_forward(group)
            self.ops.set_state(group, TrainingState.IDLE)
            self.schedule.finished_forward(group)
            self.ops.event("post_forward", group)

    def output_needs_grad(self, group: G) -> None:
        """An output of ``group``'s forward needs a gradient: backward will reach it."""
        self.schedule.output_needs_grad(group)

    def root_post_forward(self, groups: Iterable[G]) -> None:
        """The root's post-forward: buffers go back, groups gathered but not run are freed.

        Activations peak now, at the turn to backward: idle communication buffers would add to
        that peak. ``groups``: those the policy applies to (a group still inside its forward,
        where the root is nested in it, is left alone).
        """
        self.ops.keep_idle_buffers(False)
        ops = self.ops
        gathered = [
            g for g in groups if ops.is_unsharded(g) and ops.state(g) is not TrainingState.FORWARD
        ]
        self.schedule.finished_root_forward(gathered)
        for group in gathered:
            self._after_forward(group)

    def resume_forward(self, group: G) -> None:
        """A partial list-group call after an earlier one's backward ended: gather it again."""
        with self.ops.profiled("pre_forward", group):
            self._gather_for_forward(group)
            self.ops.event("pre_forward", group)

    def _after_forward(self, group: G) -> None:
        action = after_forward(self.ops.settings(group).reshard_after_forward)
        if action is not AfterForward.KEEP:
            self.ops.free_after_forward(group, action)

    # --- backward ---------------------------------------------------------------------------

    def started_backward(self, group: G) -> bool:
        """Whether backward already reached ``group`` (gathering it again would be wasted)."""
        return self.ops.state(group) in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)

    def pre_backward(self, group: G) -> None:
        """A group's pre-backward: gather it, then prefetch the group backward reaches next."""
        if self.started_backward(group):
            return
        # torch's argument: whether no explicit prefetch was set.
        unset = not self.ops.settings(group).backward_prefetch
        self.ops.run_step("pre_backward", group, partial(self._pre_backward, group), unset)

    def regather(self, group: G) -> None:
        """Backward needs a group it already ended: gather it again (see the note's rule 6).

        A reentrant checkpoint runs its call's forward under ``no_grad``, where no input can be
        watched, and runs it again inside backward, where the group may have ended through its
        other calls' inputs. The recomputation gets the group gathered, as torch's
        ``fully_shard`` gathers it; the gradients it makes end the group once more at the
        end-of-backward callback, and their reduction adds to the first one's.
        """
        if self.ops.state(group) is TrainingState.POST_BACKWARD:
            unset = not self.ops.settings(group).backward_prefetch
            self.ops.run_step("pre_backward", group, partial(self._pre_backward, group), unset)

    def _pre_backward(self, group: G) -> None:
        ops = self.ops
        with ops.profiled("pre_backward", group):
            ops.set_state(group, TrainingState.PRE_BACKWARD)
            ops.event("pre_backward", group)
            settings = ops.settings(group)
            if settings.unshard_in_backward:
                ops.unshard(group)
                ops.wait(group)
            explicit = settings.backward_prefetch
            targets = self.schedule.backward_prefetch(group, explicit, self.started_backward)
            self._prefetch("backward_prefetch", targets)

    def grads_complete(self, group: G, *, inputs_pending: bool) -> None:
        """Rule 1: every trainable gradient of ``group`` is in (:func:`count_ends_backward`)."""
        if count_ends_backward(self.ops.state(group), inputs_pending=inputs_pending):
            self.end_backward(group)

    def inputs_done(self, group: G, *, count_complete: bool) -> None:
        """Rule 2: backward went through a frozen group's inputs (:func:`inputs_end_backward`)."""
        if inputs_end_backward(self.ops.state(group), count_complete=count_complete):
            self.end_backward(group)

    def partial_call_done(self, group: G, *, finish: bool = False) -> None:
        """Backward went through a partial list-group call's inputs (rule 5 of the note).

        Ended inside that call's forward (a chunked loss's own backward), the group goes back
        between calls: its next call, or its pre-backward, gathers it again. ``finish``: no
        end-of-backward callback comes for this backward (a chunk's own), so the reduction is
        finished here, and the gradient is there when that backward returns, as in torch.
        """
        state = self.ops.state(group)
        if not partial_call_ends_backward(state):
            return
        self.end_backward(group)
        if finish:
            self.ops.finish_reductions()
        if state is TrainingState.FORWARD:
            self.ops.set_state(group, TrainingState.IDLE)

    def end_backward(self, group: G, *, assign_now: bool = False) -> None:
        """A group's backward ends: take its gradients, free it, start its reduction.

        The one place this happens. The full parameters go before the reduction allocates
        its buffers, or both would peak together; the oldest reductions beyond the group's
        limit are finished first for the same reason. ``assign_now``: gradients that are their
        own reduction (one rank) are assigned at once, not when the callback finishes them.
        """
        step = partial(self._end_backward, group, assign_now)
        if self.ops.state(group) is TrainingState.POST_BACKWARD:
            step()  # the callback's second look (below): no post_backward of torch's
        else:
            self.ops.run_step("post_backward", group, step)

    def _end_backward(self, group: G, assign_now: bool) -> None:
        ops = self.ops
        # Ended before and looked at again by the callback (gradients came after its end): no
        # range of its own, as its first end opened one (torch's engine has none).
        again = ops.state(group) is TrainingState.POST_BACKWARD
        ops.set_state(group, TrainingState.POST_BACKWARD)
        ops.event("post_backward", group)
        settings = ops.settings(group)
        with nullcontext() if again else ops.profiled("post_backward_reshard", group):
            grads = ops.take_grads(group)
            if settings.reshard_after_backward:
                ops.reshard(group)
        if grads is None:
            return
        waits = reductions_to_finish(ops.reductions_in_flight(), settings.max_reduces_in_flight)
        if waits:
            with ops.profiled("post_backward_rs_wait", group):
                for _ in range(waits):
                    ops.finish_oldest_reduction()
        with ops.profiled("post_backward_reduce", group):
            ops.start_reduction(group, grads, assign_now=assign_now)

    def final_callback(self, groups: Sequence[G], *, last: bool, assign_now: bool) -> None:
        """The end of backward: rule 3, every reduction finished, every group freed.

        ``last``: this backward finalizes (``set_is_last_backward``); otherwise reductions
        stay in flight for the next one. ``assign_now``: see :meth:`end_backward`.
        """
        ops = self.ops
        with ops.profiled("root_post_backward_callback"):
            for group in groups:
                reduces = ops.settings(group).reduce_grads
                held = partial(ops.holds_grads, group)
                if ends_at_callback(ops.state(group), reduces=reduces, holds_grads=held):
                    self.end_backward(group, assign_now=assign_now)
            if last:
                ops.finish_reductions()
            for group in groups:
                if ops.settings(group).reshard_after_backward:
                    ops.reshard(group)
                ops.set_state(group, TrainingState.IDLE)
            self.schedule.end_backward()
