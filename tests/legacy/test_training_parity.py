"""Training with shardkit.legacy gives torch FSDP1's losses and parameters, step by step."""

from __future__ import annotations

import pytest
import torch

from harness.pool import run_on_ranks
from tests.legacy.legacy_parity import LegacyRun, assert_close_traces, parity_body

LOW_GRADS = {
    "param_dtype": torch.bfloat16,
    "reduce_dtype": torch.float32,  # reduced in fp32: rounding to bf16 after it shows
    "keep_low_precision_grads": True,
}
BF16 = {
    "param_dtype": torch.bfloat16,
    "reduce_dtype": torch.float32,
    "buffer_dtype": torch.bfloat16,
}


@pytest.mark.parametrize(
    ("world_size", "runs"),
    [
        # One rank: both FSDP1s run NO_SHARD (a laptop's first run of an FSDP1 script).
        (1, [LegacyRun(strategy="FULL_SHARD", model="gpt", optimizer="adamw")]),
        (2, [LegacyRun(strategy="FULL_SHARD"), LegacyRun(strategy="SHARD_GRAD_OP")]),
        (2, [LegacyRun(strategy="NO_SHARD", model="gpt", optimizer="adamw")]),
        (4, [LegacyRun(strategy="FULL_SHARD", model="gpt"), LegacyRun(strategy="NO_SHARD")]),
        (4, [LegacyRun(strategy="SHARD_GRAD_OP", optimizer="adamw")]),
        (
            4,
            [
                LegacyRun(strategy="HYBRID_SHARD", hybrid_mesh=(2, 2), model="gpt"),
                LegacyRun(strategy="_HYBRID_SHARD_ZERO2", hybrid_mesh=(2, 2), hybrid_groups=True),
            ],
        ),
    ],
    ids=["1-full", "2-full-zero2", "2-noshard", "4-full-noshard", "4-zero2", "4-hybrid"],
)
def test_strategies_match_fsdp1(world_size: int, runs: list[LegacyRun]) -> None:
    results = run_on_ranks(world_size, parity_body, runs=runs)
    for run, traces in zip(runs, results[0], strict=True):
        assert_close_traces(traces["shardkit"], traces["torch"], what=run.strategy)


@pytest.mark.parametrize(
    ("world_size", "runs"),
    [
        (1, [LegacyRun(strategy="SHARD_GRAD_OP", mixed_precision=BF16, model="gpt")]),
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
                # FSDP1's bf16 gradients against shardkit's rounded ones: SGD without momentum,
                # whose update reads the values only (a momentum buffer would take the dtype).
                LegacyRun(optimizer="plain", mixed_precision=LOW_GRADS),
                LegacyRun(strategy="SHARD_GRAD_OP", cpu_offload=True, optimizer="adamw"),
            ],
        ),
    ],
    ids=["1-mp", "2-mp-offload", "4-hybrid-mp-offload", "4-noshard-mp-zero2-offload"],
)
def test_mixed_precision_and_offload_match_fsdp1(world_size: int, runs: list[LegacyRun]) -> None:
    results = run_on_ranks(world_size, parity_body, runs=runs)
    for run, traces in zip(runs, results[0], strict=True):
        low = run.mixed_precision is not None
        tol = {"rtol": 1e-2, "atol": 1e-2} if low else {}
        assert_close_traces(traces["shardkit"], traces["torch"], what=run.strategy, **tol)


def _rounded_grads_body(rank: int, world_size: int) -> dict[str, bool]:
    from tests.core import models
    from tests.legacy.legacy_parity import rank_batch, wrap_model

    out = {}
    default = dict(LOW_GRADS, keep_low_precision_grads=False)
    for name, mp in (("low", LOW_GRADS), ("default", default)):
        run = LegacyRun(mixed_precision=mp)
        model = wrap_model("shardkit", run)
        x, y = rank_batch(run, 0, rank, world_size)
        models.loss_of("mlp", model(x), y).backward()
        # use_orig_params=False (the default): flat parameters, whose gradients are plain.
        grads = [p.grad for p in model.parameters()]
        out[name] = all(torch.equal(g, g.bfloat16().float()) for g in grads)
        out[f"{name}_dtype"] = all(g.dtype == torch.float32 for g in grads)
    return out


def test_keep_low_precision_grads_gives_param_dtype_values() -> None:
    for out in run_on_ranks(2, _rounded_grads_body):
        assert out == {"low": True, "low_dtype": True, "default": False, "default_dtype": True}
