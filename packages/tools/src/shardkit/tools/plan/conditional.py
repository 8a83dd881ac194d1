"""Conditional modules in a plan: which groups are marked, and which group anchors each.

``PlanOptions.conditional`` names the modules a script marks with ``set_conditional(True,
recurse=False)``. The engine then issues their collectives from their anchors, by the core's
rule on the modules' FQNs (``shardkit.core.conditional_schedule``); this finds the same
anchors on the planner's groups, in the order the engine registers its groups (the module
tree's pre-order, the root first), so that the step runs the same driver on indices.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from shardkit.core.conditional_schedule import Anchoring, anchor_marked
from shardkit.tools.plan.groups import GroupSpec

__all__ = ["plan_anchoring"]


def plan_anchoring(
    model: nn.Module, groups: Sequence[GroupSpec], root: int | None, conditional: Sequence[str]
) -> Anchoring[int] | None:
    """The anchoring of the groups ``conditional`` marks; None where it marks none.

    Args:
        model: the planned model (its ``named_modules()`` name the groups' modules).
        groups: the planner's groups (root last).
        root: the root's group index (None: the root holds no parameters).
        conditional: FQNs of modules whose groups are marked.

    Raises:
        ValueError: a name that is no group's module, or the root's.
    """
    if not conditional:
        return None
    names = {id(module): fqn for fqn, module in model.named_modules()}
    modules = [[names[id(m)] for m in group.call_modules] for group in groups]
    held = {fqn for fqns in modules for fqn in fqns}
    for fqn in conditional:
        if fqn not in held:
            raise ValueError(
                f"shardkit.tools.plan: conditional module {fqn!r} is not a sharded module "
                "(a unit, or one the wrap policy selects); only those can be marked"
            )
    marked = {i for i, fqns in enumerate(modules) if set(fqns) & set(conditional)}
    if root is not None and root in marked:
        raise ValueError("shardkit.tools.plan: the root cannot be conditional (every rank runs it)")
    # The engine's registration order: its states as the module tree's pre-order meets them.
    position = {id(m): i for i, m in enumerate(model.modules())}
    order = sorted(
        range(len(groups)), key=lambda i: min(position[id(m)] for m in groups[i].call_modules)
    )
    return anchor_marked(
        order, modules=lambda i: modules[i], marked=lambda i: i in marked, root_key=root
    )
