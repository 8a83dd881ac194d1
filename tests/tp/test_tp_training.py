"""FSDP x TP (2D) and HSDP x TP (3D) train as torch's fully_shard + TP and the single process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.core import MixedPrecisionPolicy
from tests.core.parity import assert_parity
from tests.tp import tp_models
from tests.tp.tp_parity import (
    TPRun,
    assert_same_fsdp_params,
    build_sharded,
    dp_rank_and_size,
    global_mesh,
    parity_body,
)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_2d_uneven_mlp_matches(reshard_after_forward: bool) -> None:
    run = TPRun(model="mlp", shard_kwargs={"reshard_after_forward": reshard_after_forward})
    results = run_on_ranks(4, parity_body, run=run)
    assert_parity(results)
    assert_same_fsdp_params(results)  # the TP-local part's sizes, uneven on both axes


def test_2d_sequence_parallel_matches() -> None:
    assert_parity(run_on_ranks(4, parity_body, run=TPRun(model="sp")))


def test_2d_loss_parallel_matches() -> None:
    run = TPRun(model="sp_loss_parallel")
    assert_parity(run_on_ranks(4, parity_body, run=run))


@pytest.mark.parametrize("mesh", [(1, 2, 2), (2, 1, 2)])
def test_hsdp_x_tp_matches(mesh: tuple[int, int, int]) -> None:
    assert_parity(run_on_ranks(4, parity_body, run=TPRun(model="sp", mesh=mesh)))


def test_2d_activation_checkpointing_matches() -> None:
    assert_parity(run_on_ranks(4, parity_body, run=TPRun(model="sp", checkpoint=True)))


def test_2d_bf16_mixed_precision_matches_torch() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    run = TPRun(model="sp", shard_kwargs={"mp_policy": policy}, impls=("shardkit", "torch"))
    results = run_on_ranks(4, parity_body, run=run)
    assert_parity(results, rtol=0, atol=0)
    assert_same_fsdp_params(results)


def _accumulate(impl: str, run: TPRun, rank: int) -> dict[str, list[torch.Tensor]]:
    """Two steps of three microbatches, gradient sync on the last only (autograd's hooks)."""
    mesh = global_mesh(run)
    model: Any = build_sharded(impl, run, mesh)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out: dict[str, list[torch.Tensor]] = {"losses": [], "grads": []}
    for step in range(2):
        x, y = tp_models.batch(run.model, step, 3 * run.per_rank_batch * dp_size)
        xs, ys = x.chunk(dp_size)[dp_rank].chunk(3), y.chunk(dp_size)[dp_rank].chunk(3)
        for micro in range(3):
            model.set_requires_gradient_sync(micro == 2)
            loss = tp_models.loss_of(run.model, model(xs[micro]), ys[micro])
            loss.backward()
            out["losses"].append(loss.detach().clone())
        out["grads"] += [_full(p.grad) for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    out["params"] = [_full(p) for p in model.parameters()]
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _accumulation_body(rank: int, world_size: int, run: TPRun) -> dict[str, bool]:
    ours, theirs = (_accumulate(impl, run, rank) for impl in ("shardkit", "torch"))
    return {
        key: len(ours[key]) == len(theirs[key]) > 0
        and all(torch.equal(a, b) for a, b in zip(ours[key], theirs[key], strict=True))
        for key in theirs
    }


def test_2d_bf16_no_sync_microbatches_give_torchs_bits() -> None:
    # A SequenceParallel norm's gradient is Partial over tp: summed over the microbatches in
    # fp32 first, then over tp once, as torch's engine does (note 009).
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    run = TPRun(model="sp", shard_kwargs={"mp_policy": policy})
    for rank, same in enumerate(run_on_ranks(4, _accumulation_body, run=run)):
        assert all(same.values()), (rank, same)
