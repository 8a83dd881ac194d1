"""A copy of the state to save, in CPU buffers allocated once and reused by every save.

An asynchronous save writes while training goes on, and training changes the parameters and
the optimizer's moments in place. So the writer must not read the live tensors: it reads a
copy taken at the moment of the save. The copy goes into CPU buffers that the first save
allocates (pinned where an accelerator exists, so the device-to-host copy is a DMA) and every
later save overwrites, so a job pays the allocation once and its memory stays flat.

Sharded values stay sharded: a DTensor is staged as a DTensor with the same mesh, placements
and global shape whose local tensor is the buffer, so DCP writes exactly the shards it would
have written from the live state.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from shardkit.core.runtime.device import can_pin_memory, is_accelerator, wait_for_host_copies

__all__ = ["StagingBuffers"]

logger = logging.getLogger(__name__)


class StagingBuffers:
    """CPU buffers keyed by each tensor's place in the state, reused across saves.

    A tensor whose shape or dtype changed since the last save (a model that grew) gets a new
    buffer, with a log line; everything else is copied into the buffer it had.
    """

    def __init__(self, *, shared: bool = False) -> None:
        """``shared``: buffers in shared memory, for a writer process to read in place."""
        self._buffers: dict[str, torch.Tensor] = {}
        self._copied_from_device = False
        self._shared = shared
        self._allocated = False
        self.generation = 0
        """Counts the saves that allocated a buffer: a writer process holding the buffers of
        an older generation must be sent them again."""

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` that later changes to it do not reach.

        ``Stateful`` values are replaced by their ``state_dict()`` (as DCP does at the top
        level); tensors and DTensors are copied into the buffers; other leaves are deep-copied.
        """
        self._copied_from_device = False
        self._allocated = False
        flat = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
        staged = {key: self._copy(value, key) for key, value in flat.items()}
        if self._copied_from_device:
            wait_for_host_copies()  # the copies were queued without blocking
        self.generation += self._allocated
        return staged

    @property
    def buffers(self) -> Mapping[str, torch.Tensor]:
        """Each buffer, by the tensor's place in the state ("app/model/blocks.0.w" style)."""
        return self._buffers

    def _copy(self, value: Any, key: str) -> Any:
        if isinstance(value, DTensor):
            local = self._fill(key, value.to_local())
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._fill(key, value)
        if isinstance(value, Mapping):
            return {k: self._copy(v, f"{key}/{k}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [self._copy(v, f"{key}/{i}") for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)

    def _fill(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` into its buffer (allocated on first use or when its shape changed)."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            if buffer is not None:
                logger.info("staging buffer of %s reallocated for %s", key, tensor.shape)
            if self._shared:
                # Shared memory is not pinned here: a device-to-host copy into it is staged by
                # the CPU (registering shared pages with the accelerator is left for later).
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
            else:
                buffer = torch.empty(
                    tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=can_pin_memory()
                )
            self._buffers[key] = buffer
            self._allocated = True
        from_device = is_accelerator(tensor.device)
        self._copied_from_device |= from_device
        buffer.copy_(tensor.detach(), non_blocking=from_device)
        return buffer
