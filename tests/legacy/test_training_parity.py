"""Training with shardkit.legacy gives torch FSDP1's losses and parameters, step by step."""

from __future__ import annotations

import pytest
import torch

from harness.pool import run_on_ranks
from tests.legacy.legacy_parity import LegacyRun, assert_close_traces, parity_body

BF16 = {
    "param_dtype": torch.bfloat16,
    "reduce_dtype": torch.float32,
    "buffer_dtype": torch.bfloat16,
}


@pytest.mark.parametrize(
    ("world_size", "runs"),
    [
        (2, [LegacyRun(strategy="FULL_SHARD"), LegacyRun(strategy="SHARD_GRAD_OP")]),
        (2, [LegacyRun(strategy="NO_SHARD", model="gpt", optimizer="adamw")]),
        (4, [LegacyRun(strategy="FULL_SHARD", model="gpt"), LegacyRun(strategy="NO_SHARD")]),
        (4, [LegacyRun(strategy="SHARD_GRAD_OP", optimizer="adamw")]),
        (4, [LegacyRun(strategy="HYBRID_SHARD", hybrid_mesh=(2, 2), model="gpt")]),
    ],
    ids=["2-full-zero2", "2-noshard", "4-full-noshard", "4-zero2", "4-hybrid"],
)
def test_strategies_match_fsdp1(world_size: int, runs: list[LegacyRun]) -> None:
    results = run_on_ranks(world_size, parity_body, runs=runs)
    for run, traces in zip(runs, results[0], strict=True):
        assert_close_traces(traces["shardkit"], traces["torch"], what=run.strategy)


@pytest.mark.parametrize(
    ("world_size", "runs"),
    [
        (2, [LegacyRun(mixed_precision=BF16, model="gpt"), LegacyRun(cpu_offload=True)]),
        (
            4,
            [
                LegacyRun(
                    strategy="HYBRID_SHARD",
                    hybrid_mesh=(2, 2),
                    mixed_precision=BF16,
                    cpu_offload=True,
                )
            ],
        ),
        (
            4,
            [
                LegacyRun(strategy="NO_SHARD", mixed_precision={"param_dtype": torch.bfloat16}),
                LegacyRun(strategy="SHARD_GRAD_OP", cpu_offload=True, optimizer="adamw"),
            ],
        ),
    ],
    ids=["2-mp-offload", "4-hybrid-mp-offload", "4-noshard-mp-zero2-offload"],
)
def test_mixed_precision_and_offload_match_fsdp1(world_size: int, runs: list[LegacyRun]) -> None:
    results = run_on_ranks(world_size, parity_body, runs=runs)
    for run, traces in zip(runs, results[0], strict=True):
        low = run.mixed_precision is not None
        tol = {"rtol": 1e-2, "atol": 1e-2} if low else {}
        assert_close_traces(traces["shardkit"], traces["torch"], what=run.strategy, **tol)
