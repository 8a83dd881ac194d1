"""shardkit's Muon on HSDP, FSDP x TP, replicate and MoE expert stacks: torch's Muon's bits.

Each matrix (each expert of a stack) is orthogonalized once in the whole job: the updates of
every rank's last step sum to the number of matrices.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.pool import run_on_ranks
from tests.core.optim.placement_runs import compare_body, stages_body

STEPS = 4


def _check(results: list[dict[str, Any]], steps: int = STEPS) -> None:
    for rank, out in enumerate(results):
        assert out["equal"] == [True] * steps, (rank, out["max_diff"])
        assert all(stats[2] == 2 for stats in out["stats"])  # two collectives a step
    for step in range(steps):
        assert sum(out["stats"][step][0] for out in results) == results[0]["matrices"]


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize("model", ["mlp", "one"])
def test_hsdp_2x2(impl: str, model: str) -> None:
    # The MLP's head has 3 rows over 2 shards; "one" is one 5 x 4 matrix on 4 ranks.
    _check(run_on_ranks(4, compare_body, impl=impl, layout="hsdp", model=model, steps=STEPS))


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize("model", ["mlp", "sp"])
def test_fsdp_x_tp_2x2(impl: str, model: str) -> None:
    # "mlp": colwise (FSDP's _StridedShard over TP's rows), rowwise (FSDP's rows, TP's
    # columns), colwise again; 6, 8 and 10 rows cut 2 + 1, 2 + 2, 3 + 2: three matrices on four
    # ranks. "sp": sequence parallelism too, a rowwise input of 7 columns (4 + 3) and a
    # colwise head of 3 rows (one rank holds none).
    _check(run_on_ranks(4, compare_body, impl=impl, layout="tp", model=model, steps=STEPS))


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_hsdp_x_tp_on_a_3d_mesh(impl: str) -> None:
    # (dp_replicate, dp_shard, tp) = (2, 1, 2): two replicas of TP's blocks, the dp_shard
    # axis of one rank; one copy of each block reaches its owner.
    results = run_on_ranks(4, compare_body, impl=impl, layout="hsdp_tp", model="sp", steps=STEPS)
    _check(results)


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize("model", ["gpt", "one"])
def test_replicate(impl: str, model: str) -> None:
    # Every rank holds every matrix whole: owners need no rows, and send their updates.
    _check(run_on_ranks(2, compare_body, impl=impl, layout="replicate", model=model, steps=STEPS))


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_columns_cut_on_one_axis(impl: str) -> None:
    # shard_placement_fn=Shard(1): column blocks travel as the row blocks do.
    _check(run_on_ranks(2, compare_body, impl=impl, layout="shard1", model="mlp", steps=STEPS))


@pytest.mark.parametrize("impl", ["shardkit", "torch"])
@pytest.mark.parametrize(
    ("layout", "model", "world"), [("fsdp", "moe", 2), ("fsdp", "moe3", 2), ("hsdp", "moe", 4)]
)
def test_moe_expert_stacks(impl: str, layout: str, model: str, world: int) -> None:
    # transformers' Qwen3-MoE keeps its experts as (E, out, in) stacks. FSDP puts whole experts
    # on each rank (2 and 2; with 3 experts, 2 and 1), which owns them and moves no byte for
    # them; under HSDP 2 x 2 each expert is whole on one rank of each replica.
    results = run_on_ranks(world, compare_body, impl=impl, layout=layout, model=model, steps=STEPS)
    _check(results)


def test_pipeline_stages_on_their_own_meshes() -> None:
    # A (pp, dp, tp) = (2, 1, 2) mesh: each stage's matrix on its own 2-D slice, of its own
    # shape; neither stage's optimizer waits for the other's.
    results = run_on_ranks(4, stages_body, steps=STEPS)
    assert results == [[True] * STEPS] * 4
