"""The group events of the meta forward: where the engine's pre- and post-forward hooks fire.

A ``fully_shard`` call of one module fires its group's pre-forward before the module's forward
and its post-forward after it. A call of several modules (``fully_shard([m1, m2])``, one group)
fires them as the engine does: the pre-forward at the first of its modules to run, the
post-forward when the last of them has run; the calls in between gather nothing. Every call
casts its floating inputs to ``param_dtype``, as the engine's hooks do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn
from torch.utils import _pytree as pytree

from shardkit.tools.plan.groups import GroupSpec

__all__ = ["EventSink", "group_hooks"]

EventSink = Callable[[Literal["pre", "post"], int, Any], None]
"""Records a group event: (kind, group index, the tensors crossing it)."""


@contextmanager
def group_hooks(
    groups: list[GroupSpec], record: EventSink, param_dtype: torch.dtype | None
) -> Iterator[None]:
    """Forward hooks on every group's modules, held while the forward runs."""
    handles = []
    for index, group in enumerate(groups):
        pending: set[int] = set()  # the call's modules yet to run in this pass
        for module in group.call_modules:

            def pre(
                module: nn.Module,
                args: tuple[Any, ...],
                kwargs: dict[str, Any],
                index: int = index,
                group: GroupSpec = group,
                pending: set[int] = pending,
            ) -> tuple[tuple[Any, ...], dict[str, Any]]:
                if param_dtype is not None:
                    args, kwargs = pytree.tree_map_only(
                        torch.Tensor,
                        lambda t: t.to(param_dtype) if t.is_floating_point() else t,
                        (args, kwargs),
                    )
                if not pending:
                    pending.update(id(m) for m in group.call_modules)
                    record("pre", index, (args, kwargs))
                return args, kwargs

            def post(
                module: nn.Module,
                args: Any,
                output: Any,
                index: int = index,
                pending: set[int] = pending,
            ) -> None:
                pending.discard(id(module))
                if not pending:
                    record("post", index, output)

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
