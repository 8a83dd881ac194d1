"""The constructor's arguments do what FSDP1's do: structure, names, init, sync, ignored."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core import models
from tests.legacy.legacy_parity import (
    LegacyRun,
    assert_close_traces,
    fsdp_kwargs,
    full_params,
    lib,
    parity_body,
    train,
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


def _strategy_warnings(rank: int, world_size: int, impl: str, run: LegacyRun) -> dict[str, Any]:
    """The strategy every unit ends up with, and the warnings construction gave."""
    ns = lib(impl)
    kwargs = fsdp_kwargs(impl, run)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ns.FSDP(models.build(run.model), **kwargs)
    return {
        "strategies": [unit.sharding_strategy.name for unit in ns.FSDP.fsdp_modules(model)],
        "warnings": sorted(
            {f"{w.category.__name__}: {w.message}" for w in caught if "NO_SHARD" in str(w.message)}
        ),
    }


@pytest.mark.parametrize(
    ("world_size", "strategy"),
    [(1, "FULL_SHARD"), (1, "SHARD_GRAD_OP"), (1, "NO_SHARD"), (2, "NO_SHARD"), (2, "FULL_SHARD")],
)
def test_one_rank_is_no_shard_with_fsdp1s_warnings(world_size: int, strategy: str) -> None:
    run = LegacyRun(strategy=strategy)
    ours = run_on_ranks(world_size, _strategy_warnings, impl="shardkit", run=run)
    theirs = run_on_ranks(world_size, _strategy_warnings, impl="torch", run=run)
    assert ours == theirs
    expected = "NO_SHARD" if world_size == 1 else strategy
    assert set(ours[0]["strategies"]) == {expected}
    # The switch warns at one rank; NO_SHARD chosen warns it is deprecated, past one rank.
    assert bool(ours[0]["warnings"]) == ((strategy == "NO_SHARD") != (world_size == 1))


def _hybrid_of_one_shard(rank: int, world_size: int) -> dict[str, Any]:
    hybrid = LegacyRun(strategy="HYBRID_SHARD", hybrid_mesh=(world_size, 1), steps=3)
    no_shard = LegacyRun(strategy="NO_SHARD", steps=3)
    return {
        "ours": train("shardkit", hybrid, rank, world_size)["params"],
        "fsdp1": train("torch", hybrid, rank, world_size)["params"],
        "fsdp1 no_shard": train("torch", no_shard, rank, world_size)["params"],
    }


def test_a_hybrid_shard_group_of_one_still_all_reduces_across_replicas() -> None:
    # FSDP1 makes HYBRID_SHARD over a shard group of one NO_SHARD over that group alone: its
    # replicas never exchange gradients and drift apart (pytorch/pytorch#154888). shardkit
    # keeps the all-reduce: its replicas stay equal, and equal to FSDP1's NO_SHARD.
    first, second = run_on_ranks(2, _hybrid_of_one_shard)
    for name, value in first["ours"].items():
        assert torch.equal(value, second["ours"][name]), name
        assert torch.equal(value, first["fsdp1 no_shard"][name]), name
    drifted = [n for n, v in first["fsdp1"].items() if not torch.equal(v, second["fsdp1"][n])]
    assert drifted


def _pairs_body(rank: int, world_size: int) -> dict[str, Any]:
    # Two NO_SHARD models side by side, each on its own pair of ranks (every rank makes both
    # groups; each pair builds only its own model).
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    run = LegacyRun(strategy="NO_SHARD", steps=3, extra={"process_group": pairs[rank // 2]})
    return {impl: train(impl, run, rank, world_size)["params"] for impl in ("shardkit", "torch")}


def test_no_shard_units_on_disjoint_groups_train_as_fsdp1s() -> None:
    results = run_on_ranks(4, _pairs_body)
    for out in results:
        for name, value in out["shardkit"].items():
            assert torch.equal(value, out["torch"][name]), name
    # Each pair reduced over itself alone: the two pairs' models differ.
    assert any(
        not torch.equal(v, results[2]["shardkit"][n]) for n, v in results[0]["shardkit"].items()
    )


class _Mixed(nn.Module):
    """A unit's parameters as FSDP1 may or may not flatten them (``kind``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 2)
        if kind == "frozen":  # trainable and frozen in one unit
            self.first.weight.requires_grad_(False)
        elif kind == "dtypes":
            self.second.double()
        elif kind == "integer":
            self.first.weight = nn.Parameter(torch.ones(4, 4, dtype=torch.int64), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.second(torch.relu(self.first(x)))
        return out


def _flatten_body(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("frozen", "dtypes", "integer"):
        for orig in (False, True):
            for impl in ("shardkit", "torch"):
                module = _Mixed(kind)
                before = {n: p.detach().clone() for n, p in module.named_parameters()}
                kwargs = {"device_id": torch.device("cpu"), "use_orig_params": orig}
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        model = lib(impl).FSDP(module, **kwargs)
                except ValueError as error:
                    out[f"{impl}/{kind}/{orig}"] = f"ValueError: {error}"
                    out[f"{impl}/{kind}/{orig}/untouched"] = all(
                        type(p) is nn.Parameter and torch.equal(p, before[n])
                        for n, p in module.named_parameters()
                    )
                    continue
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
                data = torch.Generator().manual_seed(rank)
                losses = []
                for _ in range(3):
                    loss = model(torch.randn(3, 4, generator=data)).square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
                out[f"{impl}/{kind}/{orig}"] = losses
    return out


def test_units_fsdp1_cannot_flatten_are_refused_with_its_errors() -> None:
    for out in run_on_ranks(2, _flatten_body):
        for kind in ("frozen", "dtypes", "integer"):
            for orig in (False, True):
                case = f"{kind}/{orig}"
                assert out[f"shardkit/{case}"] == out[f"torch/{case}"], case
        # Refused before anything is sharded: the module keeps its own parameters.
        assert out["shardkit/frozen/False"].startswith("ValueError: Must flatten tensors with")
        assert out["shardkit/frozen/False/untouched"] is True
        assert "uniform dtype" in out["shardkit/dtypes/True"]
        assert out["shardkit/dtypes/True/untouched"] is True
        assert out["shardkit/integer/False"] == "ValueError: Cannot flatten integer dtype tensors"
        # With use_orig_params=True a unit may mix trainable and frozen parameters.
        assert isinstance(out["shardkit/frozen/True"], list)
