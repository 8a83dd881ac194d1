"""Conditional modules: groups some ranks skip, or run in another order than others do.

The engine's schedule assumes SPMD: every rank runs the same sharded modules in the same
order, so each group's collectives meet their peers' on every rank. A vision tower that
text-only batches skip, an early exit, blocks run as B(A(x)) on one rank and A(B(x)) on
another, or an expert with no tokens on some ranks break that: a rank waits for a gather
that never comes, or the collectives of two groups of one size pair up and exchange the
wrong data. ``FSDPModule.set_conditional`` marks such a module (``GroupOptions.conditional``);
its collectives are then issued at points every rank reaches, by its *anchor*, in one fixed
order (the groups' registration order, the same on every rank):

- **Forward.** The anchor's pre-forward gathers its marked dependents, right after its own
  gather and forward prefetch. A marked group's own pre-forward issues nothing: it waits for
  that gather and registers the full parameters; its post-forward frees nothing. The
  anchor's post-forward waits for every dependent's gather (one a rank did not run was
  never waited on) and frees them as ``reshard_after_forward`` says, where they ran or not.
  An int policy frees them as True does: a 1/n slice kept for a backward gather within n
  ranks would be one more collective whose peers depend on the control flow.
- **Backward.** The anchor's pre-backward gathers the dependents it freed, right after its
  own gather and backward prefetch. A marked group's pre-backward only waits; its gradients
  end nothing (no count, no rule of ``backward``): they stay on the full parameters.
- **The end of backward.** When the anchor's backward ends, its dependents' gradients are
  taken and reduced first, in the fixed order. A parameter with no gradient on a rank is
  reduced as zeros (``reduce.unused``), also where the module did not run at all, so that
  the group's reduction has every rank's rows: the result is the mean over ranks of each
  rank's gradient, a skipped rank counting zeros, and a parameter no rank used keeps None.
  (With the step check off, ``reduce_scatter_unused_params`` is set on marked groups and one
  zero gradient stands in where the module did not run: the zeros then stay.) The root's
  dependents are reduced by the end-of-backward callback, before it ends the other groups
  (the root's count may complete first).
- **When an inner anchor's backward ends.** Not at its count: its own gradients may all be
  in before its dependents' (experts run before the layer's projection). Its forward inputs
  pass through the tracker's watch (``backward``, rule 2), so it ends once backward is
  through them, when no dependent's gradient can still come; where they needed no
  gradient (the batch itself), at the callback (rule 3). Either is the same on every rank.
- **Orders.** Marked groups take no place in the schedule's forward and backward orders,
  so implicit prefetch neither follows nor targets them (those orders differ by rank).

A marked group's anchor is the nearest FSDP module around it that is not marked, the root
at worst (``anchors``). A root with no parameters of its own has no pre-backward group:
the dependents it anchors keep their full parameters from forward to backward.

Costs, against the same module unmarked in an SPMD program: its full parameters are held
from its anchor's pre-forward to its post-forward (not only around its own forward; all of
an anchor's dependents at once), and from the anchor's pre-backward to the anchor's end of
backward, with its full gradients; its reduction waits for that end instead of following
its own backward. Its collectives are the same ones (one all-gather per forward and per
backward where freed, one reduction), with the same bytes, on every rank including those
that skip it. An inner anchor (not marked) ends its backward when backward is through its
inputs, or at the callback, rather than at its last gradient. Other unmarked groups, in a
program with marked ones, pay a set lookup per hook; a program with none runs the plain
driver, and pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from shardkit.core.engine.anchors import Anchoring, anchor_marked
from shardkit.core.engine.backward import BackwardTracker
from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.usage_checks import in_backward
from shardkit.core.schedule import AfterForward, StepDriver, StepOps, StepSchedule
from shardkit.core.state_machines import TrainingState

__all__ = ["ConditionalDriver", "mark_conditional", "new_driver"]


def mark_conditional(groups: Sequence[FSDPParamGroup], conditional: bool, owner: str) -> None:
    """``FSDPModule.set_conditional``'s work: mark (or unmark) ``groups``.

    Raises:
        TypeError: ``conditional`` is not a bool.
        RuntimeError: a group's root is already set up (a forward or ``unshard`` ran): its
            driver is chosen then.
    """
    if not isinstance(conditional, bool):
        raise TypeError(f"set_conditional takes a bool, got {type(conditional).__name__}")
    for group in groups:
        if group.comm is not None and group.options.conditional != conditional:
            raise RuntimeError(
                f"set_conditional: FSDP module {group.fqn or owner} already ran a forward (or "
                "an unshard); mark conditional modules before the first one (the root's "
                "schedule for them is set up then)"
            )
    for group in groups:
        group.options.conditional = conditional


def new_driver(
    ops: StepOps[FSDPParamGroup],
    root: nn.Module,
    root_groups: Sequence[FSDPParamGroup],
    groups: Sequence[FSDPParamGroup],
    tracker: Callable[[], BackwardTracker],
) -> StepDriver[FSDPParamGroup]:
    """The root's driver: the plain one unless a group under it is marked conditional.

    Args:
        ops: the engine's operations on the root's groups.
        root: the root module.
        root_groups: the root's own groups.
        groups: every group under the root, in registration order (the same on every rank).
        tracker: the root's backward tracker (made after the driver, which it reports to).

    Raises:
        ValueError: one of the root's own groups is marked (every rank runs the root).
    """
    if not any(g.options.conditional for g in groups):
        return StepDriver(ops)
    for group in root_groups:
        if group.options.conditional:
            raise ValueError(
                f"set_conditional: the root FSDP module ({type(root).__name__}) cannot be "
                "conditional: every rank runs it, and its hooks issue the conditional "
                "modules' collectives. Mark its submodules (set_conditional(True, "
                "recurse=True) on the root marks the root too)"
            )
    return ConditionalDriver(ops, anchor_marked(root, root_groups, groups), tracker)


class ConditionalDriver(StepDriver[FSDPParamGroup]):
    """The step's sequence with marked groups anchored (see the module docstring)."""

    def __init__(
        self,
        ops: StepOps[FSDPParamGroup],
        anchoring: Anchoring,
        tracker: Callable[[], BackwardTracker],
        schedule: StepSchedule[FSDPParamGroup] | None = None,
    ) -> None:
        """Drive ``ops``; each anchor of ``anchoring`` issues its dependents' collectives."""
        super().__init__(ops, schedule)
        self.anchoring = anchoring
        self._marked = frozenset(anchoring.marked)
        self._dependents = anchoring.dependents
        self._root_key = anchoring.root_key
        self._inner = anchoring.inner()
        # Inner anchors whose inputs this forward needed gradients: backward through them ends
        # their backward (``backward``, rule 2), after their dependents' gradients are in.
        self._watched: set[FSDPParamGroup] = set()
        self._tracker = tracker
        for anchor in self._inner:
            for module in anchor.modules:
                module.register_forward_pre_hook(self._input_watch(anchor), with_kwargs=True)

    # --- forward ----------------------------------------------------------------------------

    def root_pre_forward(self) -> None:
        """As the plain driver's; a root without parameters gathers its dependents here."""
        super().root_pre_forward()
        if self._root_key is None:
            self._gather(self._dependents.get(None, ()))

    def pre_forward(self, group: FSDPParamGroup) -> None:
        """A marked group waits for its anchor's gather; an anchor issues its dependents'."""
        if group in self._marked:
            self._wait_gathered(group, "forward")
            self.ops.set_state(group, TrainingState.FORWARD)
            self.ops.event("pre_forward", group)
            return
        super().pre_forward(group)
        dependents = self._dependents.get(group)
        if dependents:
            self._gather(dependents)

    def post_forward(self, group: FSDPParamGroup) -> None:
        """A marked group frees nothing; an inner anchor frees its dependents before itself."""
        if group in self._marked:
            self.ops.set_state(group, TrainingState.IDLE)
            self.ops.event("post_forward", group)
            return
        dependents = self._inner.get(group)
        if dependents:
            self._after_forward_of(dependents, keep=False)
        super().post_forward(group)

    def root_post_forward(self, groups: Iterable[FSDPParamGroup]) -> None:
        """The root's dependents are freed (a root without parameters keeps them)."""
        self._after_forward_of(self.anchoring.at_root(), keep=self._root_key is None)
        # The plain rule would free every marked group gathered: inner anchors did theirs.
        super().root_post_forward([g for g in groups if g not in self._marked])

    def _after_forward_of(self, dependents: Sequence[FSDPParamGroup], *, keep: bool) -> None:
        """Finish each gather (a rank that skipped a module never waited), free as set."""
        for group in dependents:
            if not self.ops.is_unsharded(group):
                continue
            self.ops.wait(group)
            if not keep and self.ops.settings(group).reshard_after_forward is not False:
                self.ops.free_after_forward(group, AfterForward.FREE)  # an int as True

    # --- backward ---------------------------------------------------------------------------

    def pre_backward(self, group: FSDPParamGroup) -> None:
        """A marked group waits; an anchor gathers its freed dependents after its own work."""
        if group in self._marked:
            if self.started_backward(group):
                return
            self._wait_gathered(group, "backward")
            self.ops.set_state(group, TrainingState.PRE_BACKWARD)
            self.ops.event("pre_backward", group)
            return
        super().pre_backward(group)
        dependents = self._dependents.get(group)
        if dependents:
            self._gather(dependents)

    def grads_complete(self, group: FSDPParamGroup, *, inputs_pending: bool) -> None:
        """A marked group's count ends nothing; nor an inner anchor's with no input watched.

        An inner anchor ends where backward is through its inputs (its dependents' gradients
        are in by then); where its inputs needed no gradient, at the callback.
        """
        if group in self._marked:
            return
        if group in self._inner and group not in self._watched:
            return
        super().grads_complete(group, inputs_pending=inputs_pending)

    def inputs_done(self, group: FSDPParamGroup, *, count_complete: bool) -> None:
        """As :meth:`grads_complete`: a marked group's backward ends at its anchor's end."""
        if group not in self._marked:
            super().inputs_done(group, count_complete=count_complete)

    def end_backward(self, group: FSDPParamGroup, *, assign_now: bool = False) -> None:
        """An inner anchor's end of backward reduces its dependents' gradients first."""
        dependents = self._inner.get(group)
        if dependents and self.ops.state(group) is not TrainingState.POST_BACKWARD:
            self._end_dependents(dependents, assign_now)
        super().end_backward(group, assign_now=assign_now)

    def final_callback(
        self, groups: Sequence[FSDPParamGroup], *, last: bool, assign_now: bool
    ) -> None:
        """The root's dependents' reductions first, in the fixed order; then the rest.

        Also the dependents of inner anchors that backward never reached (every rank alike, as
        the anchors are not marked): their gradients, zeros at least, are reduced all the same.
        """
        self._end_dependents(self.anchoring.marked, assign_now)
        super().final_callback(groups, last=last, assign_now=assign_now)
        self._watched.clear()

    # --- the dependents ---------------------------------------------------------------------

    def _gather(self, dependents: Sequence[FSDPParamGroup]) -> None:
        for group in dependents:
            if not self.ops.is_unsharded(group):
                with self.ops.profiled("conditional_prefetch", group):
                    self.ops.unshard(group, prefetch=True)

    def _end_dependents(self, dependents: Sequence[FSDPParamGroup], assign_now: bool) -> None:
        """Take and reduce each dependent's gradients, zeros where this rank has none."""
        ops = self.ops
        for group in dependents:
            if ops.state(group) is TrainingState.POST_BACKWARD:
                continue  # its anchor's end reduced it
            if not ops.is_unsharded(group):
                ops.unshard(group)  # every rank alike: the same policies freed it everywhere
            ops.wait(group)
            if group.reducer.reduces_zeros():
                # Zeros where this rank has no gradient, even where it never ran the module;
                # None back where no rank used a parameter (``reduce.unused``).
                group.ran_forward_with_grad = True
            elif group.mesh_info.shard_size * group.mesh_info.replicate_size > 1:
                # Step check off: torch's switch, set at every reduction (sizes must agree,
                # whatever a recursive setter last said); the zeros stay as gradients.
                group.options.reduce_scatter_unused_params = True
                if group.options.reduce_grads and not ops.holds_grads(group):
                    _stand_in_zero_grad(group)
            super().end_backward(group, assign_now=assign_now)

    def _wait_gathered(self, group: FSDPParamGroup, where: str) -> None:
        """Finish the anchor's gather of ``group``; never issue one (its peers may not)."""
        if not self.ops.is_unsharded(group):
            raise RuntimeError(
                f"conditional FSDP module {group.fqn}: its {where} ran where its anchor had "
                "not gathered its parameters (a conditional module runs inside the forward of "
                "the nearest FSDP module around it that is not conditional, and its backward "
                "after that one's pre-backward); gathering it here would issue a collective "
                "that ranks which skip it never issue"
            )
        self.ops.wait(group)

    def _input_watch(self, anchor: FSDPParamGroup) -> Callable[..., Any]:
        """A forward pre-hook passing ``anchor``'s inputs through the tracker's watch."""

        def watch(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
            if not torch.is_grad_enabled() or in_backward():
                return None  # no backward to watch, or a recomputation inside one
            wrapped = self._tracker().wrap_inputs(anchor, args, kwargs)
            if wrapped[0] is not args or wrapped[1] is not kwargs:
                self._watched.add(anchor)
            return wrapped

        return watch


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
