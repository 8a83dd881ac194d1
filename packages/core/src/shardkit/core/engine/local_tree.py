"""A root whose every group is local: one rank, full parameters that are the shards.

At world size 1 (and no cast, offload or post-forward slice), every group's full parameters
view its shards (``GroupPlan.aliases_shards``) and its reduction is the gradient itself:
there is nothing to gather, free or communicate, only bookkeeping. The root then registers
every group's full parameters once per forward, the other groups' hooks return at once, and
the root's end-of-backward callback takes every group's gradients.
See [Note: post-backward trigger], rule 4.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardkit.core import observe
from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.runtime.dtensors import has_post_accumulate_grad_hooks

__all__ = ["enter_local_forward", "is_local_tree"]


def is_local_tree(groups: Sequence[FSDPParamGroup]) -> bool:
    """Whether a forward of this root may take the local fast path now.

    Decided at each root forward, as cheaply as the checks allow: the options and the
    parameters' dtypes (which decide ``aliases_shards``) can change between steps. A forward
    without gradients takes the usual path (it reshards at once), and so does one that
    observers watch (they see every group's transitions), and one whose parameters carry
    post-accumulate-grad hooks (optimizer-in-backward).
    """
    if not torch.is_grad_enabled() or observe.has_subscribers():
        return False
    if not all(g.plan.aliases_shards and g.mesh_info.dp_size == 1 for g in groups):
        return False
    # Optimizer-in-backward steps and frees each gradient as its group's backward ends, to
    # keep backward's peak low: taking them all at the end would defeat it.
    return not any(
        has_post_accumulate_grad_hooks(p.sharded_param) for g in groups for p in g.params
    )


def enter_local_forward(groups: Sequence[FSDPParamGroup], local: bool) -> None:
    """On the local path, register every group's full parameters now.

    They are its shards (no copy, no collective), and stay registered until the
    end-of-backward callback, which takes every group's gradients (``backward``, rule 4).
    """
    if not local:
        return
    for group in groups:
        group.unshard()
        group.wait_for_unshard()
