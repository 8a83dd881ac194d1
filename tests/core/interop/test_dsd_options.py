"""torch.distributed.checkpoint.state_dict (DSD) and its StateDictOptions on shardkit models.

DSD has no code for shardkit: it sees a module tree whose parameters are DTensors. These tests
pin down that every option combination round-trips (state taken after 2 AdamW steps, loaded
into a fresh sharded model and optimizer, 3 more steps give the losses of a run that never
stopped) and that each option's values have the documented form.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.ckpt_helpers import (
    RESUMED,
    SAVE_AFTER,
    adamw,
    devices_of,
    eval_forward,
    kinds_of,
    mesh_of,
    model_values,
    optim_values,
    sharded_gpt,
    snapshot,
    train,
)


def _equal(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> list[str]:
    """The names whose values differ (or are missing on one side); [] when all are equal."""
    names = sorted(set(ours) | set(theirs))
    return [n for n in names if n not in ours or n not in theirs or not ours[n].equal(theirs[n])]


def _round_trip_body(
    rank: int, world_size: int, full: bool, cpu_offload: bool, broadcast: bool, meta: bool
) -> dict[str, Any]:
    mesh = mesh_of(world_size)
    model = sharded_gpt("shardkit", mesh)
    opt = adamw(model)
    train(model, opt, range(SAVE_AFTER), rank, world_size)
    save_options = StateDictOptions(full_state_dict=full, cpu_offload=cpu_offload)
    # Copies: sharded state dicts alias the live tensors, which training on would change.
    saved_model = snapshot(get_model_state_dict(model, options=save_options))
    saved_optim = snapshot(get_optimizer_state_dict(model, opt, options=save_options))
    expected_model, expected_optim = model_values(model), optim_values(model, opt)
    uninterrupted = train(model, opt, RESUMED, rank, world_size)

    if broadcast and rank != 0:
        saved_model, saved_optim = {}, {}  # only rank 0 holds the checkpoint
    load_options = StateDictOptions(
        full_state_dict=full, cpu_offload=cpu_offload, broadcast_from_rank0=broadcast
    )
    fresh = sharded_gpt("shardkit", mesh, seed=7, meta=meta)
    # A meta model gets new parameter objects from the load: the optimizer comes after it.
    set_model_state_dict(fresh, saved_model, options=load_options)
    fresh_opt = adamw(fresh)
    set_optimizer_state_dict(fresh, fresh_opt, saved_optim, options=load_options)
    loaded = {
        "model_differs": _equal(model_values(fresh), expected_model),
        "optim_differs": _equal(optim_values(fresh, fresh_opt), expected_optim),
        "param_kinds": kinds_of(dict(fresh.named_parameters())),
    }
    resumed = train(fresh, fresh_opt, RESUMED, rank, world_size)
    return dict(loaded, uninterrupted=uninterrupted, resumed=resumed)


# (full_state_dict, cpu_offload, broadcast_from_rank0 when loading). Full state saved with
# cpu_offload exists on rank 0 only, so it can only be loaded by broadcasting from there.
_OPTIONS = [
    pytest.param(False, False, False, id="sharded"),
    pytest.param(False, True, False, id="sharded-cpu_offload"),
    pytest.param(True, False, False, id="full"),
    pytest.param(True, False, True, id="full-broadcast"),
    pytest.param(True, True, True, id="full-cpu_offload-broadcast"),
]


def _check_round_trip(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["model_differs"] == [], (rank, result["model_differs"])
        assert result["optim_differs"] == [], (rank, result["optim_differs"])
        assert result["param_kinds"] == {"DTensor"}, (rank, result["param_kinds"])
        # Same world size, same state, same data: the same bits.
        assert result["resumed"] == result["uninterrupted"], rank


@pytest.mark.parametrize(("full", "cpu_offload", "broadcast"), _OPTIONS)
def test_options_round_trip(full: bool, cpu_offload: bool, broadcast: bool) -> None:
    results = run_on_ranks(
        2,
        _round_trip_body,
        full=full,
        cpu_offload=cpu_offload,
        broadcast=broadcast,
        meta=False,
    )
    _check_round_trip(results)


@pytest.mark.parametrize(
    ("full", "cpu_offload", "broadcast"),
    [pytest.param(False, False, False, id="sharded"), _OPTIONS[-1]],
)
def test_options_round_trip_one_rank(full: bool, cpu_offload: bool, broadcast: bool) -> None:
    results = run_on_ranks(
        1,
        _round_trip_body,
        full=full,
        cpu_offload=cpu_offload,
        broadcast=broadcast,
        meta=False,
    )
    _check_round_trip(results)


def test_broadcast_from_rank0_into_meta_model() -> None:
    """The documented way to load a full checkpoint into a model built on the meta device."""
    results = run_on_ranks(
        2, _round_trip_body, full=True, cpu_offload=True, broadcast=True, meta=True
    )
    _check_round_trip(results)


def _forms_body(rank: int, world_size: int) -> dict[str, Any]:
    model = sharded_gpt("shardkit", mesh_of(world_size))
    opt = adamw(model)
    train(model, opt, range(SAVE_AFTER), rank, world_size)
    params = dict(model.named_parameters())
    gathered_model, gathered_optim = model_values(model), optim_values(model, opt)
    global_shapes = {n: v.shape for n, v in models.build("gpt").state_dict().items()}

    sharded: dict[str, Any] = get_model_state_dict(model)
    sharded_optim: dict[str, Any] = get_optimizer_state_dict(model, opt)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    full_optim = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True)
    )
    rank0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
    rank0_model = get_model_state_dict(model, options=rank0)
    rank0_optim = get_optimizer_state_dict(model, opt, options=rank0)

    def full_model_bad(sd: dict[str, Any]) -> list[str]:
        """Names whose value is not a plain tensor of the global shape equal to the gathered."""
        return [
            n
            for n in global_shapes
            if type(sd.get(n)) is not torch.Tensor
            or sd[n].shape != global_shapes[n]
            or not sd[n].equal(gathered_model[n])
        ]

    def full_optim_bad(osd: dict[str, Any]) -> list[str]:
        """Moments that are not plain tensors equal to the gathered ones; missing states."""
        bad = []
        for fqn, state in osd["state"].items():
            for key, value in state.items():
                name = f"{fqn}.{key}"
                if type(value) is not torch.Tensor or not value.equal(gathered_optim[name]):
                    bad.append(name)
        if len(bad) == 0 and len(osd["state"]) != len(params):
            bad.append(f"{len(osd['state'])} states for {len(params)} parameters")
        return bad

    return {
        "sharded_keys": set(sharded) == set(global_shapes),
        # The sharded state dict is the parameters themselves, not copies.
        "sharded_aliases": [
            n
            for n, p in params.items()
            if not (
                isinstance(sharded[n], DTensor)
                and sharded[n].placements == p.placements
                and sharded[n].to_local().data_ptr() == p.to_local().data_ptr()
            )
        ],
        "sharded_optim_kinds": kinds_of(
            [v for s in sharded_optim["state"].values() for k, v in s.items() if k != "step"]
        ),
        "sharded_optim_keys": set(sharded_optim["state"]) == set(params),
        "full_bad": full_model_bad(full),
        "full_optim_bad": full_optim_bad(full_optim),
        "rank0_model_bad": full_model_bad(rank0_model) if rank == 0 else rank0_model,
        "rank0_optim_bad": full_optim_bad(rank0_optim) if rank == 0 else rank0_optim,
        "rank0_devices": devices_of([rank0_model, rank0_optim]),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_state_dict_forms(world_size: int) -> None:
    """sharded: the DTensor parameters; full: plain gathered tensors; full+cpu_offload: rank 0."""
    results = run_on_ranks(world_size, _forms_body)
    for rank, result in enumerate(results):
        assert result["sharded_keys"], rank
        assert result["sharded_aliases"] == [], (rank, result["sharded_aliases"])
        assert result["sharded_optim_kinds"] == {"DTensor"}, (rank, result)
        assert result["sharded_optim_keys"], rank
        assert result["full_bad"] == [], (rank, result["full_bad"])
        assert result["full_optim_bad"] == [], (rank, result["full_optim_bad"])
        # torch's documented behaviour: only rank 0 keeps the values; the others get {}.
        assert result["rank0_model_bad"] == ([] if rank == 0 else {}), (rank, result)
        assert result["rank0_optim_bad"] == ([] if rank == 0 else {}), (rank, result)
        assert result["rank0_devices"] <= {"cpu"}, (rank, result["rank0_devices"])


# --- loading into a model that has run a forward -------------------------------------------


# After a forward with no backward (an eval pass, say), the root keeps its full parameters
# (reshard_after_forward=None means False for the root). A load must not leave those stale.
def _load_after_forward_body(rank: int, world_size: int, impl: str, assign: bool) -> dict[str, Any]:
    mesh = mesh_of(world_size)
    model = sharded_gpt(impl, mesh)
    opt = adamw(model)
    train(model, opt, range(SAVE_AFTER), rank, world_size)
    saved_model = snapshot(get_model_state_dict(model))
    saved_optim = snapshot(get_optimizer_state_dict(model, opt))
    uninterrupted = train(model, opt, RESUMED, rank, world_size)

    fresh = sharded_gpt(impl, mesh, seed=7)
    eval_forward(fresh)
    # Sharded state only: with the root's full parameters registered, DSD's full-state loads
    # fail on torch's fully_shard as well (named_parameters() holds plain tensors then).
    if assign:
        fresh.load_state_dict(saved_model, assign=True)
    else:
        set_model_state_dict(fresh, saved_model)
    fresh_opt = adamw(fresh)  # after the load: assign=True replaces the parameter objects
    set_optimizer_state_dict(fresh, fresh_opt, saved_optim)
    resumed = train(fresh, fresh_opt, RESUMED, rank, world_size)
    return {"uninterrupted": uninterrupted, "resumed": resumed}


@pytest.mark.parametrize("impl", ["torch", "shardkit"])
def test_load_after_a_forward_only(impl: str) -> None:
    """Evaluate, then load a checkpoint and train on: the loaded values must be used."""
    results = run_on_ranks(2, _load_after_forward_body, impl=impl, assign=False)
    assert results[0]["resumed"] == results[0]["uninterrupted"]


@pytest.mark.parametrize("impl", ["torch", "shardkit"])
def test_assign_load_after_a_forward_only(impl: str) -> None:
    """The same with ``load_state_dict(assign=True)``, which replaces the parameter objects."""
    results = run_on_ranks(2, _load_after_forward_body, impl=impl, assign=True)
    assert results[0]["resumed"] == results[0]["uninterrupted"]
