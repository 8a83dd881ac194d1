"""FSDP x TP (2D) and HSDP x TP (3D) train as torch's fully_shard + TP and the single process."""

from __future__ import annotations

import pytest
import torch

from harness.pool import run_on_ranks
from shardkit.core import MixedPrecisionPolicy
from tests.core.parity import assert_parity
from tests.tp.tp_parity import TPRun, assert_same_fsdp_params, parity_body


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
