"""Whether every rank issued the same collectives: the step check, where a root's step ends.

At the end of a backward that finishes its reductions (and of a forward no backward follows),
the root runs the runtime's step check (``runtime/watch/step_check.py``) with the flags of the
parameters its groups reduced as zeros (``reduce/unused.py``): every group's flags in the
root's order of groups, then of trainable parameters, the same on every rank. On the CPU the
verdict is compared here, before the optimizer step; on an accelerator at the root's next
forward, where the host waits anyway (the flags alone are read here, by a rank that needs
them). The same exchange tells which parameters no rank used: their gradients are settled.
See [Note: step check].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardkit.core.engine.group.param_group import FSDPParamGroup
from shardkit.core.runtime.device import holds_no_memory, is_accelerator
from shardkit.core.runtime.watch import step_check
from shardkit.core.runtime.watch.progress import SETTINGS

__all__ = ["check_step"]


def check_step(groups: Sequence[FSDPParamGroup], device: torch.device) -> step_check.Verdict | None:
    """Check the collectives since the last check; settle the unused parameters' gradients.

    Returns the verdict still to settle (on an accelerator), or None.

    Raises:
        DesyncError: on every rank, on the CPU, when the ranks' collectives differ.
    """
    if not SETTINGS.step_checks or any(holds_no_memory(g.sharded_buffer) for g in groups[:1]):
        return None  # off, or a step on fake tensors (a memory estimate): no bytes to compare
    trainable = [g.trainable for g in groups]
    flags = bytearray(sum(len(t) for t in trainable))
    offset, zeroed = 0, False
    for group, params in zip(groups, trainable, strict=True):
        zeroed |= group.reducer.unused.flag(flags, offset, params)
        offset += len(params)
    verdict = step_check.verify(bytes(flags), device)
    deferred = is_accelerator(device)
    if not deferred:
        verdict.settle()  # before any flag is trusted: they came with the digests
    # Every group settles, flags or not: a settle also ends what a deferred all-reduce carried.
    unused = verdict.flags() if zeroed else None
    offset = 0
    for group, params in zip(groups, trainable, strict=True):
        group.reducer.unused.settle(unused, offset, params)
        offset += len(params)
    return verdict if deferred else None
