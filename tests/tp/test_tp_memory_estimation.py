"""FSDP x TP under ``FakeTensorMode``: memory estimation on fake tensors (torchtitan's flow).

torch's own ``fully_shard`` cannot shard a TP model under a fake mode (torch 2.13 and 2.15:
its mesh arithmetic on the mesh's real rank tensor meets the mode, "Please convert all Tensors
to FakeTensors first"), and shardkit failed the same way, with a message that blamed the
meshes. shardkit now joins the meshes outside the mode, and torch's ``FSDPMemTracker`` then
estimates a 2-D model's memory with no process started: here 8 fake ranks, dp 4 x tp 2.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardkit.core as sk
from shardkit.core.layout import ALIGN_BYTES
from tests.core.fake_group import fake_mesh
from tests.core.interop import cuda_mem_tracker_run

_DIM = 64
_BLOCKS = 3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(_DIM, 2 * _DIM)
        self.down = nn.Linear(2 * _DIM, _DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(x)))
        return out


def _categories(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    (by_kind,) = snapshot.values()  # one device
    return {str(getattr(kind, "value", kind)): size for kind, size in by_kind.items()}


def test_fsdp_x_tp_memory_is_estimated_on_fake_tensors() -> None:
    with fake_mesh(8), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))  # before the mode
        with FakeTensorMode():
            with torch.device("meta"):
                model = nn.Sequential(*[_Block() for _ in range(_BLOCKS)])
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            for block in model:
                parallelize_module(block, mesh["tp"], plan)
                sk.fully_shard(block, mesh=mesh["dp"])
            sk.fully_shard(model, mesh=mesh["dp"])
            inputs = torch.randn(8, _DIM)
            tracker, losses = cuda_mem_tracker_run.estimated(model, inputs)
            after = _categories(tracker.get_tracker_snapshot())
            peak = _categories(tracker.get_tracker_snapshot("peak"))
            params = list(model.parameters())
            local = [p.to_local() for p in params if isinstance(p, DTensor)]
    assert not [w for w in caught if "data pointer of FakeTensor" in str(w.message)]
    assert len(losses) == 2 and len(local) == len(params) == 4 * _BLOCKS
    # Each rank holds 1/8 of every weight and of the column layer's bias (dp 4 x tp 2), 1/4 of
    # the row layer's bias (replicated across tp): its shards, each aligned.
    per_block = (2 * _DIM * _DIM * 2 + 2 * _DIM) // 8 + _DIM // 4
    exact = sum(t.numel() * t.element_size() for t in local)
    assert exact == per_block * _BLOCKS * 4  # fp32
    assert 0 <= after["Sharded Param"] - exact < ALIGN_BYTES * len(local)
    # AdamW's two moments of every shard, and a step count per parameter.
    assert 2 * exact <= after["OptState"] <= 2 * exact + 32 * len(local)
    assert after["Inputs"] == inputs.numel() * 4
    assert peak["Total"] > after["Total"]  # forward's activations come and go
