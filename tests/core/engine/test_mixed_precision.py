"""MixedPrecisionPolicy: param/reduce/output dtypes and input casting match torch."""

from __future__ import annotations

import pytest
import torch

from harness.pool import run_on_ranks
from shardkit.core import MixedPrecisionPolicy
from tests.core.parity import Run, assert_parity, parity_body

POLICIES = {
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    "bf16_reduce_fp32": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    ),
    "fp16": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
    "no_input_cast": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    ),
}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_mixed_precision_matches_torch(world_size: int, policy: str) -> None:
    run = Run(
        model="gpt", shard_kwargs={"mp_policy": POLICIES[policy]}, impls=("shardkit", "torch")
    )
    results = run_on_ranks(world_size, parity_body, run=run)
    # Bit for bit at every world size: the collectives add the ranks in torch's (gloo's) order,
    # and the casts, the reduce dtype and the division are torch's.
    assert_parity(results, rtol=0, atol=0)


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="param_dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="reduce_dtype"):
        MixedPrecisionPolicy(reduce_dtype="float32")  # type: ignore[arg-type]


@pytest.mark.parametrize("world_size", [2])
def test_output_dtype_on_the_root(world_size: int) -> None:
    # Blocks compute in bf16; the root casts its output back to fp32.
    run = Run(
        model="gpt",
        shard_kwargs={"mp_policy": POLICIES["bf16_reduce_fp32"]},
        root_kwargs={
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
            )
        },
        impls=("shardkit", "torch"),
    )
    assert_parity(run_on_ranks(world_size, parity_body, run=run))
