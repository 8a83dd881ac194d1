"""load_state_dict agrees across the model's ranks: a value bad on one rank loads on none.

Each rank checks its own state dict before writing. A value bad on one rank only (a full
tensor of the wrong shape, a DTensor holding a short shard) used to raise there while the
other ranks loaded: the model ended half old, half new, and the ranks went on with different
models. Now every rank raises the same error and every parameter stays bit-identical.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply, full_params, make_mesh

KEY = "blocks.0.mlp.0.weight"  # (64, 16): keys before and after it would be written


def _sharded(world_size: int, seed: int, hsdp: bool = False) -> Any:
    model = models.build("gpt", seed=seed)
    run = Run(model="gpt", hsdp=(2, world_size // 2) if hsdp else None)
    apply("shardkit", model, make_mesh(run, world_size), run)
    return model


def _locals(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _bad_on_rank1_body(
    rank: int, world_size: int, bad: str, hsdp: bool = False, bad_rank: int = 1
) -> dict[str, Any]:
    model = _sharded(world_size, seed=0, hsdp=hsdp)
    source = _sharded(world_size, seed=3, hsdp=hsdp)
    sd: dict[str, Any] = dict(source.state_dict())
    if rank == bad_rank and bad == "wrong_shape":
        sd[KEY] = torch.zeros(5, 5)
    elif rank == bad_rank and bad == "short_shard":
        value = sd[KEY]
        short = value.to_local()[:-1]  # a shard that lost its last row
        sd[KEY] = DTensor.from_local(
            short,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    before = _locals(model)
    try:
        model.load_state_dict(sd)
        error, message = "", "no error"
    except Exception as exc:
        error, message = type(exc).__name__, str(exc)
    after = _locals(model)
    unchanged = all(after[k].equal(v) for k, v in before.items())
    # The ranks are still in step: a good load together works.
    model.load_state_dict(source.state_dict())
    want = full_params(source)
    loaded = all(v.equal(want[k]) for k, v in full_params(model).items())
    return {"error": error, "message": message, "unchanged": unchanged, "loaded": loaded}


@pytest.mark.parametrize("bad", ["wrong_shape", "short_shard"])
def test_a_value_bad_on_one_rank_loads_on_no_rank(bad: str) -> None:
    results = run_on_ranks(2, _bad_on_rank1_body, bad=bad)
    first = results[0]
    assert first["error"] == "RuntimeError", first
    assert first["message"].startswith("rank 1: "), first["message"]
    assert KEY in first["message"] and "nothing was loaded" in first["message"]
    for result in results:
        assert (result["error"], result["message"]) == (first["error"], first["message"])
        assert result["unchanged"], result
        assert result["loaded"], result


def test_a_value_bad_on_one_rank_of_a_hybrid_mesh_loads_on_no_rank() -> None:
    # The outcomes travel along each axis of the (replicate, shard) mesh in turn: rank 3's
    # failure reaches rank 0, which shares no axis with it, through rank 1.
    results = run_on_ranks(4, _bad_on_rank1_body, bad="wrong_shape", hsdp=True, bad_rank=3)
    first = results[0]
    assert first["message"].startswith("rank 3: ") and KEY in first["message"], first
    for result in results:
        assert (result["error"], result["message"]) == (first["error"], first["message"])
        assert result["unchanged"], result
        assert result["loaded"], result


def _subgroup_body(rank: int, world_size: int) -> dict[str, Any]:
    """A model on ranks 0 and 1 of 4; ranks 2 and 3 never load it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group([0, 1])
    if rank >= 2:
        return {"member": False}
    mesh = DeviceMesh.from_group(group, "cpu")
    model = models.build("gpt", seed=0)
    apply("shardkit", model, mesh, Run(model="gpt"))
    sd: dict[str, Any] = dict(model.state_dict())
    if rank == 1:
        sd[KEY] = torch.zeros(5, 5)
    before = _locals(model)
    try:
        model.load_state_dict(sd)
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    unchanged = all(v.equal(before[k]) for k, v in _locals(model).items())
    return {"member": True, "message": message, "unchanged": unchanged}


def test_a_model_on_a_subgroup_agrees_among_its_ranks_only() -> None:
    # The agreement travels on the model's own group: shardkit makes no group of its own on
    # ranks 0 and 1 (tests/core/runtime/test_subset_groups.py). The pool starts afresh after
    # this task all the same: torch registers the test's own group on its members only, and
    # names later groups by how many a process holds (harness/worker.py, _group_registry).
    results = run_on_ranks(4, _subgroup_body)
    assert results[2:] == [{"member": False}] * 2
    assert results[0] == results[1], results
    assert results[0]["message"].startswith("rank 1: ") and KEY in results[0]["message"]
    assert results[0]["unchanged"]
