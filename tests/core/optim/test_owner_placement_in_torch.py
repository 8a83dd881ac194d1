"""What torch offers for a matrix whole on one rank, the owner layout's parameter.

Issue 83's byte target is met only by the owner layout (docs/guide/muon.md, "Bytes"): each
matrix, its gradient and its momentum whole on their owner and nothing on the other ranks. No
DTensor placement says that. The nearest torch has is a DTensor replicated on a mesh of the
owner alone, which the other ranks hold as non-participants. These tests pin what that gives a
user's code on every rank, the reason the guide gives for not building the layout on it: DCP
reads it, but ``clip_grad_norm_`` refuses a model of such parameters, and on the other ranks
``full_tensor()`` and every reduction answer for an empty tensor, so ranks disagree without an
error. Should a torch release change this, these fail, and the guide's reasoning is to be
looked at again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from harness.pool import run_on_ranks


def _owned(whole: torch.Tensor, owner: int, rank: int) -> DTensor:
    """``whole`` as a DTensor on a mesh of ``owner`` alone (an empty local tensor elsewhere)."""
    mesh = DeviceMesh("cpu", [owner])
    local = whole if rank == owner else torch.empty(0)
    return DTensor.from_local(
        local, mesh, [Replicate()], shape=whole.shape, stride=whole.stride(), run_check=False
    )


def _probe_body(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    torch.manual_seed(0)
    first, second = torch.randn(4, 3), torch.randn(6, 3)
    owned = [_owned(t, owner, rank) for owner, t in enumerate((first, second))]
    weights = [torch.nn.Parameter(t) for t in owned]
    total = owned[0].sum()
    assert isinstance(total, DTensor)
    out: dict[str, Any] = {
        "full_shape": tuple(owned[0].full_tensor().shape),
        "sum": float(total.to_local()),
        "true_sum": float(first.sum()),
    }
    for weight in weights:
        weight.grad = torch.ones_like(weight)
    try:
        torch.nn.utils.clip_grad_norm_(weights, 1.0)
        out["clip"] = "ran"
    except RuntimeError as error:
        out["clip"] = str(error)
    dcp_save({"first": weights[0], "second": weights[1]}, checkpoint_id=folder)
    mesh = init_device_mesh("cpu", (world_size,))
    rows = {
        "first": distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]),
        "second": distribute_tensor(torch.zeros(6, 3), mesh, [Shard(0)]),
    }
    dcp_load(rows, checkpoint_id=folder)
    out["dcp_rows_equal"] = torch.equal(
        rows["first"].to_local(), first.chunk(world_size)[rank]
    ) and torch.equal(rows["second"].to_local(), second.chunk(world_size)[rank])
    dist.barrier()
    return out


def test_a_dtensor_on_the_owners_mesh_alone_is_not_an_owner_placement(tmp_path: Path) -> None:
    owner, other = run_on_ranks(2, _probe_body, folder=str(tmp_path / "ckpt"))
    # DCP writes the owner's whole matrix and reads it back into row blocks.
    assert owner["dcp_rows_equal"] and other["dcp_rows_equal"]
    # The owner sees its matrix; the other rank an empty tensor and a sum of 0, with no error.
    assert owner["full_shape"] == (4, 3) and other["full_shape"] == (0,)
    assert owner["sum"] == owner["true_sum"] != 0.0
    assert other["sum"] == 0.0
    # torch's clipping stacks the gradients' norms, which DTensor refuses across meshes.
    for out in (owner, other):
        assert "must have the same mesh" in out["clip"], out["clip"]
