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
at worst (:func:`anchor_marked`, from the modules' FQNs). A root with no parameters of its
own has no pre-backward group: the dependents it anchors keep their full parameters from
forward to backward.

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

Like ``schedule``, this module decides over group handles of any hashable type and loads
nothing of the engine: the engine runs :class:`ConditionalDriver` on its groups
(``engine/conditional.py`` chooses it and watches the inner anchors' inputs), the planner in
``shardkit.tools`` on group indices, so that it predicts a program with conditional modules.
Each group operation is the ``StepOps``'; ``cover_missing_grads`` is the zeros above.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from shardkit.core.schedule import StepDriver
from shardkit.core.state_machines import TrainingState
from shardkit.core.step_orders import StepSchedule
from shardkit.core.step_protocols import AfterForward, StepOps

__all__ = ["Anchoring", "ConditionalDriver", "anchor_marked"]

G = TypeVar("G", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Anchoring(Generic[G]):
    """The marked groups under one root, grouped by their anchors."""

    marked: tuple[G, ...]
    """Every marked group, in registration order."""
    root_key: G | None
    """The root's last group, the key of the dependents it anchors (None: it has none)."""
    dependents: dict[G | None, tuple[G, ...]]
    """Per anchor (its state's last group; ``root_key`` for the root), its dependents."""

    def at_root(self) -> tuple[G, ...]:
        """The dependents the root anchors (reduced by the end-of-backward callback)."""
        return self.dependents.get(self.root_key, ())

    def inner(self) -> dict[G, tuple[G, ...]]:
        """The anchors other than the root, with their dependents."""
        root = self.root_key
        return {a: d for a, d in self.dependents.items() if a is not None and a != root}


def anchor_marked(
    groups: Sequence[G],
    *,
    modules: Callable[[G], Sequence[str]],
    marked: Callable[[G], bool],
    root_key: G | None,
) -> Anchoring[G]:
    """Each marked group of ``groups`` with its anchor, found from the modules' FQNs.

    A marked group's anchor is the group of the nearest module above its first module that
    an unmarked group holds (a state's last group: it gathers after the others), the root
    at worst. Built from names alone, the engine and the planner find the same anchors.

    Args:
        groups: every group under one root, in registration order (module tree pre-order,
            the same on every rank): the order each anchor's dependents keep.
        modules: a group's modules, by FQN from the root ('' for the root itself).
        marked: whether a group is marked conditional.
        root_key: the root's last group (None: the root holds no parameters).
    """
    owner: dict[str, G | None] = {}
    for group in groups:
        if not marked(group):
            for fqn in modules(group):
                owner[fqn] = group
    owner[""] = root_key
    dependents: dict[G | None, list[G]] = {}
    chosen = tuple(g for g in groups if marked(g))
    for group in chosen:
        fqn, anchor = modules(group)[0], root_key
        while fqn:
            fqn = fqn.rpartition(".")[0]
            if fqn in owner:
                anchor = owner[fqn]
                break
        dependents.setdefault(anchor, []).append(group)
    return Anchoring(chosen, root_key, {a: tuple(d) for a, d in dependents.items()})


class ConditionalDriver(StepDriver[G]):
    """The step's sequence with marked groups anchored (see the module docstring)."""

    def __init__(
        self, ops: StepOps[G], anchoring: Anchoring[G], schedule: StepSchedule[G] | None = None
    ) -> None:
        """Drive ``ops``; each anchor of ``anchoring`` issues its dependents' collectives.

        Whoever runs the step reports an inner anchor's forward inputs that backward will pass
        through (:meth:`watching_inputs`), and backward through them (``inputs_done``).
        """
        super().__init__(ops, schedule)
        self.anchoring = anchoring
        self._marked = frozenset(anchoring.marked)
        self._dependents = anchoring.dependents
        self._root_key = anchoring.root_key
        self._inner = anchoring.inner()
        # Inner anchors whose inputs this forward needed gradients: backward through them ends
        # their backward (``backward``, rule 2), after their dependents' gradients are in.
        self._watched: set[G] = set()

    @property
    def inner_anchors(self) -> tuple[G, ...]:
        """The anchors other than the root, whose forward inputs are watched."""
        return tuple(self._inner)

    def watching_inputs(self, anchor: G) -> None:
        """Backward will pass through ``anchor``'s inputs of this forward: there it ends."""
        self._watched.add(anchor)

    # --- forward ----------------------------------------------------------------------------

    def root_pre_forward(self) -> None:
        """As the plain driver's; a root without parameters gathers its dependents here."""
        super().root_pre_forward()
        if self._root_key is None:
            self._gather(self._dependents.get(None, ()))

    def pre_forward(self, group: G) -> None:
        """A marked group waits for its anchor's gather; an anchor issues its dependents'."""
        if group in self._marked:
            self._enter_marked(group, "forward", TrainingState.FORWARD)
            return
        super().pre_forward(group)
        self._gather(self._dependents.get(group, ()))

    def post_forward(self, group: G) -> None:
        """A marked group frees nothing; an inner anchor frees its dependents before itself."""
        if group in self._marked:
            self.ops.set_state(group, TrainingState.IDLE)
            self.ops.event("post_forward", group)
            return
        dependents = self._inner.get(group)
        if dependents:
            self._after_forward_of(dependents, keep=False)
        super().post_forward(group)

    def root_post_forward(self, groups: Iterable[G]) -> None:
        """The root's dependents are freed (a root without parameters keeps them)."""
        self._after_forward_of(self.anchoring.at_root(), keep=self._root_key is None)
        # The plain rule would free every marked group gathered: inner anchors did theirs.
        super().root_post_forward([g for g in groups if g not in self._marked])

    def _after_forward_of(self, dependents: Sequence[G], *, keep: bool) -> None:
        """Finish each gather (a rank that skipped a module never waited), free as set."""
        for group in dependents:
            if not self.ops.is_unsharded(group):
                continue
            self.ops.wait(group)
            if not keep and self.ops.settings(group).reshard_after_forward is not False:
                self.ops.free_after_forward(group, AfterForward.FREE)  # an int as True

    # --- backward ---------------------------------------------------------------------------

    def pre_backward(self, group: G) -> None:
        """A marked group waits; an anchor gathers its freed dependents after its own work."""
        if group in self._marked:
            if self.started_backward(group):
                return
            self._enter_marked(group, "backward", TrainingState.PRE_BACKWARD)
            return
        super().pre_backward(group)
        self._gather(self._dependents.get(group, ()))

    def grads_complete(self, group: G, *, inputs_pending: bool) -> None:
        """A marked group's count ends nothing; nor an inner anchor's with no input watched.

        An inner anchor ends where backward is through its inputs (its dependents' gradients
        are in by then); where its inputs needed no gradient, at the callback.
        """
        if group in self._marked:
            return
        if group in self._inner and group not in self._watched:
            return
        super().grads_complete(group, inputs_pending=inputs_pending)

    def inputs_done(self, group: G, *, count_complete: bool) -> None:
        """As :meth:`grads_complete`: a marked group's backward ends at its anchor's end."""
        if group not in self._marked:
            super().inputs_done(group, count_complete=count_complete)

    def end_backward(self, group: G, *, assign_now: bool = False) -> None:
        """An inner anchor's end of backward reduces its dependents' gradients first."""
        dependents = self._inner.get(group)
        if dependents and self.ops.state(group) is not TrainingState.POST_BACKWARD:
            self._end_dependents(dependents, assign_now)
        super().end_backward(group, assign_now=assign_now)

    def final_callback(self, groups: Sequence[G], *, last: bool, assign_now: bool) -> None:
        """The root's dependents' reductions first, in the fixed order; then the rest.

        Also the dependents of inner anchors that backward never reached (every rank alike, as
        the anchors are not marked): their gradients, zeros at least, are reduced all the same.
        """
        self._end_dependents(self.anchoring.marked, assign_now)
        super().final_callback(groups, last=last, assign_now=assign_now)
        self._watched.clear()

    # --- the dependents ---------------------------------------------------------------------

    def _gather(self, dependents: Sequence[G]) -> None:
        for group in dependents:
            if not self.ops.is_unsharded(group):
                with self.ops.profiled("conditional_prefetch", group):
                    self.ops.unshard(group, prefetch=True)

    def _end_dependents(self, dependents: Sequence[G], assign_now: bool) -> None:
        """Take and reduce each dependent's gradients, zeros where this rank has none."""
        ops = self.ops
        for group in dependents:
            if ops.state(group) is TrainingState.POST_BACKWARD:
                continue  # its anchor's end reduced it
            if not ops.is_unsharded(group):
                ops.unshard(group)  # every rank alike: the same policies freed it everywhere
            ops.wait(group)
            ops.cover_missing_grads(group)
            super().end_backward(group, assign_now=assign_now)

    def _enter_marked(self, group: G, where: str, state: TrainingState) -> None:
        """A marked group's pre-forward or pre-backward: its anchor gathered it."""
        self._wait_gathered(group, where)
        self.ops.set_state(group, state)
        self.ops.event(f"pre_{where}", group)

    def _wait_gathered(self, group: G, where: str) -> None:
        """Finish the anchor's gather of ``group``; never issue one (its peers may not)."""
        if not self.ops.is_unsharded(group):
            raise RuntimeError(
                f"conditional FSDP module {self.ops.name(group)}: its {where} ran where its "
                "anchor had not gathered its parameters (a conditional module runs inside the "
                "forward of the nearest FSDP module around it that is not conditional, and its "
                "backward after that one's pre-backward); gathering it here would issue a "
                "collective that ranks which skip it never issue"
            )
        self.ops.wait(group)
