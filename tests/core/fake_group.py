"""torch's fake process group for tests that run in this process: one rank standing for W.

Collectives on it move nothing, so a test sees what shardkit (and torch's ``fully_shard``) do
with the world size without starting W processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextmanager
def fake_mesh(world: int) -> Iterator[DeviceMesh]:
    """A 1-D CPU mesh of ``world`` ranks on the fake group, torn down at exit."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()
