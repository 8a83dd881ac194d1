"""All-gather hooks attached after ``fully_shard`` take effect, as in torch's.

torch's ``fully_shard`` asks the sharded local tensor for ``fsdp_pre_all_gather`` at every
all-gather, and sets up for the hooks it finds at the first forward too, so hooks set after
``fully_shard`` (torch's own tests set them on ``_local_tensor``, a plain tensor, as instance
methods) are used. Here the hooks send the shard in bf16 and cast it back: the losses and
parameters show whether they ran, and they must be torch's, at one rank (where shardkit
otherwise gathers nothing) and at two. (shardkit also takes up hooks that appear after the
first forward, at the next unshard; torch's fails there, so that has no oracle.)
"""

from __future__ import annotations

from collections import Counter
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core.parity import fully_shard_of

CALLS: Counter[str] = Counter()


def _pre(
    self: torch.Tensor, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp: Any
) -> Any:
    CALLS["pre"] += 1
    return (self.to(torch.bfloat16),), None


@torch.no_grad()
def _post(
    self: torch.Tensor,
    outputs: tuple[torch.Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> Any:
    (tensor,) = outputs
    CALLS["post"] += 1
    if out is not None:
        with _unsafe_preserve_version_counter(out):
            out.copy_(tensor)
        return None
    full = tensor.to(param_dtype)
    return full, (tensor, full)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2))
    )


def _train(impl: str, rank: int, world_size: int, late: bool) -> dict[str, Any]:
    model = _model()
    fs = fully_shard_of(impl)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model:
        fs(block, mesh=mesh)
    fs(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    CALLS.clear()
    losses = []
    for step in range(3):
        if late and step == 0:  # after fully_shard laid out its buffers, before any forward
            for name, param in model.named_parameters():
                if name.endswith("weight"):
                    local = cast(DTensor, param)._local_tensor  # as torch's tests do
                    # Instance methods on a plain tensor, as torch's tests set them.
                    setattr(local, "fsdp_pre_all_gather", _pre.__get__(local))  # noqa: B010
                    setattr(local, "fsdp_post_all_gather", _post.__get__(local))  # noqa: B010
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4 * world_size, 8, generator=gen).chunk(world_size)[rank]
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.full_tensor() for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return {"losses": losses, "params": params, "calls": dict(CALLS)}


def _body(rank: int, world_size: int) -> dict[str, Any]:
    return {
        impl: {late: _train(impl, rank, world_size, late) for late in (False, True)}
        for impl in ("torch", "shardkit")
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_hooks_set_on_local_tensors_after_fully_shard_are_used(world_size: int) -> None:
    for result in run_on_ranks(world_size, _body):
        ours, theirs = result["shardkit"][True], result["torch"][True]
        assert theirs["calls"]["pre"] > 0  # torch's ran them
        assert ours["calls"] == theirs["calls"]
        assert ours["losses"] == theirs["losses"]
        for name, value in theirs["params"].items():
            assert torch.equal(ours["params"][name], value), name
        # The bf16 round trip changed training: the hooks are not a no-op.
        assert result["torch"][False]["losses"][2] != theirs["losses"][2]
