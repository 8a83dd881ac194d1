"""A group's unsharded flat buffer, and the full parameters that view it.

The buffer's memory exists only between unshard and reshard: resharding frees it, and the
next unshard re-allocates the same storage object and fills it (``storage`` copies the
gathered rows in, or on a shard axis of one rank the shards). See [Note: unsharded storage].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardkit.core.engine.group.plan import GroupPlan
from shardkit.core.engine.param import FSDPParam
from shardkit.core.runtime.watch.lifetimes import check_release
from shardkit.core.runtime.watch.progress import SETTINGS

__all__ = ["UnshardedBuffer"]


class UnshardedBuffer:
    """The flat buffer of a group's full parameters (those not gathered through hooks).

    Made for one plan's unsharded layout and flat parameters: the group makes a new one
    when a re-plan changes either (``GroupStorage.replanned``).
    """

    def __init__(self, params: Sequence[FSDPParam]) -> None:
        self._params = params
        self.tensor: torch.Tensor | None = None
        """The buffer (uint8), once made; its storage has 0 bytes while resharded."""

    def alias(self, sharded: torch.Tensor, plan: GroupPlan) -> None:
        """One shard rank, nothing to cast or move: the parameters view the shards' buffer."""
        if self.tensor is not sharded:
            self.tensor = sharded
            self._bind(sharded, plan)

    def allocate(self, plan: GroupPlan) -> torch.Tensor:
        """The buffer with its memory, made on first use (contents undefined)."""
        buffer = self.tensor
        nbytes = plan.layout.unsharded.nbytes
        if buffer is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=plan.device)
            self.tensor = buffer
            self._bind(buffer, plan)
        elif buffer.untyped_storage().nbytes() == 0:
            # See [Note: unsharded storage]: same storage object, memory re-allocated.
            buffer.untyped_storage().resize_(nbytes)
        return buffer

    def free(self) -> None:
        """Give the memory back; the storage object stays for the next unshard."""
        if self.tensor is not None:
            if SETTINGS.lifetime_checks:
                names = ", ".join(p.fqn for p in self._params)
                check_release(self.tensor, f"the unsharded buffer of parameters {names}")
            self.tensor.untyped_storage().resize_(0)

    def _bind(self, buffer: torch.Tensor, plan: GroupPlan) -> None:
        storage, layout = buffer.untyped_storage(), plan.layout.unsharded
        for i in plan.flat:
            p = self._params[i]
            # A fresh tensor set onto the storage gets its own version counter, so writing the
            # next gather through the buffer does not look like an in-place change to autograd.
            flat = torch.empty(0, dtype=p.comm_dtype, device=buffer.device)
            flat.set_(
                storage, layout.offsets[i] // p.comm_dtype.itemsize, (layout.numels[i],), (1,)
            )
            p.bind_unsharded(flat)
