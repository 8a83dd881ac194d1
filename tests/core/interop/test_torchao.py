"""torchao's real tensor subclasses under fully_shard, against torch's fully_shard.

NF4 (QLoRA's frozen base weights) implements only the operators torch's own sharding uses,
so the shard must be cut with ``torch.chunk``; Float8 training weights all-gather in float8
through their ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` hooks. Both train exactly
as torch's ``fully_shard`` trains them.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core.parity import fully_shard_of

pytest.importorskip("torchao", reason="torchao (pinned in constraints.txt) is not installed")

_DIM = 256  # NF4 scales come in blocks of 64 * 256 elements: 4 of them, 2 per rank
_STEPS = 3


class _LoRALinear(nn.Module):
    """A frozen NF4 base weight with a trainable low-rank update (QLoRA)."""

    def __init__(self) -> None:
        super().__init__()
        from torchao.quantization import to_nf4

        base = torch.randn(_DIM, _DIM) / _DIM**0.5
        self.weight = nn.Parameter(to_nf4(base), requires_grad=False)
        self.lora_a = nn.Linear(_DIM, 8, bias=False)
        self.lora_b = nn.Linear(8, _DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = F.linear(x, self.weight) + self.lora_b(self.lora_a(x))
        return out


def _qlora_model() -> nn.Sequential:
    return nn.Sequential(_LoRALinear(), nn.ReLU(), _LoRALinear())


def _float8_model() -> nn.Sequential:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = nn.Sequential(nn.Linear(_DIM, _DIM), nn.ReLU(), nn.Linear(_DIM, _DIM))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)
    return model


def _train(impl: str, kind: str, rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _qlora_model() if kind == "nf4" else _float8_model()
    if impl != "local":  # "local": the single process, unsharded
        fs = fully_shard_of(impl)
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if any(True for _ in layer.parameters()):
                fs(layer, mesh=mesh)
        fs(model, mesh=mesh)
    local_types = sorted(
        {type(p.to_local()).__name__ for p in model.parameters() if isinstance(p, DTensor)}
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for step in range(_STEPS):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4 * world_size, _DIM, generator=gen).chunk(world_size)[rank]
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {
        name: (cast(DTensor, p).full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    return {"losses": losses, "params": params, "local_types": local_types}


def _body(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    return {impl: _train(impl, kind, rank, world_size) for impl in ("torch", "shardkit")}


# NF4 at one rank is left out here: torch's fully_shard hands the post hook only the first of
# the pre hook's three tensors there and fails (shardkit's works: the next test).
@pytest.mark.parametrize(("kind", "world_size"), [("nf4", 2), ("float8", 1), ("float8", 2)])
def test_trains_as_torch(kind: str, world_size: int) -> None:
    for result in run_on_ranks(world_size, _body, kind=kind):
        ours, theirs = result["shardkit"], result["torch"]
        assert ours["local_types"] == theirs["local_types"]
        expected = "NF4Tensor" if kind == "nf4" else "WeightWithDynamicFloat8CastTensor"
        assert expected in ours["local_types"], ours["local_types"]
        assert ours["losses"] == theirs["losses"]
        assert ours["params"].keys() == theirs["params"].keys()
        for name, value in theirs["params"].items():
            assert torch.equal(ours["params"][name], value), name


def _one_rank_body(rank: int, world_size: int) -> dict[str, Any]:
    return {impl: _train(impl, "nf4", rank, world_size) for impl in ("local", "shardkit")}


def test_nf4_at_one_rank_trains_as_the_single_process() -> None:
    result = run_on_ranks(1, _one_rank_body)[0]
    ours, theirs = result["shardkit"], result["local"]
    assert "NF4Tensor" in ours["local_types"], ours["local_types"]
    assert ours["losses"] == theirs["losses"]
    for name, value in theirs["params"].items():
        assert torch.equal(ours["params"][name], value), name
