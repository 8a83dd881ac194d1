"""``replicated_over``: matrices the ranks of an axis hold alike, orthogonalized once across it.

Under FSDP x TP, what no TP style cuts is a DTensor of the dp axis alone; told TP's mesh, Muon
takes it as replicated there too (the MoE models' run is in ``test_muon_models.py``). Here: the
word is checked (ranks that differ are refused on every rank, before anything changes), a mesh
that is not an axis of the parameter's own is refused by name, and plain tensors held alike
are updated once and sent to the rest, with torch's Muon's bits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.core import fully_shard
from shardkit.core.optim import Muon


def _local(param: torch.Tensor) -> torch.Tensor:
    assert isinstance(param, DTensor)
    return param.to_local()


def _disagreeing_body(rank: int, world_size: int, *, differ: str) -> dict[str, Any]:
    """FSDP on dp of a (2, 2) mesh; the tp ranks given different weights or batches."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank = mesh["tp"].get_local_rank()
    torch.manual_seed(tp_rank if differ == "values" else 0)
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 4, bias=False))
    fully_shard(model, mesh=mesh["dp"])
    opt = Muon(list(model.named_parameters()), lr=0.02, replicated_over=mesh["tp"])
    torch.manual_seed(100 + (tp_rank if differ == "gradients" else 0))
    model(torch.randn(3, 8)).sum().backward()
    before = [_local(p).clone() for p in model.parameters()]
    try:
        opt.step()
    except ValueError as error:
        after = [_local(p) for p in model.parameters()]
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        return {"error": str(error), "unchanged": unchanged, "state": len(opt.state)}
    return {"error": ""}


@pytest.mark.parametrize("differ", ["values", "gradients"])
def test_ranks_that_do_not_hold_the_same_are_refused_on_every_rank(differ: str) -> None:
    results = run_on_ranks(4, _disagreeing_body, differ=differ)
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors  # one error, word for word, on every rank
    (error,) = errors
    assert error.startswith(f"0.weight: its {differ} differ across replicated_over's ranks"), error
    assert all(r["unchanged"] and r["state"] == 0 for r in results)  # nothing stepped


def _other_mesh_body(rank: int, world_size: int, *, how: str) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    if how == "overlapping":
        other = init_device_mesh("cpu", (world_size,), mesh_dim_names=("all",))
    else:  # the same ranks as TP's axis, but a mesh of its own: torch cannot join the two
        ranks = torch.arange(world_size).reshape(2, 2).T  # its axis "a" holds TP's ranks
        other = DeviceMesh("cpu", ranks, mesh_dim_names=("a", "b"))["a"]
        assert other.mesh.tolist() == mesh["tp"].mesh.tolist()
    model = nn.Linear(8, 6, bias=False)
    fully_shard(model, mesh=mesh["dp"])
    try:
        Muon([("proj.weight", model.weight)], replicated_over=other)
    except ValueError as error:
        return str(error)
    return ""


_MESSAGES = {"overlapping": "share ranks other than this one", "apart": "not axes of one device"}


@pytest.mark.parametrize("how", list(_MESSAGES))
def test_a_mesh_that_is_not_another_axis_of_the_parameters_is_refused_by_name(how: str) -> None:
    message = _MESSAGES[how]
    for text in run_on_ranks(4, _other_mesh_body, how=how):
        assert text.startswith("proj.weight: its mesh") and message in text, text


def _plain_body(rank: int, world_size: int, *, steps: int) -> dict[str, Any]:
    """Plain matrices, the same on every rank, against torch's Muon in this process."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 6, bias=False))
    theirs = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 6, bias=False))
    theirs.load_state_dict(ours.state_dict())
    muon = Muon(ours.parameters(), lr=0.02, replicated_over=mesh)
    reference = torch.optim.Muon(theirs.parameters(), lr=0.02)
    equal, updates = [], []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for model, opt in ((ours, muon), (theirs, reference)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        pairs = zip(ours.parameters(), theirs.parameters(), strict=True)
        equal.append(all(torch.equal(a, b) for a, b in pairs))
        assert muon.last_step_stats is not None
        updates.append(muon.last_step_stats.updates)
    return {"equal": equal, "updates": updates}


def test_plain_matrices_held_alike_are_updated_once_with_torchs_bits() -> None:
    steps = 3
    results = run_on_ranks(2, _plain_body, steps=steps)
    assert all(r["equal"] == [True] * steps for r in results)
    # Two matrices in all: each updated by one rank, the other receives it.
    assert [sum(r["updates"][s] for r in results) for s in range(steps)] == [2] * steps


def _stages_body(rank: int, world_size: int, *, steps: int) -> dict[str, Any]:
    """Two pipeline stages (different models) of a (pp, dp, tp) mesh, FSDP on dp, told tp."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh["pp"].get_local_rank()
    models = []
    for _ in range(2):
        torch.manual_seed(stage)  # each stage its own weights: the same across its tp ranks
        models.append(nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 5, bias=False)))
    ours, theirs = models
    fully_shard(ours, mesh=mesh["dp"])
    muon = Muon(ours.parameters(), lr=0.02, replicated_over=mesh["tp"])
    reference = torch.optim.Muon(theirs.parameters(), lr=0.02)
    equal, updates = [], []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + stage))
        for model, opt in ((ours, muon), (theirs, reference)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        pairs = zip(ours.parameters(), theirs.parameters(), strict=True)
        equal.append(all(torch.equal(_full(a), b) for a, b in pairs))
        assert muon.last_step_stats is not None
        updates.append(muon.last_step_stats.updates)
    return {"equal": equal, "updates": updates, "stage": stage}


def _full(param: torch.Tensor) -> torch.Tensor:
    assert isinstance(param, DTensor)
    return param.full_tensor()


def test_pipeline_stages_each_update_their_own_matrices_once() -> None:
    # Each stage's (dp, tp) slice is flattened into a group of its own (2 of the 4 ranks).
    steps = 2
    results = run_on_ranks(4, _stages_body, steps=steps)
    assert all(r["equal"] == [True] * steps for r in results)
    for stage in (0, 1):
        done = [sum(r["updates"][s] for r in results if r["stage"] == stage) for s in range(steps)]
        assert done == [2] * steps  # its 2 matrices, once each across its 2 tp ranks
