"""A parameter's sizes, dtypes and states as code written for torch's ``fully_shard`` reads them
from ``fsdp_params``, with torch's engine as the oracle.

In the wild: expert-parallel libraries size their own gathers as
``padded_sharded_param_size.numel() * mesh_info.shard_mesh_size`` and check ``_orig_size`` and
``fsdp_placement.dim``; custom all-gathers test ``sharded_state`` and copy
``_sharded_param_data``; parameter swaps go through ``_module_info``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard

import shardkit.core as sk
from harness.pool import run_on_ranks
from tests.core import quant_support
from tests.core.ckpt_helpers import mesh_of
from tests.core.fake_group import fake_mesh
from tests.core.torch_releases import torch_has

SCALAR_FIELDS = (
    "_param_fqn",
    "_orig_size",
    "_contiguous_orig_stride",
    "sharded_size",
    "contiguous_sharded_stride",
    "padded_sharded_param_size",
    "fsdp_placement",
    "is_dtensor",
    "orig_dtype",
    "param_dtype",
    "reduce_dtype",
    "device",
    "offload_to_cpu",
    "pin_memory",
)


class Net(nn.Module):
    """Uneven shards at W=4 (6 and 10 rows, a rank with none), a dim-1 shard, a tied weight,
    a parameter of the root's own (torch lists it after its children's), and three policies:
    bf16 compute with fp32 reduction, CPU offload, the default."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.a = nn.Linear(4, 6)  # 6 rows: 2, 2, 2, 0 at W=4
        self.b = nn.Linear(4, 8)  # its weight sharded on dim 1 (4 columns)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter, registered twice
        self.scale = nn.Parameter(torch.ones(4))  # the root's own, beside its children's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = torch.relu(self.a(h))[..., :4] + torch.relu(self.b(h))[..., :4]
        out: torch.Tensor = self.head(h * self.scale)
        return out


def _build(engine: str, mesh: DeviceMesh) -> Net:
    torch.manual_seed(0)
    model = Net()
    shard: Callable[..., Any] = sk.fully_shard if engine == "shardkit" else torch_fully_shard
    bf16 = TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # On 4 shards, a keeps 2-rank slices after forward (SHARDED_POST_FORWARD)
    after = 2 if mesh.ndim == 1 else True
    shard(model.a, mesh=mesh, mp_policy=bf16, reshard_after_forward=after)
    shard(model.b, mesh=mesh, shard_placement_fn=lambda p: Shard(-1) if p.ndim == 2 else None)
    shard(model, mesh=mesh, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
    return model


def _params(module: object) -> list[Any]:
    assert isinstance(module, TorchFSDPModule)  # shardkit's modules are torch's FSDPModules
    group: Any = module._get_fsdp_state()._fsdp_param_group
    return list(group.fsdp_params)


def _describe(p: Any) -> dict[str, Any]:
    """Everything a caller reads of one parameter, comparable across engines."""
    policy, info = p.mp_policy, p._module_info
    data = p._sharded_param_data
    local = p.sharded_param.to_local()
    start = data.data_ptr()
    return {
        **{name: getattr(p, name) for name in SCALAR_FIELDS},
        "mp_policy": (policy.param_dtype, policy.reduce_dtype, policy.output_dtype),
        "sharded_state": p.sharded_state,
        "module_info": (
            type(info.module).__name__,
            info.param_name,
            [type(m).__name__ for m in info.shared_modules],
            info.shared_param_names,
        ),
        # the padded shard: 1-D, its values (padding included), and the parameter's view of it
        "data": (tuple(data.shape), data.dtype, data.tolist()),
        "local_in_data": local.numel() == 0
        or start <= local.data_ptr() < start + data.numel() * data.element_size(),
    }


def _states(modules: dict[str, nn.Module]) -> dict[str, Any]:
    """Each group's and its parameters' states, as torch's enums and predicates."""
    out: dict[str, Any] = {}
    for name, module in modules.items():
        assert isinstance(module, TorchFSDPModule)
        group: Any = module._get_fsdp_state()._fsdp_param_group
        predicates = (group.is_sharded, group.is_sharded_post_forward, group.is_unsharded)
        states = (group._sharded_state, group._training_state, *predicates)
        out[name] = (*states, [p.sharded_state for p in group.fsdp_params])
    return out


def _body(rank: int, world_size: int, layout: str) -> dict[str, Any]:
    mesh = mesh_of(world_size, None if layout == "fsdp" else (2, world_size // 2))
    out: dict[str, Any] = {}
    for engine in ("torch", "shardkit"):
        model = _build(engine, mesh)
        modules = {"a": model.a, "b": model.b, "root": model}
        record: dict[str, Any] = {}
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for step in range(2):
            torch.manual_seed(10 + rank + step)
            loss = model(torch.randint(0, 10, (3, 5))).float().pow(2).mean()
            # after forward: the root keeps its parameters, the blocks reshard theirs
            record[f"after_forward_{step}"] = _states(modules)
            loss.backward()
            record[f"after_backward_{step}"] = _states(modules)
            opt.step()
            opt.zero_grad()
            record[f"loss_{step}"] = loss.item()
        record["params"] = {name: [_describe(p) for p in _params(m)] for name, m in modules.items()}
        # A write through _sharded_param_data reaches the parameter, as on torch's.
        first = _params(model.a)[0]
        first._sharded_param_data.fill_(0.5)
        weight: Any = model.a.weight
        record["written"] = weight.to_local().tolist()
        out[engine] = record
    return out


@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_param_fields_read_as_torchs(layout: str) -> None:
    results = run_on_ranks(4, _body, layout=layout)
    for rank, result in enumerate(results):
        ours, theirs = result["shardkit"], result["torch"]
        for name in theirs["params"]:
            for mine, torchs in zip(ours["params"][name], theirs["params"][name], strict=True):
                for field, value in torchs.items():
                    assert mine[field] == value, (rank, name, torchs["_param_fqn"], field)
        for key, value in theirs.items():
            assert ours[key] == value, (rank, key)  # states after forward, losses, the write
        # a.weight's 6 rows: 2, 2, 2, 0 on four shards (a rank with none), 3, 3 on two
        a_weight, shards = ours["params"]["a"][0], 4 if layout == "fsdp" else 2
        assert a_weight["padded_sharded_param_size"] == torch.Size([-(-6 // shards), 4])
        assert a_weight["sharded_size"][0] == [2, 2, 2, 0][rank] if shards == 4 else 3


def test_a_write_is_refused_by_name() -> None:
    with fake_mesh(4) as mesh:
        param = _params(sk.fully_shard(nn.Linear(4, 4), mesh=mesh))[0]
        with pytest.raises(AttributeError, match=r"^TorchFacingParam\._orig_size: shardkit's"):
            param._orig_size = torch.Size([1])
        assert param._orig_size == torch.Size([4, 4])
        # A weight gathered through all-gather hooks (a tensor subclass): its sizes are
        # served, its padded shard's storage is the subclass's own and is not.
        model = quant_support.build("sharded")
        sk.fully_shard(model, mesh=mesh)
        by_name = {p._param_fqn: p for p in _params(model)}
        hooked = by_name["blocks.0.fc1.weight"]
        assert hooked.padded_sharded_param_size == torch.Size([8, 16])
        with pytest.raises(NotImplementedError, match=r"^blocks\.0\.fc1\.weight: _sharded_para"):
            _ = hooked._sharded_param_data


def _kept_in_own_dtype_body(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for engine in ("torch", "shardkit"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        norm = set(model[1].parameters())  # computed in fp32, as a norm often is
        own: dict[str, Any] = {  # a field torch's class has from 2.15 on
            "param_dtype_override_fn": lambda p, norm=norm: torch.float32 if p in norm else None
        }
        policy = TorchMixedPrecisionPolicy(torch.bfloat16, torch.bfloat16, **own)
        shard: Callable[..., Any] = sk.fully_shard if engine == "shardkit" else torch_fully_shard
        shard(model, mesh=mesh, mp_policy=policy)
        model(torch.randn(2, 4)).sum().backward()
        out[engine] = [_describe(p) for p in _params(model)]
    return out


@pytest.mark.skipif(
    not torch_has("MixedPrecisionPolicy.param_dtype_override_fn"),
    reason="param_dtype_override_fn came with torch 2.15",
)
def test_a_parameter_kept_in_its_own_dtype_reads_as_torchs() -> None:
    for result in run_on_ranks(2, _kept_in_own_dtype_body):
        assert result["shardkit"] == result["torch"]
        dtypes = [torch.bfloat16, torch.bfloat16, None, None]
        assert [d["param_dtype"] for d in result["torch"]] == dtypes
