"""One root's backward: how each group learns that its backward is over.

A group's backward ends when its gradients are taken: it reshards and its reduction starts
(``schedule.StepDriver.end_backward``, the one place that happens, for the engine and the
planner alike). The driver applies the rules; this tracker reports what autograd does, in one
of these ways:

1. **Its count completes.** Each trainable unsharded parameter carries a
   post-accumulate-grad hook (:meth:`BackwardTracker.grad_hook`); the last gradient of the
   group ends its backward at once, as early as possible, unless the inputs of one of its
   forward calls still wait for their gradients (2).
2. **Backward is through its inputs.** A group with frozen parameters passes the inputs of
   each forward call that need gradients through an identity function (``_AfterInputGrads``,
   in the section below) whose backward runs once autograd made those gradients inside the
   group: then no node reads its parameters any more. A group with no trainable parameter
   ends there; one with both ends when both are in. A group whose count ends nothing
   (missing gradients reduced as zeros) ends there only if every call of it since its last
   backward had inputs to watch: a call fed the batch, a detached tensor, or run with
   gradients off inside a forward that has them on (a reentrant checkpoint's) may make its
   gradients after the other calls' inputs are through, so the callback (3) ends it.
3. **The end-of-backward callback** (``StepDriver.final_callback``). A group that backward
   reached but whose count never completed (a parameter got no gradient), or that holds
   gradients nobody took, ends there.
4. **A local tree** (one rank, full parameters that are the shards): nothing is counted, and
   the callback ends every group, assigning gradients at once where that is all a reduction
   would do.
5. **A partial list-group call** (some modules of a ``fully_shard([...])`` group, not
   completing it, as a chunked loss calls the head of ``[norm, head]``): as with torch's
   ``fully_shard``, its gradients are not counted and queue no callback; the gradients of
   its inputs end the group's backward (``_after_input_grads``), finishing its reduction
   where no callback comes. A call whose forward then completes the group was not partial
   after all (``_PartialCall``).

The rules themselves are pure functions of ``schedule`` (the planner runs them too); see
[Note: post-backward trigger] for why each is as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.schedule import StepDriver, count_can_end_backward
from shardkit.core.state_machines import TrainingState

__all__ = ["BackwardTracker"]


@dataclass(slots=True)
class _PartialCall:
    """A call of some of a list group's modules: partial unless the group's forward completes.

    With two forwards before one backward, every call of the first module is partial when it
    starts. A forward that then runs the rest (the group's post-forward, or the root's) marks
    the calls completed: their inputs end nothing, the count or the callback ends the group
    (ended early, the group would be freed while the other forward's backward still reads it).
    """

    completed: bool = False


@dataclass(slots=True)
class _Count:
    """One group's gradients of the current backward."""

    ready: int = 0
    expected: int | None = None  # its trainable parameters, counted at the first gradient


# --- when backward is done with a group's inputs: their gradients are made (rules 2 and 5) ---
#
# A group whose parameters are all frozen still unshards in backward when gradients flow
# through it (to its inputs), but no gradient hook tells it when that is over, so without this
# it would stay gathered until the end-of-backward callback: a full copy of its parameters
# held through the rest of backward. A group with frozen and trainable parameters (QLoRA's
# frozen base weights and trainable adapters) may get its last gradient before autograd is
# done with the frozen ones (the input gradient through a frozen weight is a node of its own):
# it waits for this too. See [Note: post-backward trigger].
#
# Its forward inputs that need gradients pass through an identity autograd function; the
# function's backward runs once autograd has computed the gradients of those inputs inside the
# group, that is, right after the group's own backward. Gradients pass through unchanged.


class _AfterInputGrads(torch.autograd.Function):
    """Identity on its tensors; its backward calls ``done`` and passes gradients through."""

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.done = done
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.done()
        return (None, *grads)


class _InputGradsWatch:
    """Counts a group's forward calls that backward has yet to go through.

    ``done`` runs when the last of them is through: a module called twice in one forward is
    needed by both backwards, so the group may reshard only after the second. A call whose
    inputs need no gradient cannot be watched: nothing tells when autograd is done with its
    parameters (``blind``).
    """

    def __init__(self, done: Callable[[], None]) -> None:
        self._done = done
        self._pending = 0
        self._blind = False

    def wrap(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], recomputable: bool
    ) -> tuple[Any, Any]:
        """``args`` and ``kwargs`` with the tensors that need gradients passed through.

        ``recomputable``: a call with gradients off may run again inside backward (it is
        inside a forward that has them on, as a reentrant checkpoint's calls are).
        """
        if not torch.is_grad_enabled():
            # An evaluation's call makes no graph. One inside a forward with gradients on, or
            # whose inputs need gradients all the same, may be a reentrant checkpoint's: backward
            # runs it again and makes its gradients then, with nothing to watch before.
            leaves = pytree.tree_leaves((args, kwargs))
            needing = any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
            self._blind |= recomputable or needing
            return args, kwargs
        wrapped = _after_input_grads(args, kwargs, self._one_done)
        if wrapped is not None:
            self._pending += 1
            return wrapped
        # Backward never reaches this call's inputs, yet it may still reach its parameters
        # (the batch, or a detached tensor, into a trainable layer), at any point of backward.
        self._blind = True
        return args, kwargs

    def pending(self) -> bool:
        """Whether a forward call's backward through this group has yet to finish."""
        return self._pending > 0

    def blind(self) -> bool:
        """Whether a forward call since the last backward had no input to watch."""
        return self._blind

    def _one_done(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._done()

    def reset(self) -> None:
        """Forget calls whose backward never ran (the end-of-backward callback covered them)."""
        self._pending = 0
        self._blind = False


def _after_input_grads(
    args: tuple[Any, ...], kwargs: dict[str, Any], done: Callable[[], None]
) -> tuple[Any, Any] | None:
    """``args`` and ``kwargs`` passed through a function whose backward calls ``done``.

    None where no tensor among them needs a gradient (backward never reaches the call).
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    needing = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not needing:
        return None
    tensors = (leaves[i] for i in needing)
    through = _AfterInputGrads.apply(done, *tensors)  # type: ignore[no-untyped-call]
    for i, tensor in zip(needing, through, strict=True):
        leaves[i] = tensor
    wrapped: tuple[Any, Any] = pytree.tree_unflatten(leaves, spec)
    return wrapped


class BackwardTracker:
    """Where one root's groups learn that their backward is over (see the module docstring)."""

    def __init__(
        self,
        driver: StepDriver[FSDPParamGroup],
        queue_final_callback: Callable[[], None],
        is_local: Callable[[], bool],
        callback_queued: Callable[[], bool],
    ) -> None:
        """Track a root's backward.

        Args:
            driver: the root's step sequence, told what this tracker sees.
            queue_final_callback: queues the root's end-of-backward callback (once).
            is_local: whether this iteration took the local tree's path (rule 4).
            callback_queued: whether the running backward ends in that callback.
        """
        self._driver = driver
        self._queue_final_callback = queue_final_callback
        self._is_local = is_local
        self._counts: dict[FSDPParamGroup, _Count] = {}
        self._inputs: dict[FSDPParamGroup, _InputGradsWatch] = {}
        self._callback_queued = callback_queued
        self._partial: set[FSDPParamGroup] = set()  # groups a partial call ran (rule 5)
        # Per group, its partial calls since its forward last completed (``_PartialCall``).
        self._calls: dict[FSDPParamGroup, list[_PartialCall]] = {}

    # --- what the groups' hooks report ------------------------------------------------------

    def grad_hook(self, group: FSDPParamGroup) -> Callable[[torch.Tensor], None]:
        """The post-accumulate-grad hook of ``group``'s trainable unsharded parameters."""
        count = self._counts.setdefault(group, _Count())

        def grad_ready(_param: torch.Tensor) -> None:
            if group in self._partial and group.training_state is TrainingState.FORWARD:
                return  # rule 5: a backward inside the call's forward; its inputs end it
            self._queue_final_callback()
            if self._is_local():
                return  # rule 4: the callback takes every gradient
            count.ready += 1
            if count.expected is None:
                count.expected = len(group.trainable)
            if count.ready != count.expected:
                return
            if count_can_end_backward(fills_missing=group.ends_where_every_rank_does()):
                self._driver.grads_complete(group, inputs_pending=self._inputs_pending(group))

        return grad_ready

    def wrap_inputs(
        self,
        group: FSDPParamGroup,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        recomputable: bool = False,
    ) -> tuple[Any, Any]:
        """A group's forward inputs, passed through the identity that reports rule 2.

        ``recomputable``: see ``_InputGradsWatch.wrap``.
        """
        watch = self._inputs.get(group)
        if watch is None:
            watch = _InputGradsWatch(lambda: self._inputs_done(group))
            self._inputs[group] = watch
        return watch.wrap(args, kwargs, recomputable)

    def wrap_partial_call(
        self, group: FSDPParamGroup, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any]:
        """A partial list-group call's inputs, whose gradients end the group's backward (rule 5).

        One function per call, as each call's backward ends the group (torch's rule): a
        chunked loss reduces each chunk's gradients where its gradient sync is on.
        """
        self._partial.add(group)
        call = _PartialCall()
        self._calls.setdefault(group, []).append(call)
        wrapped = _after_input_grads(args, kwargs, lambda: self._partial_call_done(group, call))
        return (args, kwargs) if wrapped is None else wrapped

    def forward_completed(self, group: FSDPParamGroup) -> None:
        """Every module of ``group`` ran: its partial calls since were not partial after all."""
        for call in self._calls.pop(group, ()):
            call.completed = True

    def _partial_call_done(self, group: FSDPParamGroup, call: _PartialCall) -> None:
        if not call.completed:
            # A chunk's own backward queues no callback: its reduction is finished at once.
            self._driver.partial_call_done(group, finish=not self._callback_queued())

    def _inputs_pending(self, group: FSDPParamGroup) -> bool:
        watch = self._inputs.get(group)
        return watch is not None and watch.pending()

    def _inputs_done(self, group: FSDPParamGroup) -> None:
        self._driver.inputs_done(group, count_complete=self._count_complete(group))

    def _count_complete(self, group: FSDPParamGroup) -> bool:
        if not group.trainable:
            return True
        if not count_can_end_backward(fills_missing=group.ends_where_every_rank_does()):
            # Backward through the inputs ends it, where it went through every call's: a call
            # with no input to watch (the first of ``[a, b]`` fed the batch) may make its
            # gradients after the others' inputs are through, so the callback ends it.
            watch = self._inputs.get(group)
            return watch is None or not watch.blind()
        count = self._counts.get(group)
        return count is not None and count.ready == count.expected

    # --- the end of backward ---------------------------------------------------------------

    def reset(self) -> None:
        """Forget this backward's counts and pending inputs (its end, or an exception)."""
        for count in self._counts.values():
            count.ready, count.expected = 0, None
        for watch in self._inputs.values():
            watch.reset()
        self._partial.clear()
        self._calls.clear()
