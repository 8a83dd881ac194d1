"""LOCAL_STATE_DICT: each unit's flat shard, as torch's FSDP1 writes it, loaded both ways.

torch's FSDP1 and shardkit.legacy wrap the same model in the same worker processes; their
LOCAL state dicts must agree key for key (order included), value for value and in their
ShardedTensor metadata, and each must load into the other and train on to the same losses.
A state dict that does not fit (missing unit, another size, another world size, a truncated
shard on one rank) is refused with the same error on every rank, and nothing is written.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.pool import run_on_ranks
from shardkit.legacy.torch_compat import ShardedTensor, flat_sharded_tensor
from tests.legacy.ckpt_support import (
    assert_same_form,
    forms_after_training,
    fresh,
    load_into,
    plain_sgd,
    sharded_form,
    state_dict_of,
    train_steps,
)
from tests.legacy.legacy_parity import LegacyRun, full_params, wrap_model

_BF16 = {"param_dtype": torch.bfloat16}
RUNS = {
    "2-gpt": (2, LegacyRun(model="gpt")),
    "2-gpt-orig-params-bf16": (
        2,
        LegacyRun(model="gpt", mixed_precision=_BF16, extra={"use_orig_params": True}),
    ),
    "4-uneven-grad-op": (4, LegacyRun(strategy="SHARD_GRAD_OP")),  # head: 3 rows, 4 ranks
}


def _form(value: Any) -> Any:
    if isinstance(value, ShardedTensor):
        return (sharded_form(value), str(value.metadata().tensor_properties))
    return sharded_form(value)


def _form_body(rank: int, world_size: int, run: LegacyRun) -> dict[str, Any]:
    return forms_after_training(run, "LOCAL_STATE_DICT", _form)


@pytest.mark.parametrize("name", list(RUNS))
def test_local_state_dict_equals_fsdp1s(name: str) -> None:
    world_size, run = RUNS[name]
    for rank, out in enumerate(run_on_ranks(world_size, _form_body, run=run)):
        assert list(out["shardkit"]) == list(out["torch"]), rank
        assert any(k.endswith("_flat_param") for k in out["torch"]), rank
        for key in out["torch"]:
            assert_same_form(out["shardkit"][key], out["torch"][key], f"rank {rank} {key}")


def _interchange_body(rank: int, world_size: int, run: LegacyRun) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for source, target in (("torch", "shardkit"), ("shardkit", "torch")):
        model = wrap_model(source, run)
        opt = plain_sgd(model)
        train_steps(model, opt, run, range(3))
        loaded = fresh(target, run)
        # Loaded before the source trains on: FSDP1's values are views of its parameters.
        # FSDP1 with use_orig_params=True does not register its flat parameters, so its own
        # strict load calls their keys unexpected (it loads the parameters' views instead).
        strict = target == "shardkit" or not run.extra.get("use_orig_params", False)
        saved = state_dict_of(source, model, "LOCAL_STATE_DICT")
        result = load_into(target, loaded, "LOCAL_STATE_DICT", saved, strict=strict)
        out[f"{target}/keys"] = (list(result.missing_keys), list(result.unexpected_keys))
        out[f"{target}/params"] = full_params(target, loaded)
        out[f"{source}/params"] = full_params(source, model)
        out[f"{source}/after"] = train_steps(model, opt, run, range(3, 5))
        out[f"{target}/resumed"] = train_steps(loaded, plain_sgd(loaded), run, range(3, 5))
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_local_state_dicts_load_both_ways_and_training_goes_on(name: str) -> None:
    world_size, run = RUNS[name]
    for rank, out in enumerate(run_on_ranks(world_size, _interchange_body, run=run)):
        for source, target in (("torch", "shardkit"), ("shardkit", "torch")):
            where = f"rank {rank}: {source} -> {target}"
            missing, unexpected = out[f"{target}/keys"]
            assert missing == [], where
            assert all(k.endswith("_flat_param") for k in unexpected), where
            assert unexpected == [] or (target == "torch" and "orig-params" in name), where
            torch.testing.assert_close(out[f"{target}/resumed"], out[f"{source}/after"], msg=where)


def _refused(model: Any, state_dict: dict[str, Any]) -> str:
    """The error ``load_state_dict`` raises; the parameters must be as they were."""
    before = full_params("shardkit", model)
    try:
        load_into("shardkit", model, "LOCAL_STATE_DICT", state_dict)
    except ValueError as error:
        message = str(error)
    else:
        message = "no error"
    after = full_params("shardkit", model)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return message if unchanged else f"written: {message}"


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def _as_world(value: ShardedTensor, world: int) -> ShardedTensor:
    """The same flat parameter laid out as ``world`` ranks would lay it out (ours: zeros)."""
    numel = value.size()[0]
    shard = -(-numel // world)
    rank = dist.get_rank()
    start = min(rank * shard, numel)
    local = torch.zeros(max(0, min(shard, numel - start)) if rank < world else 0)
    return flat_sharded_tensor(local, start, numel, rank, _world())


def _errors_body(rank: int, world_size: int) -> dict[str, str]:
    run = LegacyRun(model="gpt")
    model = wrap_model("shardkit", run)
    train_steps(model, plain_sgd(model), run, range(1))
    good = state_dict_of("shardkit", model, "LOCAL_STATE_DICT")
    key = "blocks.0._flat_param"
    target = fresh("shardkit", run)
    out: dict[str, str] = {}
    missing = {k: v for k, v in good.items() if k != key}
    missing["blocks.0._flat_params"] = good[key]
    out["wrong key"] = _refused(target, missing)
    value: ShardedTensor = good[key]
    (shard,) = value.local_shards()
    local, start, numel = shard.tensor, shard.metadata.shard_offsets[0], value.size()[0]
    last = rank == world_size - 1
    longer = torch.cat([local, torch.zeros(8)]) if last else local
    bigger = flat_sharded_tensor(longer, start, numel + 8, rank, _world())
    out["wrong shape"] = _refused(target, {**good, key: bigger})
    if world_size == 4:
        out["wrong world size"] = _refused(target, {**good, key: _as_world(value, 2)})
    truncated = flat_sharded_tensor(local.clone(), start, numel, rank, _world())
    if last:  # a shard cut short on one rank only, its metadata intact
        truncated.local_shards()[0].tensor = local[:-1].clone()
    out["truncated"] = _refused(target, {**good, key: truncated})
    load_into("shardkit", target, "LOCAL_STATE_DICT", good)  # what was refused, fixed
    source, loaded = full_params("shardkit", model), full_params("shardkit", target)
    out["loads"] = str(all(torch.equal(source[k], loaded[k]) for k in source))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_state_dict_that_does_not_fit_is_refused_alike_on_every_rank(world_size: int) -> None:
    results = run_on_ranks(world_size, _errors_body)
    expected = {
        "wrong key": "blocks.0._flat_param (FSDP1 unit blocks.0): missing",
        "wrong shape": "blocks.0._flat_param (FSDP1 unit blocks.0): holds",
        "wrong world size": "blocks.0._flat_param (FSDP1 unit blocks.0): its shards lie at",
        "truncated": f"blocks.0._flat_param (FSDP1 unit blocks.0): rank {world_size - 1} holds",
    }
    for case, words in expected.items():
        if case not in results[0]:
            continue
        messages = {out[case] for out in results}
        assert len(messages) == 1, (case, messages)  # every rank: the same error
        (message,) = messages
        assert words in message and not message.startswith("written"), (case, message)
    assert all(out["loads"] == "True" for out in results)


def _subgroup_body(rank: int, world_size: int) -> str:
    """A model on ranks 0 and 1 only; ranks 2 and 3 take no part in its state dicts."""
    group = dist.new_group([0, 1])
    if rank >= 2:
        return "not a member"
    model = wrap_model("shardkit", LegacyRun(model="mlp", extra={"process_group": group}))
    good = state_dict_of("shardkit", model, "LOCAL_STATE_DICT")
    bad = {k: v for k, v in good.items() if k != "blocks.0._flat_param"}
    return _refused(model, bad)


def test_a_model_on_a_subgroup_is_refused_alike_without_the_other_ranks() -> None:
    # The members agree among themselves: before, they waited for ranks that never came.
    results = run_on_ranks(4, _subgroup_body, timeout_s=120)
    assert results[2:] == ["not a member", "not a member"]
    assert results[0] == results[1], results
    assert results[0].startswith("rank 0: LOCAL_STATE_DICT entry blocks.0._flat_param"), results
    assert "missing" in results[0]
