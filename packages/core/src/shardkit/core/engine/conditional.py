"""``set_conditional`` in the engine: marking groups, and the root's driver for them.

Conditional modules are groups some ranks skip, or run in another order than others do; their
collectives are issued by their anchors, at points every rank reaches. That schedule, and its
costs, are ``conditional_schedule``'s (:class:`ConditionalDriver`, which the planner runs
too); here the engine marks its groups, chooses the root's driver, anchors its groups
(``anchors``), and passes each inner anchor's forward inputs through the backward tracker's
watch (backward through them ends the anchor's backward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from shardkit.core.conditional_schedule import ConditionalDriver
from shardkit.core.engine.anchors import anchor_groups
from shardkit.core.engine.backward import BackwardTracker
from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.usage_checks import in_backward
from shardkit.core.schedule import StepDriver
from shardkit.core.step_protocols import StepOps

__all__ = ["mark_conditional", "new_driver"]


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
    driver = ConditionalDriver(ops, anchor_groups(root, root_groups, groups))
    for anchor in driver.inner_anchors:
        watch = _input_watch(driver, anchor, tracker)
        for module in anchor.modules:
            module.register_forward_pre_hook(watch, with_kwargs=True)
    return driver


def _input_watch(
    driver: ConditionalDriver[FSDPParamGroup],
    anchor: FSDPParamGroup,
    tracker: Callable[[], BackwardTracker],
) -> Callable[..., Any]:
    """A forward pre-hook passing ``anchor``'s inputs through the tracker's watch."""

    def watch(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if not torch.is_grad_enabled() or in_backward():
            return None  # no backward to watch, or a recomputation inside one
        wrapped = tracker().wrap_inputs(anchor, args, kwargs)
        if wrapped[0] is not args or wrapped[1] is not kwargs:
            driver.watching_inputs(anchor)
        return wrapped

    return watch
