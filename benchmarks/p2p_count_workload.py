"""Point-to-point calls of a training step and of the between-step transfers, at W=3.

gloo's all-gather and reduce-scatter run as exchanges of rows (``runtime/p2p/row_exchange.py``)
and the transfers between steps (a full state dict gathered to the first rank, a checkpoint's
results) as messages through the first rank (``runtime/p2p/object_collectives.py``). W=3 is
the smallest world where "to each peer" and "to the first rank" differ in count and every
shard is padded (sizes no 3 divides). This counts ``isend`` and ``irecv`` calls per phase on
each rank, so that a change to how the runtime posts its messages is seen as a change of
counts (issue 84: the runtime's idioms made one copy each, the counts held).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

PHASES = ("step", "full state dict", "checkpoint save")
_CALLS = ("isend", "irecv", "send", "recv")


@contextmanager
def _counting(counts: Counter[str]) -> Iterator[None]:
    """Every point-to-point call of ``torch.distributed`` counted by name while inside."""
    originals = {name: getattr(dist, name) for name in _CALLS}

    def counted(name: str) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    patches = [mock.patch.object(dist, name, counted(name)) for name in _CALLS]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def count_p2p(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    """This rank's calls per phase: one step (after one to warm up), a full state dict, a save."""
    from shardkit.core import fully_shard
    from shardkit.core.checkpoint import save_dcp
    from shardkit.core.state_dict import iter_full_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 11), nn.GELU(), nn.Linear(11, 5), nn.Linear(5, 13))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    found: dict[str, dict[str, int]] = {}
    for _ in range(2):  # the first step warms up (lazy init); the second is counted
        counts: Counter[str] = Counter()
        with _counting(counts):
            model(torch.randn(4, 7)).sum().backward()
            opt.step()
            opt.zero_grad()
        found["step"] = dict(counts)
    counts = Counter()
    with _counting(counts):
        for _ in iter_full_state_dict(model):
            pass
    found["full state dict"] = dict(counts)
    counts = Counter()
    with tempfile.TemporaryDirectory() as folder:
        directory = [folder] if rank == 0 else [""]
        dist.broadcast_object_list(directory, src=0)  # every rank writes into rank 0's folder
        with _counting(counts):
            save_dcp(model.state_dict(), directory[0])
        dist.barrier()  # rank 0 removes the folder only once every rank is done with it
    found["checkpoint save"] = dict(counts)
    return found
