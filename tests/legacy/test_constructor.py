"""The constructor's arguments do what FSDP1's do: structure, names, init, sync, ignored."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core import models
from tests.legacy.legacy_parity import (
    LegacyRun,
    assert_close_traces,
    full_params,
    lib,
    parity_body,
    wrap_model,
)


def _structure_body(rank: int, world_size: int) -> dict[str, Any]:
    run = LegacyRun(model="gpt", extra={"use_orig_params": True})
    out: dict[str, Any] = {}
    for impl in ("shardkit", "torch"):
        original = models.build("gpt")
        model = wrap_model(impl, run, original)
        fsdp = lib(impl).FSDP
        out[impl] = {
            "modules": [n for n, _ in model.named_modules()],
            "params": [n for n, _ in model.named_parameters()],
            "units": [type(m).__name__ for m in fsdp.fsdp_modules(model)],
            "roots": len(fsdp.fsdp_modules(model, root_only=True)),
            "inner": model.module is original,
            "forwarded": model.head is original.head,  # attributes of the wrapped module
            "is_root": model.check_is_root(),
            "inner_is_root": fsdp.fsdp_modules(model)[1].check_is_root(),
        }
    out["dtensors"] = all(isinstance(p, DTensor) for p in wrap_model("shardkit", run).parameters())
    return out


def test_module_tree_names_and_units_are_fsdp1s() -> None:
    out = run_on_ranks(2, _structure_body)[0]
    assert out["shardkit"] == out["torch"]
    assert out["shardkit"]["inner"] and out["shardkit"]["is_root"]
    assert not out["shardkit"]["inner_is_root"] and out["dtensors"]


def _init_body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    run = LegacyRun(model="mlp")
    # sync_module_states: every rank starts from rank 0's values. FSDP1 refuses CPU
    # tensors here; shardkit.legacy broadcasts them: the oracle is rank 0's model.
    model = wrap_model(
        "shardkit", LegacyRun(extra={"sync_module_states": True}), models.build("mlp", seed=rank)
    )
    out["sync/shardkit"] = full_params("shardkit", model)
    out["sync/torch"] = {n: p.detach() for n, p in models.build("mlp", seed=0).named_parameters()}
    for impl in ("shardkit", "torch"):
        # Meta-device construction, materialized by reset_parameters or param_init_fn.
        torch.manual_seed(7)
        with torch.device("meta"):
            meta = models.MLPNet()
        out[f"meta/{impl}"] = full_params(impl, wrap_model(impl, run, meta))
        with torch.device("meta"):
            meta = models.MLPNet()

        def init(module: nn.Module) -> None:
            module.to_empty(device="cpu", recurse=False)
            with torch.no_grad():
                for p in module.parameters(recurse=False):
                    p.fill_(0.5)

        custom = LegacyRun(extra={"param_init_fn": init})
        out[f"init_fn/{impl}"] = full_params(impl, wrap_model(impl, custom, meta))
    return out


def test_sync_module_states_and_meta_device_init_match_fsdp1() -> None:
    for rank, out in enumerate(run_on_ranks(2, _init_body)):
        for what in ("sync", "meta", "init_fn"):
            ours, theirs = out[f"{what}/shardkit"], out[f"{what}/torch"]
            assert ours.keys() == theirs.keys(), what
            for name in ours:
                torch.testing.assert_close(ours[name], theirs[name], msg=f"{rank} {what} {name}")
        assert all(torch.all(v == 0.5) for v in out["init_fn/shardkit"].values())


def test_ignored_modules_and_per_module_kwargs_train_like_fsdp1() -> None:
    runs = [
        LegacyRun(ignored=("head",), wrap="none"),
        LegacyRun(model="gpt", ignored=("blocks.1",)),
    ]
    for rank, traces in enumerate(run_on_ranks(2, parity_body, runs=runs)):
        for run, trace in zip(runs, traces, strict=True):
            assert_close_traces(trace["shardkit"], trace["torch"], what=f"{rank} {run.ignored}")


def _custom_policy_body(rank: int, world_size: int) -> dict[str, Any]:
    import shardkit.legacy as legacy

    strategies = {}
    for impl in ("shardkit", "torch"):
        ns = lib(impl)
        policy = ns.CustomPolicy(
            lambda m, ns=ns: (
                {"sharding_strategy": ns.ShardingStrategy.SHARD_GRAD_OP}
                if isinstance(m, models.Block)
                else False
            )
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = ns.FSDP(models.build("mlp"), auto_wrap_policy=policy, device_id="cpu")
        strategies[impl] = [m.sharding_strategy.name for m in ns.FSDP.fsdp_modules(model)]
    errors = []
    kwargs: dict[str, Any]
    for kwargs in (
        {"ignored_modules": [], "ignored_states": []},
        {"sharding_strategy": legacy.ShardingStrategy.HYBRID_SHARD, "process_group": object()},
    ):
        with pytest.raises(ValueError) as caught:
            legacy.FSDP(models.build("mlp"), **kwargs)
        errors.append(str(caught.value))
    return {"strategies": strategies, "errors": errors}


def test_custom_policy_overrides_and_refused_arguments() -> None:
    out = run_on_ranks(2, _custom_policy_body)[0]
    assert out["strategies"]["shardkit"] == out["strategies"]["torch"]
    assert out["strategies"]["shardkit"][1:] == ["SHARD_GRAD_OP"] * 3
    assert "Cannot pass both ignored_modules and ignored_states" in out["errors"][0]
    assert "Tuple[dist.ProcessGroup, dist.ProcessGroup]" in out["errors"][1]
