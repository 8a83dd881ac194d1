"""Which FSDP module each of torch's ``fully_shard`` collectives is for, from public torch only.

shardkit's engine names the group each collective serves; torch's ``fully_shard`` does not, and
the running module is a poor stand-in: its reduce-scatters run from each group's post-backward,
often after the module's backward hooks have exited, and the root's from the final callback of
the backward pass, so they read as the parent's or the root's. This works the group out after
the run from what any program exposes (see [Note: observing torch programs] in docs/notes/004):

- The groups: every ``torch.distributed.fsdp.FSDPModule`` (and shardkit's) the scope saw, with
  the parameters it manages (those in its tree under no nested FSDPModule). They are DTensors
  sharded over one mesh axis; each rank's padded shard is ``ceil(dim / W)`` slices of the
  shard dim (torch's even chunking). A group's all-gather input, and its reduce-scatter
  output, is that many elements of one dtype (the param or reduce dtype): so a collective's
  bytes, on the group's process group, name the groups it can be for.
- Among groups of the same size (identical blocks), the order decides: a backward pass
  gathers and reduces groups in the reverse of the order they ran forward (the latest forward
  first), and a forward pass gathers them in forward order. Each group is served once per
  pass and kind.

Only collectives with no ``serves`` yet (the engine did not say) and of kind all-gather or
reduce-scatter are attributed; one that fits no group keeps None (the report falls back to
the running module).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardkit.tools.records import CollectiveRecord, Phase, PhaseSpan

__all__ = ["FSDPGroup", "attribute", "fsdp_groups"]

_ELEMENT_SIZES = (1, 2, 4, 8)
"""Bytes per element a gathered parameter or a reduced gradient can have."""


@dataclass(frozen=True, slots=True)
class FSDPGroup:
    """One ``fully_shard`` call: its module's name and the size of one rank's shard."""

    fqn: str
    """The module's name as the scope knows it ('' for the root)."""
    process_group: str | None
    """The name of the process group it shards over (the mesh's shard axis); None when it
    could not be resolved (destroyed already): then the group size stands in for it."""
    shard_numel: int
    """Elements of one rank's padded shards of all its parameters."""
    shard_world: int = 1
    """Ranks its parameters are sharded over."""
    numel: int = 0
    """Elements of its parameters, unsharded and unpadded (Ψ of the group)."""
    trainable_numel: int = 0
    """Of which trainable (what its reduce-scatter carries)."""
    param_count: int = 0
    """How many parameters it manages."""

    def element_size(self, record: CollectiveRecord, slack: int = 0) -> int | None:
        """Bytes per element of ``record`` if it can be this group's gather or reduction.

        ``slack`` bytes per parameter allow for an engine's alignment padding.
        """
        if self.shard_numel == 0:
            return None
        if record.kind == "all_gather":
            shard_bytes = record.input_bytes
        elif record.kind == "reduce_scatter":
            shard_bytes = record.input_bytes // max(record.group_size, 1)
        else:
            return None
        sizes = [s for s in _ELEMENT_SIZES if shard_bytes - s * self.shard_numel >= 0]
        if not sizes:
            return None
        size = sizes[-1]
        return size if shard_bytes - size * self.shard_numel <= slack * self.param_count else None

    def fits(self, record: CollectiveRecord) -> bool:
        """Whether ``record`` can be this group's all-gather or reduce-scatter, exactly."""
        if self.process_group is not None and record.group != self.process_group:
            return False
        if record.group_size != self.shard_world:
            return False
        return self.element_size(record) is not None


def _fsdp_classes() -> tuple[type, ...]:
    """Torch's FSDPModule, and shardkit's where shardkit-core is installed."""
    try:
        from shardkit.core import FSDPModule as ShardkitFSDPModule
    except ImportError:  # shardkit-core is optional
        return (FSDPModule,)
    return (FSDPModule, ShardkitFSDPModule)


def _managed(module: nn.Module, classes: tuple[type, ...]) -> list[nn.Parameter]:
    """Parameters in ``module``'s tree under no nested FSDP module, each once."""
    found: dict[int, nn.Parameter] = {}
    stack = [module]
    while stack:
        current = stack.pop()
        for param in current.parameters(recurse=False):
            found.setdefault(id(param), param)
        stack.extend(c for c in current.children() if not isinstance(c, classes))
    return list(found.values())


def _shard_numel(param: DTensor) -> tuple[int, str | None, int] | None:
    """(padded shard elements, process group name, shard world) of a parameter.

    None unless the parameter is sharded on one mesh axis (replicated on any other).
    """
    sharded = [(i, p) for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    if len(sharded) != 1 or not all(isinstance(p, Shard | Replicate) for p in param.placements):
        return None  # sharded on two axes (tensor parallelism, too): not modelled here
    axis, placement = sharded[0]
    mesh = param.device_mesh
    world = mesh.size(axis)
    shape = list(param.shape)
    shape[placement.dim] = math.ceil(shape[placement.dim] / world)
    try:
        name: str | None = mesh.get_group(axis).group_name
    except RuntimeError:  # the process group is destroyed (a report written at exit)
        name = None
    return math.prod(shape), name, world


def fsdp_groups(named_modules: Iterable[tuple[str, nn.Module]]) -> list[FSDPGroup]:
    """The torch ``fully_shard`` groups among ``named_modules``.

    Groups whose parameters are not all sharded DTensors right now (unsharded, or sharded on
    two mesh axes) are left out.
    """
    classes = _fsdp_classes()
    groups = []
    for fqn, module in named_modules:
        if not isinstance(module, classes):
            continue
        params = _managed(module, classes)
        sizes = [_shard_numel(p) if isinstance(p, DTensor) else None for p in params]
        known = [s for s in sizes if s is not None]
        if not known or len(known) != len(sizes) or len({pg for _, pg, _ in known}) != 1:
            continue
        groups.append(
            FSDPGroup(
                fqn,
                known[0][1],
                sum(n for n, _, _ in known),
                shard_world=known[0][2],
                numel=sum(p.numel() for p in params),
                trainable_numel=sum(p.numel() for p in params if p.requires_grad),
                param_count=len(params),
            )
        )
    return groups


def attribute(
    records: Sequence[CollectiveRecord],
    groups: Sequence[FSDPGroup],
    spans: Sequence[PhaseSpan],
    forward_ends: Sequence[float],
) -> list[CollectiveRecord]:
    """``records`` with ``serves`` set where the group is known (see the module docstring).

    Args:
        records: Every collective, in issue order.
        groups: The FSDP groups (:func:`fsdp_groups`).
        spans: The scope's compute spans (their forward spans give the groups' order).
        forward_ends: When each outermost forward returned: a forward pass is what comes
            before its end, its backward pass what comes after it, up to the next forward.
    """
    if not groups:
        return list(records)
    forward_ends = _pass_ends(forward_ends, spans)
    names = {g.fqn for g in groups}
    # The groups in the order they started forward, per forward pass.
    order: dict[int, list[str]] = defaultdict(list)
    for span in sorted(spans, key=lambda s: s.start_s):
        if span.phase is Phase.FORWARD and span.module in names:
            index = bisect.bisect_left(forward_ends, span.start_s)
            if span.module not in order[index]:
                order[index].append(span.module)
    served: dict[tuple[int, bool, str], set[str]] = defaultdict(set)
    result = []
    for record in records:
        if record.serves is None and record.kind in ("all_gather", "reduce_scatter"):
            forward = record.phase is Phase.FORWARD
            index = bisect.bisect_left(forward_ends, record.start_s)
            index = index if forward else index - 1  # a backward follows its forward's end
            done = served[(index, forward, record.kind)]
            fqn = _pick(record, groups, order.get(index, []), done, forward)
            if fqn is not None:
                done.add(fqn)
                record = dataclasses.replace(record, serves=fqn)
        result.append(record)
    return result


def _pass_ends(forward_ends: Sequence[float], spans: Sequence[PhaseSpan]) -> list[float]:
    """The forward ends that end a forward pass.

    Not those inside a backward pass: the recomputation of an activation-checkpointed block
    runs forward within that block's backward.
    """
    merged: list[list[float]] = []  # the backward spans' union, as sorted disjoint intervals
    for span in sorted((s for s in spans if s.phase is Phase.BACKWARD), key=lambda s: s.start_s):
        if merged and span.start_s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], span.end_s)
        else:
            merged.append([span.start_s, span.end_s])
    starts = [m[0] for m in merged]
    ends = []
    for t in forward_ends:
        i = bisect.bisect_left(starts, t) - 1
        if i < 0 or not t < merged[i][1]:
            ends.append(t)
    return ends


def _pick(
    record: CollectiveRecord,
    groups: Sequence[FSDPGroup],
    forward_order: list[str],
    done: set[str],
    forward: bool,
) -> str | None:
    """The group ``record`` serves, or None.

    Among the groups it fits that this pass has not served yet: the first in forward order
    (in forward) or the last (in backward); groups that did not run forward in this pass come
    after those that did.
    """
    fitting = [g.fqn for g in groups if g.fits(record) and g.fqn not in done]
    if not fitting:
        return None
    rank = {fqn: i for i, fqn in enumerate(forward_order)}
    ran = [f for f in fitting if f in rank]
    if not ran:
        return fitting[0]
    return min(ran, key=rank.__getitem__) if forward else max(ran, key=rank.__getitem__)
