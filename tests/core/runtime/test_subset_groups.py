"""A model on some ranks of the world leaves torch's group counter equal on every rank.

torch names each new process group by a counter (``_world.group_count``); from torch 2.14
every group creation advances it on the ranks that take part, groups made by their members
alone (``use_local_synchronization=True``) included. A pipeline stage is a model on a strict
subset of the ranks: if loading it or checking it for desyncs made a group of its ranks
alone, those ranks' counter would run ahead of the others', and the world's next group
(``new_group``, ``init_device_mesh``) would be named differently on the two sides: its
creation hangs. Here the model lives on ranks 0 and 1 of 4 (a slice of a world-wide mesh,
as a pipeline program makes it), it loads a state dict, gathers a full one or runs
desync-checked steps (on gloo, and on the path NCCL takes), and then every rank makes a
world-wide group and all-reduces on it, with a timeout so that a hang fails the test.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from harness.pool import run_on_ranks, shutdown_pools
from tests.core import models
from tests.core.parity import Run, apply, rank_batch

WORLD = 4
# Long enough for gloo's connections on two busy cores, short enough to fail well within
# the task's timeout.
GROUP_TIMEOUT_S = 30.0
CASES = ["load", "load_error", "full_state_dict", "desync_gloo", "desync_native"]


def _stage(rank: int, mesh: DeviceMesh, case: str) -> str:
    """What the model's ranks do: a load (good or bad on rank 1), a full state dict gathered
    to the coordinator (which agrees on its outcome), or two desync-checked steps."""
    from shardkit.core import iter_full_state_dict, set_debug
    from shardkit.core.runtime import collectives

    model = models.build("mlp")
    apply("shardkit", model, mesh, Run(model="mlp"))
    if case == "full_state_dict":
        keys = [key for key, _ in iter_full_state_dict(model, rank0_only=True)]
        return f"{len(keys)} keys"
    if case.startswith("load"):
        state: dict[str, Any] = dict(model.state_dict())
        if case == "load_error" and rank == 1:
            state[next(iter(state))] = torch.zeros(5, 5)
        try:
            model.load_state_dict(state)
        except RuntimeError as error:
            return str(error)
        return "loaded"
    original = collectives._uses_gloo
    if case == "desync_native":  # the path NCCL takes, with its data on gloo
        collectives._uses_gloo = lambda group: False
    set_debug(True)
    try:
        for step in range(2):
            x, y = rank_batch("mlp", step, rank, mesh.size(), "shardkit")
            models.loss_of("mlp", model(x), y).backward()
        return "stepped"
    finally:
        set_debug(False)
        collectives._uses_gloo = original


def _group_counts(world_size: int) -> list[int]:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    counts: list[Any] = [None] * world_size
    dist.all_gather_object(counts, int(_world.group_count))
    return [int(c) for c in counts]


def _pipeline_body(rank: int, world_size: int, case: str) -> dict[str, Any]:
    import torch.distributed as dist

    # Every rank makes the program's mesh; stage 0 (ranks 0 and 1) holds the model.
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    outcome = _stage(rank, mesh["dp"], case) if rank < 2 else "not a member"
    before = _group_counts(world_size)
    try:
        group = dist.new_group(timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        total = torch.ones(1)
        dist.all_reduce(total, group=group)
        reduced: float | str = total.item()
    except Exception as error:  # a hang that timed out: the counters told the names apart
        reduced = f"{type(error).__name__}: {error}"[:300]
    return {
        "outcome": outcome,
        "before": before,
        "after": _group_counts(world_size),
        "sum": reduced,
    }


@pytest.mark.parametrize("case", CASES)
def test_a_model_on_some_ranks_leaves_the_world_able_to_make_groups(case: str) -> None:
    try:
        results = run_on_ranks(WORLD, _pipeline_body, case=case, timeout_s=150)
        first = results[0]
        assert all(r["sum"] == WORLD for r in results), [r["sum"] for r in results]
        for result in results:
            counts = result["before"] + result["after"]
            assert len(set(result["before"])) == 1 and len(set(result["after"])) == 1, counts
    except BaseException:
        # Ranks whose counters differ cannot make a group together again: fresh workers.
        shutdown_pools()
        raise
    assert [r["outcome"] for r in results[2:]] == ["not a member"] * 2
    if case == "load":
        assert first["outcome"] == results[1]["outcome"] == "loaded"
    elif case == "full_state_dict":  # on the coordinator only
        assert first["outcome"] != "0 keys" and results[1]["outcome"] == "0 keys", results[:2]
    elif case == "load_error":  # both members raise rank 1's error, as before
        assert first["outcome"] == results[1]["outcome"], results[:2]
        assert first["outcome"].startswith("rank 1: "), first["outcome"]
    else:
        assert first["outcome"] == results[1]["outcome"] == "stepped"
