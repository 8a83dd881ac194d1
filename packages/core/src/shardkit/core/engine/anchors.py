"""The engine's groups anchored: each conditional group with the group that issues its work.

Which group anchors which is ``conditional_schedule``'s rule, on the modules' FQNs, so that
the planner finds the same anchors on its own groups. This names the engine's groups for
it: each group's modules by FQN from the root, in the registration order of the groups
(module tree pre-order, the same on every rank).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from shardkit.core.conditional_schedule import Anchoring, anchor_marked
from shardkit.core.engine.group.param_group import FSDPParamGroup

__all__ = ["anchor_groups"]


def anchor_groups(
    root: nn.Module, root_groups: Sequence[FSDPParamGroup], groups: Sequence[FSDPParamGroup]
) -> Anchoring[FSDPParamGroup]:
    """Each marked group of ``groups`` (a root's, in registration order) with its anchor.

    Args:
        root: the root module.
        root_groups: the root's own groups.
        groups: every group under the root.
    """
    names = {id(module): fqn for fqn, module in root.named_modules()}
    return anchor_marked(
        groups,
        modules=lambda group: [names[id(module)] for module in group.modules],
        marked=lambda group: group.options.conditional,
        root_key=root_groups[-1] if root_groups else None,
    )
