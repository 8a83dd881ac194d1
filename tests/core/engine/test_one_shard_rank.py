"""A shard axis of one rank (one process, HSDP (R, 1), replicate-only ``dp_mesh_dims``): each
shard is its whole parameter, so the unsharded parameters view the shards themselves and no
second copy of the model exists. Training is covered by the parity tests at these shapes
(test_parity.py at W=1, test_hsdp.py at (2, 1)); this checks the memory."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.core import MixedPrecisionPolicy, fully_shard
from tests.core import models


def _storages(model: Any) -> dict[str, int]:
    """Each registered parameter's storage address (its local tensor's for a DTensor)."""
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        out[name] = local.untyped_storage().data_ptr()
    return out


def _views_body(rank: int, world_size: int, mp: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    model = models.build("mlp")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    sharded = _storages(model)
    model.unshard()
    for block in model.blocks:
        block.unshard()
    unsharded = _storages(model)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.reshard()
    for block in model.blocks:
        block.reshard()
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {
        "shared": sorted(n for n in sharded if sharded[n] == unsharded[n]),
        "names": sorted(sharded),
        "same values": all(
            values[n].float().equal(full[n].to(values[n].dtype).float()) for n in full
        ),
    }


def test_unsharded_parameters_view_the_shards() -> None:
    result = run_on_ranks(2, _views_body, mp=False)[0]
    assert result["shared"] == result["names"]  # every one: no second copy
    assert result["same values"]


def test_a_cast_to_param_dtype_still_has_its_own_buffer() -> None:
    result = run_on_ranks(2, _views_body, mp=True)[0]
    assert result["shared"] == []
    assert result["same values"]
