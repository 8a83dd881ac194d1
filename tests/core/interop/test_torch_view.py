"""The torch-facing view driven as torch's callers drive torch's own FSDP state.

Torch 2.13's pipeline stage ends a stage's backward with its REDUCE_GRAD sequence, and
torchtitan's cross-replica all-reduce is installed through ``_get_fsdp_state()``'s groups
(see [Note: torch-facing view]). Each body runs the caller's exact sequence on torch's
``fully_shard`` and on shardkit's, on the same ranks, and compares gradients bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardkit.core as sk
from harness.pool import run_on_ranks

HIDDEN = 8


def _model(engine: str, mesh: DeviceMesh, reshard: bool) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(3)]
    model = nn.Sequential(*blocks, nn.Linear(HIDDEN, HIDDEN))  # the head: the root's own group
    fs: Callable[..., Any] = sk.fully_shard if engine == "shardkit" else torch_fully_shard
    for block in blocks:
        fs(block, mesh=mesh, reshard_after_forward=reshard)
    fs(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _grads(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        assert p.grad is not None, "a parameter got no gradient"
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out.append(grad.detach().clone())
    return out


def _groups_of(state: Any) -> list[Any]:
    """A state's parameter groups, as the installed torch's pipelining reads them.

    Torch 2.13 has ``_fsdp_param_groups`` (several groups per call, one per mesh); before it,
    a state had one group or none, ``_fsdp_param_group`` (torch 2.10's ``stage.py`` reads that).
    """
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [group] if group is not None else []


def _reduce_grad(model: Any) -> None:
    """Torch 2.13's ``PipelineStage.perform_reduce_grad`` for an FSDP stage, verbatim in effect."""
    model.set_is_last_backward(True)
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)
    theirs: Any = torch_fully_shard  # torch's, as stage.py binds it at import
    state = theirs.state(model)
    for each in state._state_ctx.all_states:
        for group in _groups_of(each):
            group.post_backward()
    state._root_post_backward_final_callback()


def _reduce_grad_body(rank: int, world_size: int, reshard: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {}
    for engine in ("torch", "shardkit"):
        model: Any = _model(engine, mesh, reshard)
        for microbatch in range(3):
            # PipelineStage.backward_maybe_with_nosync, for each microbatch's backward.
            model.set_is_last_backward(False)
            model.set_reshard_after_backward(False)
            model.set_requires_gradient_sync(False)
            x = torch.randn(
                4, HIDDEN, generator=torch.Generator().manual_seed(10 * rank + microbatch)
            )
            model(x).pow(2).sum().backward()
        _reduce_grad(model)
        out[engine] = {
            "grads": _grads(model),
            "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        }
    return {
        "equal": [
            torch.equal(a, b)
            for a, b in zip(out["torch"]["grads"], out["shardkit"]["grads"], strict=True)
        ],
        "sharded": (out["torch"]["sharded"], out["shardkit"]["sharded"]),
    }


@pytest.mark.parametrize("reshard", [True, False])
def test_torch_2_13s_reduce_grad_sequence_reduces_as_torchs(reshard: bool) -> None:
    for result in run_on_ranks(2, _reduce_grad_body, reshard=reshard):
        assert all(result["equal"]) and len(result["equal"]) == 8
        assert result["sharded"] == (True, True)


def _install_all_reduce_hook(model: nn.Module, hook: Callable[[torch.Tensor], None]) -> int:
    """torchtitan main's (torchft's) installation: every group of every FSDP module."""
    installed = 0
    for module in model.modules():
        if not isinstance(module, TorchFSDPModule):
            continue
        groups = _groups_of(module._get_fsdp_state())
        assert all(hasattr(group, "_all_reduce_hook") for group in groups)
        for group in groups:
            group._all_reduce_hook = hook
            installed += 1
    return installed


def _all_reduce_hook_body(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    out: dict[str, Any] = {}
    for engine in ("torch", "shardkit"):
        model = _model(engine, mesh, True)
        calls: list[int] = []

        def hook(reduced: torch.Tensor, calls: list[int] = calls) -> None:
            calls.append(reduced.numel())
            reduced.mul_(0.5)  # as a user's all-reduce would change it, in place

        installed = _install_all_reduce_hook(model, hook)
        for step in range(2):
            x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(10 * rank + step))
            model(x).pow(2).sum().backward()
        out[engine] = {"installed": installed, "calls": len(calls), "grads": _grads(model)}
    ours, theirs = out["shardkit"], out["torch"]
    return {
        "installed": (theirs["installed"], ours["installed"]),
        "calls": (theirs["calls"], ours["calls"]),
        "equal": [torch.equal(a, b) for a, b in zip(ours["grads"], theirs["grads"], strict=True)],
    }


def test_torchtitans_all_reduce_hook_runs_on_every_group_as_torchs() -> None:
    for result in run_on_ranks(4, _all_reduce_hook_body):
        assert result["installed"] == (4, 4)
        assert result["calls"] == (8, 8)  # every group, every backward
        assert all(result["equal"]) and len(result["equal"]) == 8
