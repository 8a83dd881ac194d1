"""Where in backward each gradient appears and each group reduces, read from a finished trace.

Backward runs the forward's segments in reverse (``trace``). A parameter's gradient appears
when backward reaches the last segment that used it, and is complete once backward has left
the first: so a group's gradients are all in, and the engine reduces the group, at the
earliest first use among its trainable parameters. Untraced (no inputs), a group's gradients
all appear at the end of its backward, just before it reduces.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.tools.plan.groups import GroupSpec
from shardkit.tools.plan.trace import MetaStepTrace

__all__ = ["GradientSchedule", "gradient_schedule"]


@dataclass(frozen=True, slots=True)
class GradientSchedule:
    """Where in backward each unsharded gradient appears and each group reduces."""

    appear: dict[int, list[tuple[int, int]]]
    """Segment -> (group, parameter) pairs whose gradient backward makes there."""
    reduce: dict[int, list[int]]
    """Segment -> groups whose last gradient is complete there: the engine reduces them.
    A group with a trainable parameter backward never reaches is left out (the engine
    reduces it in its end-of-backward callback)."""


def gradient_schedule(trace: MetaStepTrace, groups: list[GroupSpec]) -> GradientSchedule:
    """A gradient appears at its parameter's last use; a group's last is done at its first.

    Untraced, a group's gradients all appear at the end of its backward, just before it
    reduces (the segment after its pre-forward).
    """
    appear: dict[int, list[tuple[int, int]]] = {}
    reduce: dict[int, list[int]] = {}
    pre_index: dict[int, int] = {}
    for index, event in enumerate(trace.events):
        if event.kind == "pre":
            pre_index.setdefault(event.group, index)
    for g, group in enumerate(groups):
        trainable = [i for i, p in enumerate(group.params) if p.requires_grad]
        if not trace.traced:
            segment = pre_index[g] + 1
            appear.setdefault(segment, []).extend((g, i) for i in trainable)
            if trainable:
                reduce.setdefault(segment, []).append(g)
            continue
        uses = [trace.uses.get(group.params[i].fqn) for i in trainable]
        for i, use in zip(trainable, uses, strict=True):
            if use is not None:
                appear.setdefault(use[1], []).append((g, i))
        if trainable and all(u is not None for u in uses):
            first = min(u[0] for u in uses if u is not None)
            reduce.setdefault(first, []).append(g)
    return GradientSchedule(appear, reduce)
