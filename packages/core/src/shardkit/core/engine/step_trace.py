"""A record of one iteration's step, in the driver's events, for a joined rank to replay.

Under torch's ``Join``, a rank that ran out of batches shadows the others' iterations
(``engine/join``) by running the step's sequence with no compute (``engine/dry_step``). The
collectives an iteration issues, and their order, follow from the order of the driver's
events: each group's pre-forward and post-forward, its pre-backward, and the end of its
backward (which parameters then held a gradient decides the size of its reduction). Forward
gives the first two; autograd decides the other two, so no rule can tell them in general.

So they are recorded (:class:`StepTrace`, filled by ``EngineOps`` while a Join is active)
and replayed. A rank that never ran an iteration has nothing recorded: it derives the events
from the module tree (:func:`tree_trace`), taking registration order for call order, which
holds for the models that are a sequence of blocks around a root (embeddings, blocks, norm,
head). See ``engine/join`` for what is supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.param import FSDPParam
from shardkit.core.engine.root_context import RootState
from shardkit.core.schedule import count_can_end_backward

__all__ = ["EventKind", "StepTrace", "TraceEvent", "tree_trace"]

EventKind = Literal["pre_forward", "post_forward", "pre_backward", "post_backward"]
"""The driver's events that decide the collectives (``StepOps.event``'s names)."""

_KINDS: frozenset[str] = frozenset(("pre_forward", "post_forward", "pre_backward", "post_backward"))


@dataclass(slots=True)
class TraceEvent:
    """One driver event of one group."""

    kind: EventKind
    group: FSDPParamGroup
    grads: tuple[FSDPParam, ...] | None = None
    """At a backward's end: the trainable parameters that held a gradient (None: unknown, as
    without gradient sync nothing is taken; the replay then gives every one a gradient)."""


@dataclass(slots=True)
class StepTrace:
    """The driver's events of one iteration, in the order they ran."""

    events: list[TraceEvent] = field(default_factory=list)

    def record(self, what: str, group: FSDPParamGroup) -> None:
        """The driver's ``event(what, group)``; names other than the four are not kept."""
        if what in _KINDS:
            self.events.append(TraceEvent(what, group))  # type: ignore[arg-type]

    def took(
        self, group: FSDPParamGroup, grads: list[tuple[FSDPParam, torch.Tensor | None]] | None
    ) -> None:
        """The group's backward ended, taking ``grads`` (``take_grads``'s result)."""
        for event in reversed(self.events):
            if event.group is group and event.kind == "post_backward":
                if group.options.reduce_grads:
                    event.grads = tuple(p for p, g in grads or () if g is not None)
                return

    def backward_reaches(self) -> set[FSDPParamGroup]:
        """The groups whose pre-backward ran: those whose forward outputs needed gradients."""
        return {e.group for e in self.events if e.kind == "pre_backward"}


# --- a rank that never ran: the events derived from the module tree -----------------------------


@dataclass(frozen=True, slots=True)
class _Enter:
    state: RootState


@dataclass(frozen=True, slots=True)
class _Exit:
    state: RootState


@dataclass(frozen=True, slots=True)
class _Use:
    group: FSDPParamGroup
    param: FSDPParam


_Token = _Enter | _Exit | _Use


def tree_trace(root_module: nn.Module, states: Sequence[RootState]) -> StepTrace:
    """The events of an iteration whose modules run in registration order.

    Forward enters each state's modules and leaves them in the tree's order. Backward runs it
    in reverse: a state's pre-backward where its forward ended; a group's end where the
    backward passes the first use in forward of the last of its trainable parameters (as
    autograd accumulates a parameter's gradient once its every use is through), or, for a
    group with frozen parameters, not before its inputs (``backward``, rule 2); a group whose
    missing gradients are reduced as zeros where backward is through its inputs, or at the
    callback for one whose inputs are the batch (``schedule.count_can_end_backward``).
    """
    tokens = _walk(root_module, states)
    trace = StepTrace()
    for token in tokens:
        if isinstance(token, _Enter):
            trace.events += [TraceEvent("pre_forward", g) for g in token.state.groups]
        elif isinstance(token, _Exit):
            trace.events += [TraceEvent("post_forward", g) for g in token.state.groups]
    first_use: dict[int, int] = {}
    for index, token in enumerate(tokens):
        if isinstance(token, _Use):
            first_use.setdefault(id(token.param), index)
    first_any_use = min(first_use.values(), default=len(tokens))
    left = {g: {id(p) for p in g.trainable} for s in states for g in s.groups}
    ended: set[FSDPParamGroup] = set()

    def end(group: FSDPParamGroup) -> None:
        ended.add(group)
        trace.events.append(TraceEvent("post_backward", group, tuple(group.trainable)))

    for index in range(len(tokens) - 1, -1, -1):
        token = tokens[index]
        if isinstance(token, _Exit):
            trace.events += [TraceEvent("pre_backward", g) for g in reversed(token.state.groups)]
        elif isinstance(token, _Use) and first_use[id(token.param)] == index:
            group = token.group
            left[group].discard(id(token.param))
            frozen = len(group.trainable) < len(group.params)
            counts = count_can_end_backward(fills_missing=group.ends_where_every_rank_does())
            if not left[group] and not frozen and counts and group not in ended:
                end(group)
        elif isinstance(token, _Enter):
            # Entered before any parameter was used, its inputs are the batch, which needs no
            # gradient: nothing watches them, and only its count may end it before the callback.
            watched = index > first_any_use
            for group in token.state.groups:
                fills = group.ends_where_every_rank_does()
                if group in ended:
                    continue
                if watched and (fills or not left[group]):
                    end(group)  # backward through its inputs (rule 2), or its count (rule 1)
                elif not left[group] and count_can_end_backward(fills_missing=fills):
                    end(group)  # its count, before the callback
    for group in (g for state in states for g in state.groups if g not in ended):
        end(group)  # the end-of-backward callback's, in its order (rule 3)
    return trace


def _walk(root_module: nn.Module, states: Sequence[RootState]) -> list[_Token]:
    """Enter, use and exit tokens over the module tree, in registration order."""
    state_of_module = {id(m): s for s in states for m in s.modules}
    uses: dict[int, list[_Use]] = {}
    for state in states:
        for group in state.groups:
            for param in group.params:
                for slot in param.slots:
                    uses.setdefault(id(slot.module), []).append(_Use(group, param))
    # A list group's state is entered at its first module and left after its last.
    modules_left = {id(s): len(s.modules) for s in states}
    tokens: list[_Token] = []

    def visit(module: nn.Module) -> None:
        state = state_of_module.get(id(module))
        if state is not None and modules_left[id(state)] == len(state.modules):
            tokens.append(_Enter(state))
        tokens.extend(uses.get(id(module), ()))
        for child in module.children():
            visit(child)
        if state is not None:
            modules_left[id(state)] -= 1
            if modules_left[id(state)] == 0:
                tokens.append(_Exit(state))

    visit(root_module)
    return tokens
