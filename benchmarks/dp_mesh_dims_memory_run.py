"""Replicate-only ``dp_mesh_dims`` (DDP-style, dp 2 x tp 2): one implementation's memory.

Usage: torchrun --nproc-per-node 4 benchmarks/dp_mesh_dims_memory_run.py IMPL BATCH
Rank 0 prints one JSON line: {"peak_mib", "rss_mib"}: the peak of live tensor memory over two
training steps (MemoryTracker), and the process's peak RSS (run with
MALLOC_MMAP_THRESHOLD_=65536).

The model is 8 Linear(1024, 1024) layers, colwise and rowwise in turn on "tp" and replicated
on "dp" (33.6 MB of parameters, 16.0 MiB per rank), each layer and the root a group; SGD with
momentum. ``BATCH`` rows per data-parallel rank set how large activations are beside it.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor import distribute_tensor as distribute

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DIM, DEPTH = 1024, 8


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = F.relu(x) if i % 2 else x
        return x


def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if not isinstance(module, nn.Linear):
        return
    colwise = int(name.rsplit(".", 1)[-1]) % 2 == 0
    for key, p in list(module.named_parameters(recurse=False)):
        tp = Shard(0) if colwise else (Shard(1) if key == "weight" else Replicate())
        module.register_parameter(
            key, nn.Parameter(distribute(p.detach(), mesh, [Replicate(), tp]))
        )


BATCH_PLACEMENTS = (Shard(0), Replicate())  # rows split over dp, the same on both tp ranks


def _inputs(module: nn.Module, args: Any, mesh: DeviceMesh) -> Any:
    return tuple(DTensor.from_local(a, mesh, BATCH_PLACEMENTS) for a in args)


def _outputs(module: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
    return out.redistribute(placements=BATCH_PLACEMENTS).to_local()


def build(impl: str) -> tuple[nn.Module, DeviceMesh]:
    """The stack on (dp 2, tp 2), replicated on dp by ``impl``'s fully_shard."""
    torch.manual_seed(0)
    model = Stack()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    distribute_module(model, mesh, _partition, _inputs, _outputs)
    first = next(iter(model.parameters()))
    assert isinstance(first, DTensor)
    mesh = first.device_mesh  # torch's fully_shard wants the parameters' mesh object
    import torch.distributed.fsdp as torch_fsdp

    import shardkit.core as shardkit_core

    api: Any = shardkit_core if impl == "shardkit" else torch_fsdp
    for module in [*model.layers, model]:
        api.fully_shard(module, mesh=mesh, dp_mesh_dims=api.DataParallelMeshDims(replicate="dp"))
    return model, mesh


def main() -> None:
    from shardkit.tools import MemoryTracker

    impl, rows = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, mesh = build(impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dp = mesh.get_local_rank(0)

    def step(seed: int) -> None:
        x = torch.randn(2 * rows, DIM, generator=torch.Generator().manual_seed(seed))
        model(x.chunk(2)[dp]).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step(0)  # the optimizer's state, lazy init
    with MemoryTracker(model, optimizers=[opt]) as tracker:
        step(1)
        step(2)
    record = {
        "peak_mib": tracker.report().peak.total / 2**20,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if dist.get_rank() == 0:
        sys.stdout.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
