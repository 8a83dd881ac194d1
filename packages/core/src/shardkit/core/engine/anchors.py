"""Which group issues each conditional group's collectives: its anchor (``conditional``).

A marked group's anchor is the nearest FSDP module around it that is not marked, the root
at worst: every rank runs it whenever any rank may run the marked module, so its hooks are
points every rank reaches. Each anchor's dependents keep the groups' registration order,
the same on every rank: the order their collectives are issued in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from shardkit.core.engine.group.param_group import FSDPParamGroup

__all__ = ["Anchoring", "anchor_marked"]


@dataclass(frozen=True, slots=True)
class Anchoring:
    """The marked groups under one root, grouped by their anchors."""

    marked: tuple[FSDPParamGroup, ...]
    """Every marked group, in registration order."""
    root_key: FSDPParamGroup | None
    """The root's last group, the key of the dependents it anchors (None: it has none)."""
    dependents: dict[FSDPParamGroup | None, tuple[FSDPParamGroup, ...]]
    """Per anchor (its state's last group; ``root_key`` for the root), its dependents."""

    def at_root(self) -> tuple[FSDPParamGroup, ...]:
        """The dependents the root anchors (reduced by the end-of-backward callback)."""
        return self.dependents.get(self.root_key, ())

    def inner(self) -> dict[FSDPParamGroup, tuple[FSDPParamGroup, ...]]:
        """The anchors other than the root, with their dependents."""
        root = self.root_key
        return {a: d for a, d in self.dependents.items() if a is not None and a is not root}


def anchor_marked(
    root: nn.Module, root_groups: Sequence[FSDPParamGroup], groups: Sequence[FSDPParamGroup]
) -> Anchoring:
    """Each marked group of ``groups`` (a root's, in registration order) with its anchor.

    Args:
        root: the root module.
        root_groups: the root's own groups.
        groups: every group under the root.
    """
    parent: dict[int, nn.Module] = {}
    for module in root.modules():
        for child in module.children():
            parent.setdefault(id(child), module)
    owner: dict[int, FSDPParamGroup | None] = {}
    for group in groups:
        if not group.options.conditional:
            for module in group.modules:
                owner[id(module)] = group  # a state's last group: it gathers after the others
    root_key = root_groups[-1] if root_groups else None
    owner[id(root)] = root_key  # None where the root holds no parameters
    dependents: dict[FSDPParamGroup | None, list[FSDPParamGroup]] = {}
    marked = tuple(g for g in groups if g.options.conditional)
    for group in marked:
        anchor = root_key
        above = parent.get(id(group.modules[0]))
        while above is not None:
            if id(above) in owner:
                anchor = owner[id(above)]
                break
            above = parent.get(id(above))
        dependents.setdefault(anchor, []).append(group)
    return Anchoring(marked, root_key, {a: tuple(d) for a, d in dependents.items()})
