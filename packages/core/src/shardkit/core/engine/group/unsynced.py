"""A group's gradients without gradient sync: kept unsharded for the next backward to add to.

``set_requires_gradient_sync(False)``: where a group's backward ends, its full gradients are
not reduced but stashed on each parameter (in the reduce dtype, or the parameter's own with
``unsynced_grads_in_param_dtype``), for the next backward's to accumulate into. Split out of
``param_group``; the group calls :func:`stash_unsynced` from ``take_grads``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardkit.core.engine.group_options import GroupOptions
from shardkit.core.engine.param import FSDPParam
from shardkit.core.engine.reduce import take_sharded_grad

__all__ = ["stash_unsynced"]


def stash_unsynced(
    trainable: Sequence[FSDPParam], options: GroupOptions, reduce_dtype: torch.dtype
) -> None:
    """Keep each trainable parameter's full gradient for the next backward (no reduction)."""
    in_param_dtype = options.unsynced_grads_in_param_dtype
    for p in trainable:
        if options.reduce_accumulated_grads:
            _add_sharded_grad(p)
        p.stash_unsharded_grad(p.comm_dtype if in_param_dtype else reduce_dtype)


def _add_sharded_grad(p: FSDPParam) -> None:
    """Without sync, FSDP1's ``NO_SHARD``: the reduced gradient on ``p`` joins the unsynced one.

    Autograd adds FSDP1's unsynced gradients to the flat parameter's reduced one, in that
    one's dtype: from here on they accumulate there (``accumulated_grad``), and the next
    backward that reduces reduces the sum (``GroupView.reduce_accumulated_grads``).
    """
    if p.unsharded_param is None or p.unsharded_param.grad is None:
        return
    old = take_sharded_grad(p)
    if old is not None:
        unsynced = p.take_unsharded_grad()
        old = old.to(p.unsharded_param.device)  # an offloaded gradient comes back first
        p.accumulated_grad = old if unsynced is None else old + unsynced
