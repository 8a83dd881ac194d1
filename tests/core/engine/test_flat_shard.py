"""A group's flat shard: one writable 1-D tensor over its sharded buffer, and where each
parameter's local shard lies in any tensor laid out like it (gradients, optimizer state)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.core import fully_shard
from shardkit.core.layout import layout_of
from shardkit.core.torch_release import ACCUMULATES_IN_GRAD_DTYPE


def _flat_shard_body(rank: int, world_size: int) -> dict[str, bool | str]:
    torch.manual_seed(0)
    # 5 rows at W=2: uneven shards (padding) and a bias of 5 (an alignment gap after it).
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    (group,) = layout_of(model)
    flat = group.flat_shard()
    views = group.local_views(flat)
    out: dict[str, bool | str] = {}
    out["one dim"] = flat.dim() == 1 and flat.dtype == torch.float32
    out["views are the locals"] = all(
        v.data_ptr() == p.local_shard().data_ptr() and torch.equal(v, p.local_shard())
        for v, p in zip(views, group.params, strict=True)
    )
    out["values are the shards"] = all(
        torch.equal(p.local_shard(), full[p.keys[0]].chunk(world_size)[rank]) for p in group.params
    )
    covered = torch.zeros(flat.numel(), dtype=torch.bool)
    for mask in group.local_views(covered):
        mask.fill_(True)
    out["the rest is zeros"] = bool((flat[~covered] == 0).all())
    flat.add_(1.0)  # an optimizer's step on the flat shard is the parameters'
    out["writes reach the parameters"] = all(
        torch.equal(p.local_shard(), full[p.keys[0]].chunk(world_size)[rank] + 1)
        for p in group.params
    )
    grad = torch.arange(flat.numel(), dtype=torch.float32)
    out["views of another tensor"] = all(
        v.data_ptr() == grad[p.layout.storage_offset // 4 :].data_ptr()
        and v.shape == p.local_shard().shape
        for v, p in zip(group.local_views(grad), group.params, strict=True)
    )
    with pytest.raises(ValueError) as caught:
        group.local_views(flat[:-1])
    out["wrong size"] = str(caught.value)
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double().requires_grad_(False))
    fully_shard(mixed, mesh=init_device_mesh("cpu", (world_size,)))
    with pytest.raises(ValueError) as caught:
        layout_of(mixed)[0].flat_shard()
    out["mixed dtypes"] = str(caught.value)
    return out


def test_the_flat_shard_is_the_groups_buffer_and_local_views_find_each_parameter() -> None:
    for out in run_on_ranks(2, _flat_shard_body):
        for key in (
            "one dim",
            "views are the locals",
            "values are the shards",
            "the rest is zeros",
            "writes reach the parameters",
            "views of another tensor",
        ):
            assert out[key] is True, key
        assert "elements in one dim, got shape" in str(out["wrong size"])
        assert "different dtypes (torch.float32, torch.float64)" in str(out["mixed dtypes"])


def _flat_grad_body(rank: int, world_size: int, replicas: int) -> dict[str, bool]:
    """Reductions in the flat layout against the default packing: same gradients, one tensor."""
    grads: dict[bool, dict[str, torch.Tensor]] = {}
    out: dict[str, bool] = {}
    for flat_layout in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
        if replicas == 1:
            mesh = init_device_mesh("cpu", (world_size,))
        else:  # HSDP; (W, 1) is FSDP1's NO_SHARD: an all-reduce, no scatter
            mesh = init_device_mesh(
                "cpu", (replicas, world_size // replicas), mesh_dim_names=("r", "s")
            )
        fully_shard(model, mesh=mesh)
        (group,) = layout_of(model)
        if flat_layout:
            group.reduce_into_flat_layout()
        for step in range(2):  # the second accumulates into the first's gradients
            torch.manual_seed(10 + rank + step)
            model(torch.randn(4, 3)).sum().backward()
            if step == 0 and flat_layout:
                flat = group.flat_grad_of(0)
                out["a flat gradient"] = (
                    flat is not None and flat.numel() == group.flat_shard().numel()
                )
                assert flat is not None
                out["every gradient views it"] = all(
                    group.flat_grad_of(i) is not None
                    and v.data_ptr() == p.param.grad.to_local().data_ptr()  # type: ignore[union-attr]
                    for i, (v, p) in enumerate(
                        zip(group.local_views(flat), group.params, strict=True)
                    )
                )
                covered = torch.zeros(flat.numel(), dtype=torch.bool)
                for mask in group.local_views(covered):
                    mask.fill_(True)
                out["gaps are zeros"] = bool((flat[~covered] == 0).all())
            if step == 0 and not flat_layout:
                out["none by default"] = group.flat_grad_of(0) is None
        grads[flat_layout] = {
            p.keys[0]: p.param.grad.to_local().clone()  # type: ignore[union-attr]
            for p in group.params
        }
    out["same gradients"] = all(torch.equal(grads[False][k], grads[True][k]) for k in grads[False])
    return out


@pytest.mark.parametrize(("world_size", "replicas"), [(2, 1), (2, 2)])
def test_reductions_in_the_flat_layout_give_the_same_gradients_as_one_flat_tensor(
    world_size: int, replicas: int
) -> None:
    expected = ("none by default", "a flat gradient", "every gradient views it", "gaps are zeros")
    for out in run_on_ranks(world_size, _flat_grad_body, replicas=replicas):
        assert out == dict.fromkeys((*expected, "same gradients"), True), out


def _unlisted_body(rank: int, world_size: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, object] = {}
    losses: dict[str, list[float]] = {}
    for listed in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        names = [n for n, _ in model.named_parameters()]
        keys = list(model.state_dict())
        opt = torch.optim.SGD([p for g in layout_of(model) for p in (q.param for q in g.params)])
        outer = next(g for g in layout_of(model) if any(m is model for m in g.modules))
        if not listed:
            outer.list_params(False)
            out["unlisted"] = [n for n, _ in model.named_parameters()]
            out["unlisted keys"] = list(model.state_dict())
            out["attribute"] = isinstance(model[2].weight, nn.Parameter)
        losses[str(listed)] = []
        for step in range(3):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
            loss = model(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[str(listed)].append(loss.item())
        if not listed:
            model.double()  # moves the unlisted parameters too
            out["moved"] = model[2].weight.dtype == torch.float64
            out["listed again"] = [n for n, _ in model.named_parameters()] == names
            model.float()
            outer.list_params(True)
            out["names back in order"] = [n for n, _ in model.named_parameters()] == names
            out["keys back in order"] = list(model.state_dict()) == keys
    out["same losses"] = losses["True"] == losses["False"]
    return out


def test_a_group_can_hold_its_parameters_off_parameters_and_state_dict() -> None:
    for out in run_on_ranks(2, _unlisted_body):
        # Only the inner group's parameters are listed; forward, backward and the step are
        # the same; module.to() moves the unlisted ones; listing again restores the order.
        assert out["unlisted"] == ["0.weight", "0.bias"]
        assert out["unlisted keys"] == ["0.weight", "0.bias"]
        assert out["attribute"] is True
        assert out["same losses"] is True
        assert out["moved"] is True
        assert out["listed again"] is False
        assert out["names back in order"] is True
        assert out["keys back in order"] is True


def _accumulated_body(rank: int, world_size: int) -> dict[str, Any]:
    from shardkit.core import MixedPrecisionPolicy

    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    # Every rank the same data: the mean over replicas of equal values is exact, so the
    # expected gradients below are a single process's arithmetic.
    reference = nn.Linear(6, 3)
    local_grads = []
    for x in batches:
        reference.zero_grad()
        reference(x).square().sum().backward()
        assert reference.weight.grad is not None
        local_grads.append(reference.weight.grad.clone())
    out: dict[str, Any] = {}
    for fold in (False, True):
        model = nn.Linear(6, 3)
        model.load_state_dict(reference.state_dict())
        mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
        (group,) = layout_of(model)
        group.reduce_accumulated_grads(fold)
        for x in batches:  # two backwards, the gradient not zeroed between them
            model(x).square().sum().backward()
        grad = model.weight.grad
        assert isinstance(grad, DTensor)
        out[f"fold={fold}"] = grad.to_local().clone()
    out["local"] = local_grads
    sharded = nn.Linear(6, 3)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world_size,)))
    with pytest.raises(ValueError) as caught:
        layout_of(sharded)[0].reduce_accumulated_grads(True)
    out["sharded"] = str(caught.value)
    return out


def test_a_replicated_group_can_reduce_accumulated_gradients_again_as_fsdp1s_no_shard() -> None:
    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.bfloat16().float()

    for out in run_on_ranks(2, _accumulated_body):
        first, second = out["local"]
        # torch's way: each backward's gradient reduced (in bf16) alone, then added.
        assert torch.equal(out["fold=False"], bf16(first) + bf16(second))
        # FSDP1's NO_SHARD: the sum with the gradient already there reduced again. From
        # torch 2.15 on autograd gives the gradient in the reduce dtype already.
        arrives = bf16(second) if ACCUMULATES_IN_GRAD_DTYPE else second
        assert torch.equal(out["fold=True"], bf16(bf16(first) + arrives))
        assert not torch.equal(out["fold=True"], out["fold=False"])
        assert "without sharding" in out["sharded"], out["sharded"]


def _unsynced_body(rank: int, world_size: int) -> dict[str, Any]:
    from shardkit.core import FSDPModule, MixedPrecisionPolicy

    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
    reference = nn.Linear(6, 3).bfloat16()
    local_grads = []  # each backward's gradient in bf16, as the forward computes it
    for x in batches:
        reference.zero_grad()
        reference(x.bfloat16()).float().square().sum().backward()
        assert reference.weight.grad is not None
        local_grads.append(reference.weight.grad.clone())
    out: dict[str, Any] = {"local": local_grads}
    for in_param_dtype in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(6, 3)
        model.load_state_dict({k: v.float() for k, v in reference.state_dict().items()})
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)), mp_policy=policy)
        layout_of(model)[0].accumulate_unsynced_grads_in_param_dtype(in_param_dtype)
        for i, x in enumerate(batches):  # every rank the same data: the mean is exact
            assert isinstance(model, FSDPModule)
            model.set_requires_gradient_sync(i == len(batches) - 1)
            model(x).float().square().sum().backward()
        grad = model.weight.grad
        assert isinstance(grad, DTensor)
        out[f"in_param_dtype={in_param_dtype}"] = grad.full_tensor()
    return out


def test_unsynced_gradients_can_accumulate_in_the_param_dtype_as_fsdp1s() -> None:
    for out in run_on_ranks(2, _unsynced_body):
        first, second, third = out["local"]
        # torch's way: in the reduce dtype (fp32); FSDP1's: in bf16, then cast for the reduction.
        assert torch.equal(out["in_param_dtype=False"], first.float() + second.float() + third)
        assert torch.equal(out["in_param_dtype=True"], (first + second + third).float())
        assert not torch.equal(out["in_param_dtype=True"], out["in_param_dtype=False"])
