"""A group's and a parameter's ``mesh_info`` / ``post_forward_mesh_info``, read and set as code
written for torch's ``fully_shard`` reads and sets them, with torch's engine as the oracle.

In the wild: gradient-norm clipping that scales the norm of plain gradients by
``_get_fsdp_state()._fsdp_param_group.mesh_info.shard_mesh_size`` and divides the all-reduced
sum by the replicas; topology checks with ``isinstance(mesh_info, HSDPMeshInfo)``; a collective
of its own on ``fsdp_param.mesh_info.shard_process_group``; ``post_forward_mesh_info is None``
(or ``is mesh_info``) to learn a group's reshard policy, and libraries setting it to change the
policy, as torch's ``set_reshard_after_forward`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo
from torch.distributed.tensor import DTensor

import shardkit.core as sk
from harness.pool import run_on_ranks
from tests.core.ckpt_helpers import mesh_of
from tests.core.fake_group import fake_mesh
from tests.core.torch_releases import torch_has

HIDDEN = 8


def _model(engine: str, mesh: DeviceMesh) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(2)]
    model = nn.Sequential(*blocks, nn.Linear(HIDDEN, HIDDEN))
    shard: Callable[..., Any] = sk.fully_shard if engine == "shardkit" else torch_fully_shard
    for block in blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)  # reshard_after_forward left to its default: the root keeps
    return model


def _group(module: object) -> Any:
    assert isinstance(module, TorchFSDPModule)  # shardkit's modules are torch's FSDPModules
    return module._get_fsdp_state()._fsdp_param_group


def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...] | None:
    return None if group is None else tuple(dist.get_process_group_ranks(group))


def _describe(info: Any) -> tuple[Any, ...]:
    """What callers read of a mesh-info object, comparable across engines."""
    fields = ["shard_mesh_dim", "replicate_mesh_dim", "shard_mesh_size", "shard_mesh_rank"]
    fields += ["replicate_mesh_size", "replicate_mesh_rank"]
    groups = ("shard_process_group", "replicate_process_group")
    return (
        type(info),  # torch's own class: isinstance checks hold
        info.mesh.mesh.tolist(),
        info.mesh.mesh_dim_names,
        *(getattr(info, name, None) for name in fields),
        *(_ranks(getattr(info, name, None)) for name in groups),
    )


def _policy(group: Any) -> str:
    after = group.post_forward_mesh_info
    return "keep" if after is None else "reshard" if after is group.mesh_info else "other"


def _clip_norm(model: nn.Module) -> float:
    """The norm as such clipping code computes it: local squares, one all-reduce, scaled."""
    world = dist.get_world_size()
    shard_size = _group(model).mesh_info.shard_mesh_size
    squares = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        assert p.grad is not None
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        squares += local.double().pow(2).sum() / (1 if isinstance(p.grad, DTensor) else shard_size)
    dist.all_reduce(squares)
    return float((squares / (world // shard_size)).sqrt())


def _body(rank: int, world_size: int, layout: str) -> dict[str, Any]:
    mesh = mesh_of(world_size, None if layout == "fsdp" else (2, world_size // 2))
    out: dict[str, Any] = {}
    for engine in ("torch", "shardkit"):
        model = _model(engine, mesh)
        modules: list[Any] = [model[0], model[1], model]
        groups = [_group(m) for m in modules]
        record: dict[str, Any] = {
            "described": [_describe(g.mesh_info) for g in groups],
            "hsdp": [isinstance(g.mesh_info, HSDPMeshInfo) for g in groups],
            "params_share": all(
                p.mesh_info is g.mesh_info and p.post_forward_mesh_info is g.post_forward_mesh_info
                for g in groups
                for p in g.fsdp_params
            ),
            "before_forward": [_policy(g) for g in groups],
        }
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, norms, kept = [], [], []
        for step in range(3):
            if step == 1:  # what a library does to keep block 1's parameters after forward
                groups[1].post_forward_mesh_info = None
            if step == 2:
                groups[1].post_forward_mesh_info = groups[1].mesh_info
            torch.manual_seed(10 + step + rank)
            loss = model(torch.randn(4, HIDDEN)).pow(2).mean()
            # after forward: which blocks still hold their full (plain) parameters
            kept.append([not isinstance(m[0].weight, DTensor) for m in modules[:2]])
            loss.backward()
            norms.append(_clip_norm(model))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        record |= {"after_steps": [_policy(g) for g in groups], "kept": kept}
        record |= {"losses": losses, "norms": norms}
        out[engine] = record
    return out


@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_mesh_info_reads_and_sets_as_torchs(layout: str) -> None:
    results = run_on_ranks(4, _body, layout=layout)
    for rank, result in enumerate(results):
        ours, theirs = result["shardkit"], result["torch"]
        assert ours["described"] == theirs["described"], rank
        assert ours["hsdp"] == theirs["hsdp"] == [layout == "hsdp"] * 3
        assert ours["params_share"] and theirs["params_share"]
        assert ours["before_forward"] == theirs["before_forward"] == ["reshard"] * 3
        # The root keeps its parameters once lazy init ran; block 1 was set back at step 2.
        assert ours["after_steps"] == theirs["after_steps"] == ["reshard", "reshard", "keep"]
        assert ours["kept"] == theirs["kept"] == [[False, False], [False, True], [False, False]]
        assert ours["losses"] == theirs["losses"], rank  # bit for bit
        assert ours["norms"] == theirs["norms"], rank


def test_what_is_not_served_or_not_taken_says_so() -> None:
    with fake_mesh(8) as mesh:
        model: Any = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN))
        sk.fully_shard(model[0], mesh=mesh, reshard_after_forward=2)
        sk.fully_shard(model, mesh=mesh)
        twos = torch_fully_shard(nn.Linear(HIDDEN, HIDDEN), mesh=mesh, reshard_after_forward=2)
        # torch's builds a DeviceMesh of its own for the 1/2 slices; shardkit's subgroups are not
        assert isinstance(_group(twos).post_forward_mesh_info, HSDPMeshInfo)
        with pytest.raises(NotImplementedError, match=r"^FSDPLinear: post_forward_mesh_info of"):
            _ = _group(model[0]).post_forward_mesh_info
        with pytest.raises(NotImplementedError, match="reshard_after_forward=2 is not served"):
            _ = _group(model[0]).fsdp_params[0].post_forward_mesh_info
        root = _group(model)
        with pytest.raises(ValueError, match=r"^FSDPSequential: post_forward_mesh_info takes None"):
            root.post_forward_mesh_info = _group(twos).post_forward_mesh_info
        assert _policy(root) == "reshard"  # the refused write changed nothing
        if torch_has("FSDPModule.set_separate_reduce_scatter_group"):
            assert root.mesh_info.reduce_scatter_process_group is None
            model.set_separate_reduce_scatter_group()
            separate = root.mesh_info.reduce_scatter_process_group
            assert separate is not None and separate is not root.mesh_info.shard_process_group
            assert _ranks(separate) == tuple(range(8))
