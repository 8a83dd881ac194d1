"""One shard rank (HSDP (R, 1), world size 1): full parameters are the shards, never copied."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply, assert_parity, make_mesh, parity_body


def _aliasing_body(rank: int, world_size: int, bf16: bool) -> dict[str, Any]:
    from shardkit.core import CollectiveEvent, MixedPrecisionPolicy, subscribe

    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if bf16 else {}
    run = Run(model="mlp", hsdp=(world_size, 1), shard_kwargs=kwargs)
    model = models.build("mlp")
    apply("shardkit", model, make_mesh(run, world_size), run)
    gathers: list[CollectiveEvent] = []
    unsubscribe = subscribe(
        lambda e: (
            gathers.append(e) if isinstance(e, CollectiveEvent) and e.kind == "all_gather" else None
        )
    )
    model.blocks[0].unshard()
    unsubscribe()
    weight = model.blocks[0].fc1.weight  # the unsharded parameter, registered
    shared = weight.untyped_storage().data_ptr()
    model.blocks[0].reshard()
    local = model.blocks[0].fc1.weight.to_local()
    x, y = models.batch("mlp", 0, 2)
    models.loss_of("mlp", model(x), y).backward()  # trains after the in-place unshard
    return {
        "aliased": shared == local.untyped_storage().data_ptr(),
        "gathers": len(gathers),
        "grads": all(p.grad is not None for p in model.parameters()),
    }


def test_the_unsharded_parameters_view_the_shards_unless_cast() -> None:
    for out in run_on_ranks(2, _aliasing_body, bf16=False):
        assert out == {"aliased": True, "gathers": 0, "grads": True}
    # bf16: the cast goes straight into the full parameters (a copy, no collective).
    for out in run_on_ranks(2, _aliasing_body, bf16=True):
        assert out == {"aliased": False, "gathers": 0, "grads": True}


@pytest.mark.parametrize("loop", ["plain", "accumulate", "accumulate_keep"])
def test_replicated_training_matches_torch_and_the_single_process(loop: str) -> None:
    run = Run(model="gpt", hsdp=(2, 1), loop=loop)
    assert_parity(run_on_ranks(2, parity_body, run=run))
