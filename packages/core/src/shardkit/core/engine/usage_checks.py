"""Mistakes that would fail silently, or deep inside the engine: found early and named.

- A forward after a backward that raised, without ``reset_iter_state()``: the groups are
  still mid-backward, and the next step fails in a state transition or with ``setStorage:
  ... out of bounds``, or, when backward failed near its start, runs on while no later
  backward's reductions are ever finished.
- A root of several modules, or a tree in which a state already ran forward as a root of
  its own: refused as torch's ``fully_shard`` refuses them.
- Parameters that ``fully_shard`` replaced but something still holds, most likely an optimizer
  built before ``fully_shard``: it trains the old tensors, and nothing at all happens.
"""

from __future__ import annotations

import warnings

import torch

from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.engine.root_context import RootState

__all__ = [
    "check_backward_finished",
    "in_backward",
    "refuse_second_root",
    "warn_if_replaced_params_are_held",
]


def check_backward_finished(callback_queued: bool, fqn: str) -> None:
    """At the root's pre-forward: raise if the last backward began and never finished.

    Args:
        callback_queued: the root's end-of-backward callback is queued (a backward began).
        fqn: the root module's name, for the message.

    Raises:
        RuntimeError: outside a backward, the callback is still queued; the message says to
            call ``reset_iter_state()``.
    """
    if callback_queued and not in_backward():
        raise RuntimeError(
            f"FSDP module {fqn or '<root>'}: the previous backward did not finish (an "
            "exception was raised in it?), so this forward cannot start. After catching an "
            "exception in forward or backward, call reset_iter_state() on the root module "
            "(model.reset_iter_state()) before the next step"
        )


def warn_if_replaced_params_are_held(groups: list[FSDPParamGroup]) -> None:
    """Warn (once per root) when the parameters that fully_shard replaced are still alive.

    fully_shard puts new (sharded) Parameter objects on the modules. An optimizer built
    before it still holds the old ones and trains them, not the model: training changes
    nothing, and nothing fails. By the first forward nothing else should hold them.
    """
    held = [
        p.fqn if g.fqn in ("", "<root>") else f"{g.fqn}.{p.fqn}"
        for g in groups
        for p in g.params
        if p.original_ref() is not None
    ]
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        warnings.warn(
            f"fully_shard replaced {len(held)} parameter(s) ({shown}) that something else "
            "still references, most likely an optimizer built before fully_shard. Such an "
            "optimizer updates the old tensors and trains nothing: build the optimizer "
            "after fully_shard, from model.parameters()",
            UserWarning,
            stacklevel=2,
        )


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread now."""
    # Private torch, as torch's own fully_shard uses it: no public API tells.
    return bool(torch._C._current_graph_task_id() != -1)


def refuse_second_root(
    root: RootState, states: list[RootState], *, provisional: bool = False
) -> None:
    """Refuse a root of several modules, or a tree where a state already has a root.

    As torch's ``fully_shard`` refuses them: a list call's modules have no one tree to run
    forward through, and a state that ran forward (or ``unshard``) before the module that holds
    it was made a root of its own, with its own communication context and order; making a
    second root take it over would leave two roots driving one group. A root ``unshard()``
    made before any forward (``RootContext.provisional``) is taken over, as torch's
    ``unshard`` makes none: so a list call's modules may be gathered that way (``provisional``).
    """
    if len(root.modules) > 1 and not provisional:
        names = ", ".join(type(m).__name__ for m in root.modules)
        raise RuntimeError(
            f"FSDP requires a single root module but got [{names}]: run forward through a "
            "module that contains them all, and call fully_shard on it too"
        )
    fqns = {id(m): name for name, m in root.modules[0].named_modules()}
    for state in states:
        taken = state.ctx is not None and not state.ctx.provisional
        if state is not root and state.is_root is not None and taken:
            fqn = ", ".join(fqns.get(id(m), "?") for m in state.modules)
            raise RuntimeError(
                f"FSDP state has already been lazily initialized for {fqn}\n"
                "FSDP requires running forward through the root module first"
            )
