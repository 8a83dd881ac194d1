"""Optimizer state in FSDP1's forms, both ways, with two param groups: equal to torch's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.pool import run_on_ranks
from tests.legacy.ckpt_support import fresh, load_into, state_dict_of, train_steps
from tests.legacy.legacy_parity import lib
from tests.legacy.optim_support import (
    RUN,
    adamw,
    assert_same,
    call,
    comparable,
    trained,
    with_type,
)

STRATEGIES = {
    "FULL_SHARD": RUN,
    "NO_SHARD": dataclasses.replace(RUN, strategy="NO_SHARD"),
    # FSDP1 cuts NO_SHARD's state only from flat parameters; with use_orig_params=True its
    # SHARDED and LOCAL forms are whole tensors. (FULL_SHARD with use_orig_params=True is
    # not here: torch 2.13's FSDP1 gives exp_avg_sq's values for exp_avg there.)
    "NO_SHARD-orig": dataclasses.replace(RUN, strategy="NO_SHARD", extra={"use_orig_params": True}),
}


def _forms_body(rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl in ("shardkit", "torch"):
        model, opt = trained(impl, run=STRATEGIES[strategy])
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
            with with_type(impl, model, kind):
                out[f"{impl}/{kind}"] = comparable(call(impl, "optim_state_dict", model, opt))
        config = lib(impl).FullOptimStateDictConfig(rank0_only=True)
        with with_type(impl, model, "FULL_STATE_DICT", config):
            out[f"{impl}/rank0_only"] = comparable(call(impl, "optim_state_dict", model, opt))
        out[f"{impl}/legacy_full"] = comparable(call(impl, "full_optim_state_dict", model, opt))
        out[f"{impl}/legacy_sharded"] = comparable(
            call(impl, "sharded_optim_state_dict", model, opt)
        )
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_optimizer_state_dicts_have_fsdp1s_keys_values_and_groups(strategy: str) -> None:
    # NO_SHARD too: FSDP1 cuts its SHARDED and LOCAL state across the ranks, whole as it is.
    for rank, out in enumerate(run_on_ranks(2, _forms_body, strategy=strategy)):
        for what in (
            "FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT", "rank0_only",
            "legacy_full", "legacy_sharded",
        ):  # fmt: skip
            assert_same(out[f"shardkit/{what}"], out[f"torch/{what}"], f"rank {rank} {what}")
        full = out["shardkit/FULL_STATE_DICT"]
        assert len(full["param_groups"]) == 2 and full["param_groups"][1]["lr"] == 0.02
        assert all("step" in entry for entry in full["state"].values())
        assert (out["shardkit/rank0_only"] == {}) == (rank != 0)


def _round_trip_body(rank: int, world_size: int, kind: str, strategy: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    run = STRATEGIES[strategy]
    for source, target in (("torch", "shardkit"), ("shardkit", "torch")):
        model, opt = trained(source, steps=3, run=run)
        with with_type(source, model, kind):
            model_sd = state_dict_of(source, model, kind)
            osd = call(source, "optim_state_dict", model, opt)
        # A twin goes on: FSDP1's state dicts share the live `step` tensors, which training
        # the saved model further would change.
        twin, twin_opt = trained(source, steps=3, run=run)
        out[f"{source}/after"] = train_steps(twin, twin_opt, run, range(3, 5))
        loaded = fresh(target, run)
        loaded_opt = adamw(loaded)
        load_into(target, loaded, kind, model_sd)
        with with_type(target, loaded, kind):
            ready = call(target, "optim_state_dict_to_load", loaded, loaded_opt, osd)
        loaded_opt.load_state_dict(ready)
        out[f"{target}/resumed"] = train_steps(loaded, loaded_opt, run, range(3, 5))
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_and_sharded_optimizer_state_load_both_ways_and_training_goes_on(
    strategy: str,
) -> None:
    # Under LOCAL_STATE_DICT FSDP1's optimizer state is its sharded form (only the model's
    # state dict is flat), so it loads as SHARDED's does; NO_SHARD's chunks are gathered.
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        out = run_on_ranks(2, _round_trip_body, kind=kind, strategy=strategy)[0]
        torch.testing.assert_close(out["shardkit/resumed"], out["torch/after"], msg=kind)
        torch.testing.assert_close(out["torch/resumed"], out["shardkit/after"], msg=kind)


def _legacy_load_body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, opt = trained("torch", steps=3)
    full = call("torch", "full_optim_state_dict", model, opt, rank0_only=False)
    sharded = call("torch", "sharded_optim_state_dict", model, opt)
    model_sd = state_dict_of("torch", model, "FULL_STATE_DICT")
    twin, twin_opt = trained("torch", steps=3)
    out["torch/after"] = train_steps(twin, twin_opt, RUN, range(3, 5))
    ways: dict[str, Callable[[nn.Module, torch.optim.Optimizer], dict[str, Any]]] = {
        "shard_full": lambda m, o: call(
            "shardkit", "shard_full_optim_state_dict", full, m, optim=o
        ),
        "scatter": lambda m, o: call(
            "shardkit", "scatter_full_optim_state_dict", full if rank == 0 else None, m, optim=o
        ),
        "flatten": lambda m, o: call("shardkit", "flatten_sharded_optim_state_dict", sharded, m, o),
    }
    for way, to_load in ways.items():
        ours = fresh("shardkit", RUN)
        ours_opt = adamw(ours)
        load_into("shardkit", ours, "FULL_STATE_DICT", model_sd)
        ours_opt.load_state_dict(to_load(ours, ours_opt))
        out[way] = train_steps(ours, ours_opt, RUN, range(3, 5))
    # Keys by name and by position, on the wrapped model and on a plain one.
    ours, ours_opt = trained("shardkit")
    by_id = ours_opt.state_dict()
    key_type = lib("shardkit").OptimStateKeyType
    by_name = call(
        "shardkit", "rekey_optim_state_dict", by_id, key_type.PARAM_NAME, ours, optim=ours_opt
    )
    back = call(
        "shardkit", "rekey_optim_state_dict", by_name, key_type.PARAM_ID, ours, optim=ours_opt
    )
    out["rekey_names"] = sorted(by_name["state"]) == sorted(
        n for g in by_name["param_groups"] for n in g["params"]
    )
    out["rekey_back"] = _same_ids(back, by_id) and all(
        back["state"][i] is by_id["state"][i] for i in by_id["state"]
    )
    from tests.core import models

    plain = models.build("gpt")
    plain_opt = adamw(plain)
    train_steps(plain, plain_opt, RUN, range(1))
    for impl in ("shardkit", "torch"):
        rekeyed = call(
            impl, "rekey_optim_state_dict", plain_opt.state_dict(),
            lib(impl).OptimStateKeyType.PARAM_NAME, plain, optim=plain_opt,
        )  # fmt: skip
        out[f"{impl}/plain_rekey"] = comparable(rekeyed)
    return out


def _same_ids(ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    return sorted(ours["state"]) == sorted(theirs["state"]) and [
        sorted(g["params"]) for g in ours["param_groups"]
    ] == [sorted(g["params"]) for g in theirs["param_groups"]]


def test_legacy_optimizer_apis_load_fsdp1_state_and_rekey_like_fsdp1() -> None:
    for out in run_on_ranks(2, _legacy_load_body):
        for way in ("shard_full", "scatter", "flatten"):
            torch.testing.assert_close(out[way], out["torch/after"], msg=way)
        assert out["rekey_names"] and out["rekey_back"]
        assert_same(out["shardkit/plain_rekey"], out["torch/plain_rekey"], "plain rekey")


def _other_cut_body(rank: int, world_size: int) -> str:
    # NO_SHARD's SHARDED state saved over four ranks, loaded into NO_SHARD units of two.
    four = STRATEGIES["NO_SHARD"]
    model, opt = trained("shardkit", run=four)
    with with_type("shardkit", model, "SHARDED_STATE_DICT"):
        saved = call("shardkit", "optim_state_dict", model, opt)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    two = dataclasses.replace(four, extra={"process_group": pairs[rank // 2]})
    target, target_opt = trained("shardkit", run=two)
    before = comparable(target_opt.state_dict())
    try:
        with with_type("shardkit", target, "SHARDED_STATE_DICT"):
            call("shardkit", "optim_state_dict_to_load", target, target_opt, saved)
    except ValueError as error:
        assert_same(comparable(target_opt.state_dict()), before, "the optimizer after a refusal")
        return str(error)
    return "loaded"


def test_no_shard_chunks_of_another_cut_are_refused_on_every_rank() -> None:
    for message in run_on_ranks(4, _other_cut_body):
        assert "this rank's chunk has shape" in message, message
        assert "saved on another number of ranks" in message


_LIVE_FORMS = (("FULL_STATE_DICT", True), ("FULL_STATE_DICT", False), ("SHARDED_STATE_DICT", True))


def _live_body(rank: int, world_size: int) -> dict[str, int]:
    # How many of a NO_SHARD optimizer state dict's tensors the next step changes.
    out = {}
    for impl in ("shardkit", "torch"):
        for kind, orig in _LIVE_FORMS:
            run = dataclasses.replace(STRATEGIES["NO_SHARD"], extra={"use_orig_params": orig})
            model, opt = trained(impl, steps=1, run=run)
            with with_type(impl, model, kind):
                saved = call(impl, "optim_state_dict", model, opt)
            before = {name: entry["exp_avg"].clone() for name, entry in saved["state"].items()}
            train_steps(model, opt, run, range(1, 2))
            out[f"{impl}/{kind}/{orig}"] = sum(
                not torch.equal(value, saved["state"][name]["exp_avg"])
                for name, value in before.items()
            )
    return out


def test_no_shard_full_optimizer_state_is_the_live_state_as_fsdp1s() -> None:
    # FSDP1 hands out NO_SHARD's live tensors (SHARDED too, with use_orig_params=True): code
    # written for it may read them after a step.
    for out in run_on_ranks(2, _live_body):
        for kind, orig in _LIVE_FORMS:
            key = f"{kind}/{orig}"
            assert out[f"shardkit/{key}"] == out[f"torch/{key}"] > 0, key
