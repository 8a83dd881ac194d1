"""FULL_STATE_DICT: FSDP1's keys, order and values; rank0_only, offload; both directions."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.legacy.ckpt_support import (
    describe,
    fresh,
    load_into,
    plain_sgd,
    state_dict_of,
    train_steps,
)
from tests.legacy.legacy_parity import LegacyRun, lib, wrap_model

BF16 = {"param_dtype": torch.bfloat16, "buffer_dtype": torch.bfloat16}


def _save_body(rank: int, world_size: int, run: LegacyRun) -> dict[str, Any]:
    out: dict[str, Any] = {}
    trained = {}
    for impl in ("shardkit", "torch"):
        ns = lib(impl)
        model = trained[impl] = wrap_model(impl, run)
        train_steps(model, plain_sgd(model), run, range(2))
        full = state_dict_of(impl, model, "FULL_STATE_DICT")
        out[f"{impl}/layout"] = describe(full)
        out[f"{impl}/values"] = {k: v.float() for k, v in full.items()}
        config = ns.FullStateDictConfig(rank0_only=True)
        out[f"{impl}/rank0_only"] = describe(state_dict_of(impl, model, "FULL_STATE_DICT", config))
    # FSDP1's offload_to_cpu fails on a CPU-only machine ("setStorage"); shardkit's works.
    config = lib("shardkit").FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    offloaded = state_dict_of("shardkit", trained["shardkit"], "FULL_STATE_DICT", config)
    out["offloaded"] = describe(offloaded)
    return out


@pytest.mark.parametrize(
    ("world_size", "run"),
    [
        (2, LegacyRun(model="gpt", mixed_precision=BF16)),
        (4, LegacyRun(strategy="NO_SHARD")),
        (4, LegacyRun(strategy="HYBRID_SHARD", hybrid_mesh=(2, 2), model="gpt")),
    ],
    ids=["2-gpt-mp", "4-noshard", "4-hybrid"],
)
def test_full_state_dict_is_fsdp1s(world_size: int, run: LegacyRun) -> None:
    results = run_on_ranks(world_size, _save_body, run=run)
    for rank, out in enumerate(results):
        assert out["shardkit/layout"] == out["torch/layout"], rank
        ours, theirs = out["shardkit/values"], out["torch/values"]
        tol = 1e-2 if run.mixed_precision else 1e-5
        for key in ours:
            torch.testing.assert_close(
                ours[key], theirs[key], rtol=tol, atol=tol / 10, msg=f"{rank} {key}"
            )
        assert out["shardkit/rank0_only"] == out["torch/rank0_only"], rank
        # NO_SHARD gives every rank FULL's default (as FSDP1), whatever the config says;
        # with HSDP, FSDP1's "rank 0" is the first rank of each shard group.
        shard = run.hybrid_mesh[1] if run.hybrid_mesh else world_size
        receives = run.strategy == "NO_SHARD" or rank % shard == 0
        assert bool(out["shardkit/rank0_only"]) == receives
        if receives:
            assert out["offloaded"] == out["torch/layout"]  # CPU tensors, same layout
        else:
            assert out["offloaded"] == []


def _round_trip_body(rank: int, world_size: int, run: LegacyRun) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for source, target in (("torch", "shardkit"), ("shardkit", "torch")):
        model = wrap_model(source, run)
        opt = plain_sgd(model)
        train_steps(model, opt, run, range(3))
        saved = state_dict_of(source, model, "FULL_STATE_DICT")
        out[f"{source}/after"] = train_steps(model, opt, run, range(3, 5))
        loaded = fresh(target, run)
        result = load_into(target, loaded, "FULL_STATE_DICT", saved)
        out[f"{target}/result"] = (list(result.missing_keys), list(result.unexpected_keys))
        out[f"{target}/resumed"] = train_steps(loaded, plain_sgd(loaded), run, range(3, 5))
    return out


@pytest.mark.parametrize(
    ("world_size", "run"),
    [(2, LegacyRun(model="gpt")), (4, LegacyRun(strategy="SHARD_GRAD_OP"))],
    ids=["2-gpt", "4-zero2"],
)
def test_full_state_dicts_load_both_ways_and_training_goes_on(
    world_size: int, run: LegacyRun
) -> None:
    out = run_on_ranks(world_size, _round_trip_body, run=run)[0]
    # torch -> shardkit: shardkit goes on as torch did; shardkit -> torch likewise.
    torch.testing.assert_close(out["shardkit/resumed"], out["torch/after"])
    torch.testing.assert_close(out["torch/resumed"], out["shardkit/after"])
    assert out["shardkit/result"] == out["torch/result"] == ([], [])


def _refusals_body(rank: int, world_size: int) -> dict[str, str]:
    import shardkit.legacy as legacy

    model = wrap_model("shardkit", LegacyRun())
    out = {}
    full = state_dict_of("shardkit", model, "FULL_STATE_DICT")
    full["head.weight"] = full["head.weight"][:1]
    full["extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as bad:
        load_into("shardkit", model, "FULL_STATE_DICT", full)
    out["bad"] = str(bad.value)
    with pytest.raises(RuntimeError) as config:
        legacy.FSDP.set_state_dict_type(
            model, legacy.StateDictType.FULL_STATE_DICT, legacy.ShardedStateDictConfig()
        )
    out["config"] = str(config.value)
    return out


def test_bad_input_is_refused_by_name() -> None:
    out = run_on_ranks(2, _refusals_body)[0]
    assert "head.weight: shape mismatch" in out["bad"] and "extra: unexpected" in out["bad"]
    assert "Expected state_dict_config of type" in out["config"]


def _checkpointed_body(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    from tests.core import models
    from tests.legacy.ckpt_support import train_steps

    run = LegacyRun()
    out: dict[str, Any] = {}
    for impl in ("shardkit", "torch"):
        model = wrap_model(impl, run)
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, models.Block))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        out[f"{impl}/losses"] = train_steps(model, opt, run, range(2))
        out[f"{impl}/keys"] = list(state_dict_of(impl, model, "FULL_STATE_DICT"))
        with lib(impl).FSDP.state_dict_type(model, lib(impl).StateDictType.FULL_STATE_DICT):
            osd = lib(impl).FSDP.optim_state_dict(model, opt)
        out[f"{impl}/optim_keys"] = sorted(osd["state"])
        out[f"{impl}/inner"] = type(model.blocks[0].module).__name__
    return out


def test_activation_checkpoint_prefixes_are_stripped_as_fsdp1_does() -> None:
    out = run_on_ranks(2, _checkpointed_body)[0]
    torch.testing.assert_close(out["shardkit/losses"], out["torch/losses"])
    for what in ("keys", "optim_keys"):
        assert out[f"shardkit/{what}"] == out[f"torch/{what}"], what
    assert "blocks.0.fc1.weight" in out["shardkit/keys"]
    assert out["shardkit/inner"].endswith("Block") and out["torch/inner"] == "Block"
