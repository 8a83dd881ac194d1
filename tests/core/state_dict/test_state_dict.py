"""state_dict is the sharded DTensors themselves; load_state_dict writes in place; DCP works."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply


def _sharded_gpt(world_size: int, reshard: bool | None = None) -> Any:
    model = models.build("gpt")
    apply(
        "shardkit",
        model,
        init_device_mesh("cpu", (world_size,)),
        Run(model="gpt", shard_kwargs={"reshard_after_forward": reshard}),
    )
    return model


def _no_copy_body(rank: int, world_size: int) -> dict[str, bool]:
    model = _sharded_gpt(world_size, reshard=False)
    x, _ = models.batch("gpt", 0, 2)
    model(x)  # with reshard_after_forward=False the full parameters stay registered
    sd = model.state_dict()
    local_names = set(models.build("gpt").state_dict())
    params = dict(model.named_parameters())
    same_storage = all(
        isinstance(sd[n], DTensor) and sd[n].to_local().data_ptr() == p.to_local().data_ptr()
        for n, p in params.items()
        if isinstance(p, DTensor) and p.to_local().numel() > 0
    )
    return {
        "keys": set(sd) == local_names,
        "all_dtensor": all(isinstance(sd[n], DTensor) for n in params),
        "same_storage": same_storage,
        "buffer_plain": not isinstance(sd["scale"], DTensor),
        "global_shapes": all(
            sd[n].shape == models.build("gpt").state_dict()[n].shape for n in params
        ),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_state_dict_is_the_sharded_params(world_size: int) -> None:
    results = run_on_ranks(world_size, _no_copy_body)
    assert all(all(r.values()) for r in results), results


def _load_in_place_body(rank: int, world_size: int) -> dict[str, bool]:
    model = _sharded_gpt(world_size)
    other = models.build("gpt", seed=7)
    apply("shardkit", other, init_device_mesh("cpu", (world_size,)), Run(model="gpt"))
    ptrs = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    model.load_state_dict(other.state_dict())
    equal = all(
        p.full_tensor().equal(q.full_tensor())
        for p, q in zip(model.parameters(), other.parameters(), strict=True)
    )
    in_place = all(
        p.to_local().data_ptr() == ptrs[n]
        for n, p in model.named_parameters()
        if p.to_local().numel() > 0
    )
    # Training still works after the load (the flat buffers were written, not replaced).
    x, y = models.batch("gpt", 0, 2)
    models.loss_of("gpt", model(x), y).backward()
    return {"equal": equal, "in_place": in_place}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_load_state_dict_writes_in_place(world_size: int) -> None:
    results = run_on_ranks(world_size, _load_in_place_body)
    assert all(all(r.values()) for r in results), results


def _train_steps(
    model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, world_size: int, rank: int
) -> list[float]:
    losses = []
    for step in steps:
        x, y = models.batch("gpt", step, 2 * world_size)
        loss = models.loss_of("gpt", model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss := loss.detach())
        losses.append(loss.item() / world_size)
    return losses


def _dcp_body(rank: int, world_size: int, path: str) -> dict[str, list[float]]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _sharded_gpt(world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_steps(model, opt, range(0, 2), world_size, rank)
    msd, osd = get_state_dict(model, opt)
    dcp_save({"model": msd, "optim": osd}, checkpoint_id=path)
    uninterrupted = _train_steps(model, opt, range(2, 5), world_size, rank)

    fresh = _sharded_gpt(world_size)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_msd, fresh_osd = get_state_dict(fresh, fresh_opt)
    dcp_load({"model": fresh_msd, "optim": fresh_osd}, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=fresh_msd, optim_state_dict=fresh_osd)
    resumed = _train_steps(fresh, fresh_opt, range(2, 5), world_size, rank)
    return {"uninterrupted": uninterrupted, "resumed": resumed}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_dcp_save_load_resumes_exactly(world_size: int, tmp_path: Path) -> None:
    results = run_on_ranks(world_size, _dcp_body, path=str(tmp_path / "ckpt"))
    assert results[0]["resumed"] == results[0]["uninterrupted"]
