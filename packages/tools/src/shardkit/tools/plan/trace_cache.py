"""Traces kept across plans of one model: what a search saves by not tracing twice.

The meta-device trace (``trace``) is most of a plan's cost (about a second for an 8B model),
and it depends only on which parameters form which group, in which dtype they are gathered,
which modules recompute, and the inputs and loss. A search compares many plans that differ
only in what the step does with the groups (``reshard_after_forward``, prefetching, offload),
so it asks for the same trace again and again: :class:`TraceCache` hands back the first one.

Tensor parallelism's tracer records DTensor's collectives while the trace runs, so a plan with
a TP plan is always traced afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from shardkit.tools.plan.groups import GroupSpec
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.trace import MetaStepTrace

__all__ = ["TraceCache"]


class TraceCache:
    """Traces of one model by what decides them; pass one to every ``plan()`` of a search."""

    def __init__(self) -> None:
        self._traces: dict[Hashable, MetaStepTrace] = {}
        self._model: nn.Module | None = None
        self.hits = 0
        """Plans that reused a trace."""

    def __len__(self) -> int:
        return len(self._traces)

    def get(
        self,
        model: nn.Module,
        groups: list[GroupSpec],
        options: PlanOptions,
        trace: Callable[[], MetaStepTrace],
    ) -> MetaStepTrace:
        """The trace for these groups and options: cached, else ``trace()``'s.

        Raises:
            ValueError: a model other than the one this cache has traced (its keys would
                not say which model they describe).
        """
        if self._model is None:
            self._model = model
        elif self._model is not model:
            raise ValueError("TraceCache: one cache serves one model; make another for this one")
        key = _key(groups, options)
        found = self._traces.get(key)
        if found is not None:
            self.hits += 1
            return found
        made = trace()
        self._traces[key] = made
        return made


def _key(groups: list[GroupSpec], options: PlanOptions) -> Hashable:
    """What the trace depends on.

    The groups' parameters and gather dtypes, the dtype inputs are cast to, the checkpointed
    modules, the inputs and the loss.
    """
    layout = tuple(
        (g.fqn, tuple((p.fqn, p.comm_dtype, p.requires_grad) for p in g.params)) for g in groups
    )
    cast: torch.dtype | None = options.param_dtype
    return (layout, cast, options.checkpoint, id(options.inputs), id(options.loss))
