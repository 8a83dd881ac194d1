"""Host copies that land late: a GPU's queued device-to-host copy, made certain on a CPU.

On CUDA, a copy into pinned memory queued with ``non_blocking=True`` lands some time after the
host moves on; whether the host reads it too early depends on timing, so a race shows only now
and then. ``LateCopies`` is a ``HostCopies`` (the engine's own interface, injected through the
root's ``CommContext``) whose non-blocking copies land only when waited for: until then the
host sees NaNs. A step that reads a gradient before the engine waits trains on NaNs, every time.
"""

from __future__ import annotations

from typing import Any

import torch

from shardkit.core.engine.state_registry import state_of
from shardkit.core.runtime.device import HostCopies

__all__ = ["LOG", "LateCopies", "late_host_copies"]

LOG: list[str] = []
"""What the last ``LateCopies`` of this process saw: 'overlapped', 'blocking', 'wait'."""


class LateCopies(HostCopies):
    """Non-blocking copies read as NaN until ``wait``; blocking ones land at once."""

    def __init__(self) -> None:
        super().__init__()
        self._late: list[tuple[torch.Tensor, torch.Tensor]] = []  # (what the host holds, value)

    def to_host(self, tensor: torch.Tensor, *, non_blocking: bool) -> torch.Tensor:
        if not non_blocking:
            LOG.append("blocking")
            self.wait()  # as the engine's: the host reads this copy beside the earlier ones
            return tensor.clone()
        LOG.append("overlapped")
        host = torch.full_like(tensor, float("nan"))
        self._late.append((host, tensor.clone()))
        return host

    def wait(self) -> None:
        if self._late:
            LOG.append("wait")
        for host, value in self._late:
            host.copy_(value)
        self._late.clear()
        super().wait()

    @property
    def landed(self) -> bool:
        """Whether every copy has landed."""
        return not self._late


def late_host_copies(model: Any) -> None:
    """Root ``model``'s states now (lazy init) and give its groups a ``LateCopies``."""
    LOG.clear()
    state = state_of(model)
    state.lazy_init()
    assert state.ctx is not None
    state.ctx.comm.host_copies = LateCopies()
