"""Gradient accumulation (no sync), in mixed precision too; several forwards, one backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.core import MixedPrecisionPolicy
from tests.core.parity import Run, assert_parity, fully_shard_of, parity_body, torch_policy


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_no_sync_accumulation_matches(world_size: int) -> None:
    run = Run(model="gpt", loop="accumulate", per_rank_batch=4)
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_several_forwards_one_backward(world_size: int) -> None:
    run = Run(model="gpt", loop="multi_forward", per_rank_batch=4)
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


MICROBATCHES = 4
HIDDEN = 8


class _AppliedTwice(nn.Linear):
    """A layer applied twice in its forward: two gradients reach its weights per backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(F.linear(x, self.weight, self.bias)), self.weight, self.bias)


def _model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), _AppliedTwice(HIDDEN, HIDDEN), nn.Linear(HIDDEN, 2)
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


# Which microbatches sync: the last only; the last only, gradients zeroed to zeros between
# steps (so a reduced gradient is there when unsynced ones begin); the first and the last.
PATTERNS = ("last", "last_zeroed_to_zeros", "first_and_last")


def _train_no_sync(
    impl: str, world_size: int, rank: int, policy: Any, pattern: str
) -> dict[str, Any]:
    """Two steps of MICROBATCHES microbatches, gradient sync as ``pattern`` says."""
    torch.manual_seed(0)
    model = _model()
    fs = fully_shard_of(impl)
    kwargs = {
        "mesh": init_device_mesh("cpu", (world_size,)),
        "mp_policy": policy if impl == "shardkit" else torch_policy(policy),
    }
    fs(model[2], **kwargs)
    fs(model, **kwargs)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"losses": [], "grads": []}
    for step in range(2):
        data = torch.Generator().manual_seed(100 * step + rank)
        for micro in range(MICROBATCHES):
            sync = micro == MICROBATCHES - 1 or (pattern == "first_and_last" and micro == 0)
            model.set_requires_gradient_sync(sync)  # type: ignore[operator]
            x = torch.randn(2, HIDDEN, generator=data)
            target = torch.randn(2, 2, generator=data)
            loss = F.mse_loss(model(x).float(), target)
            loss.backward()
            out["losses"].append(loss.detach().clone())
        out["grads"] += [_full(p.grad) for p in model.parameters() if p.grad is not None]
        optim.step()
        optim.zero_grad(set_to_none=pattern != "last_zeroed_to_zeros")
    out["params"] = [_full(p) for p in model.parameters()]
    return out


def _no_sync_body(rank: int, world_size: int, policy: Any) -> dict[str, bool]:
    out = {}
    for pattern in PATTERNS:
        ours = _train_no_sync("shardkit", world_size, rank, policy, pattern)
        theirs = _train_no_sync("torch", world_size, rank, policy, pattern)
        for key in ("losses", "grads", "params"):
            out[f"{pattern}/{key}"] = len(ours[key]) == len(theirs[key]) > 0 and all(
                torch.equal(a, b) for a, b in zip(ours[key], theirs[key], strict=True)
            )
    return out


POLICIES = {
    "bf16_reduce_fp32": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    ),
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    "fp32_reduce_bf16": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_no_sync_microbatches_in_mixed_precision_give_torchs_bits(
    world_size: int, policy: str
) -> None:
    # Torch 2.15 on accumulates through the unsharded parameters' grad_dtype (each gradient
    # autograd makes is cast before it is summed); before, it casts where a group's backward
    # ends. The layer applied twice gives its weights two gradients per backward, where the
    # two differ. See [Note: post-backward trigger].
    results = run_on_ranks(world_size, _no_sync_body, policy=POLICIES[policy])
    for rank, equal in enumerate(results):
        assert len(equal) == 3 * len(PATTERNS) and all(equal.values()), (rank, equal)
