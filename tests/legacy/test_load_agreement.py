"""FULL and SHARDED state dict loads agree across the model's ranks: bad on one, loaded on none.

A value bad on rank 1 only (a full tensor of the wrong shape, a shard cut short) used to make
rank 1 raise "nothing was loaded" while rank 0 loaded: the model ended half old, half new.
Every rank must raise the same error with every parameter bit-identical to before, and the
ranks must still be in step (the good state dict then loads on both).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.legacy.torch_compat import ShardedTensor
from tests.legacy.ckpt_support import fresh, load_into, plain_sgd, state_dict_of, train_steps
from tests.legacy.legacy_parity import LegacyRun, full_params, wrap_model

KEY = "blocks.0.mlp.0.weight"


def _cut_short(value: Any) -> Any:
    """``value`` with this rank's shard one row short (its metadata intact)."""
    if isinstance(value, ShardedTensor):
        (shard,) = value.local_shards()
        shard.tensor = shard.tensor[:-1].clone()
        return value
    assert isinstance(value, DTensor), type(value)
    return DTensor.from_local(
        value.to_local()[:-1].clone(),
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def _bad_on_rank1_body(rank: int, world_size: int, kind: str, bad: str) -> dict[str, Any]:
    from shardkit.legacy import ShardedStateDictConfig

    run = LegacyRun(model="gpt")
    model = wrap_model("shardkit", run)
    train_steps(model, plain_sgd(model), run, range(1))
    config = ShardedStateDictConfig(_use_dtensor=True) if bad == "short_dtensor" else None
    good = state_dict_of("shardkit", model, kind, config)
    given = dict(state_dict_of("shardkit", model, kind, config))
    if rank == 1:
        given[KEY] = torch.zeros(5, 5) if bad == "wrong_shape" else _cut_short(given[KEY])
    target = fresh("shardkit", run)
    before = full_params("shardkit", target)
    try:
        load_into("shardkit", target, kind, given)
        error, message = "", "no error"
    except Exception as exc:
        error, message = type(exc).__name__, str(exc)
    after = full_params("shardkit", target)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    load_into("shardkit", target, kind, good)  # the ranks are still in step
    source, loaded = full_params("shardkit", model), full_params("shardkit", target)
    return {
        "error": error,
        "message": message,
        "unchanged": unchanged,
        "loads": all(torch.equal(source[k], loaded[k]) for k in source),
    }


@pytest.mark.parametrize(
    ("kind", "bad", "error"),
    [
        ("FULL_STATE_DICT", "wrong_shape", "RuntimeError"),
        ("SHARDED_STATE_DICT", "wrong_shape", "RuntimeError"),
        ("SHARDED_STATE_DICT", "short_shard", "ValueError"),
        ("SHARDED_STATE_DICT", "short_dtensor", "RuntimeError"),
    ],
)
def test_a_value_bad_on_one_rank_loads_on_no_rank(kind: str, bad: str, error: str) -> None:
    results = run_on_ranks(2, _bad_on_rank1_body, kind=kind, bad=bad)
    first = results[0]
    assert first["error"] == error, first
    assert first["message"].startswith("rank 1: "), first["message"]
    # The core's checks name the raw key (blocks.0._fsdp_wrapped_module.mlp.0.weight).
    assert "blocks.0." in first["message"] and "mlp.0.weight" in first["message"], first
    assert "nothing was loaded" in first["message"], first
    for result in results:
        assert (result["error"], result["message"]) == (first["error"], first["message"])
        assert result["unchanged"], result
        assert result["loads"], result
