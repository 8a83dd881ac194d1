"""FSDPModule switches: accumulation knobs, prefetch, divide factor, explicit unshard, eval."""

from __future__ import annotations

import pytest

from harness.pool import run_on_ranks
from tests.core.parity import Run, assert_parity, parity_body

WORLDS = [1, 2, 4]


@pytest.mark.parametrize("world_size", WORLDS)
def test_reshard_after_backward_false_while_accumulating(world_size: int) -> None:
    run = Run(model="gpt", loop="accumulate_keep", per_rank_batch=4)
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize(("world_size", "shape"), [(2, (2, 1)), (4, (2, 2))])
def test_requires_all_reduce_false_on_hsdp(world_size: int, shape: tuple[int, int]) -> None:
    run = Run(model="gpt", loop="accumulate_hsdp", per_rank_batch=4, hsdp=shape)
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize("world_size", WORLDS)
def test_is_last_backward_false_defers_reduction(world_size: int) -> None:
    run = Run(model="gpt", loop="last_backward", per_rank_batch=4)
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize("world_size", WORLDS)
def test_explicit_prefetch(world_size: int) -> None:
    run = Run(model="gpt", setup="explicit_prefetch")
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize("world_size", WORLDS)
def test_gradient_divide_factor(world_size: int) -> None:
    # Dividing summed gradients by 3 instead of W is SGD with lr * W / 3 on the global batch.
    # torch needs force-sum on gloo (no PREMUL_SUM there); shardkit always sums then divides.
    # torch at W=1 divides twice (copy and post-divide), so it is compared at W > 1 only.
    impls = ("shardkit", "local", "torch") if world_size > 1 else ("shardkit", "local")
    run = Run(model="gpt", setup="divide_by_three", impls=impls, local_lr_scale=world_size / 3)
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize("world_size", WORLDS)
def test_unshard_async_before_forward(world_size: int) -> None:
    run = Run(model="gpt", loop="explicit_unshard")
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("reshard", [True, False, None])
def test_eval_under_no_grad_between_steps(world_size: int, reshard: bool | None) -> None:
    run = Run(model="gpt", eval_each_step=True, shard_kwargs={"reshard_after_forward": reshard})
    assert_parity(run_on_ranks(world_size, parity_body, run=run))
