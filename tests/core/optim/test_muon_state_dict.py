"""Muon's state dict round-trips: a resumed run continues with the uninterrupted run's bits.

Same world size and the same sharding, through ``state_dict()`` alone; DCP, CheckpointManager,
other world sizes and the other engine are ``test_muon_checkpoint.py``'s, a state dict that is
not Muon's ``test_muon_hostile_state.py``'s.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from shardkit.core.optim import Muon
from tests.core.optim.muon_runs import batch, build, full, loss_of, shard, takes_muon

SAVED_AT, STEPS = 3, 6


def _run(impl: str, rank: int, world_size: int, resume: dict[str, Any] | None) -> dict[str, Any]:
    """Train STEPS steps; with ``resume``, start from its model and optimizer state instead."""
    model = build("gpt")
    shard(model, impl, world_size)
    matrices = [(n, p) for n, p in model.named_parameters() if takes_muon("gpt", n, p)]
    opt = Muon(matrices, lr=0.02)
    first = 0
    if resume is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(resume["model"][name])
        opt.load_state_dict(resume["optim"])
        first = SAVED_AT
    saved: dict[str, Any] = {}
    for step in range(first, STEPS):
        if step == SAVED_AT:
            saved = {
                "model": {n: p.detach().clone() for n, p in model.named_parameters()},
                "optim": copy.deepcopy(opt.state_dict()),
            }
        x, y = batch("gpt", step, rank, world_size)
        loss_of("gpt", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"saved": saved, "params": {n: full(p) for n, p in model.named_parameters()}}


def _round_trip_body(rank: int, world_size: int, impl: str) -> dict[str, Any]:
    straight = _run(impl, rank, world_size, None)
    state = straight["saved"]["optim"]["state"]
    momentum = [v["momentum_buffer"] for v in state.values()]
    resumed = _run(impl, rank, world_size, straight["saved"])
    return {
        "sharded_state": all(isinstance(m, DTensor) for m in momentum) and len(momentum) == 8,
        "equal": all(
            torch.equal(straight["params"][n], resumed["params"][n]) for n in straight["params"]
        ),
    }


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_state_dict_round_trip(impl: str) -> None:
    results = run_on_ranks(2, _round_trip_body, impl=impl)
    assert results == [{"sharded_state": True, "equal": True}] * 2
