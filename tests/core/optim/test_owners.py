"""Owners: each matrix orthogonalized once in the job, balanced by cost, batched by shape."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from harness.pool import run_on_ranks
from shardkit.core.optim import MUON_RULE, WholeMatrixOptimizer
from shardkit.core.optim.matrices import Block, MatrixPlacement
from shardkit.core.optim.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    newton_schulz_cost,
    orthogonalize,
    orthogonalize_batch,
)
from shardkit.core.optim.owners import assign_owners, rounds
from tests.core.optim.muon_runs import batch, build, loss_of, shard, takes_muon

# A GPT's matrices, 8 blocks of d=256: qkv, proj, and the MLP's two.
GPT_SHAPES = [(768, 256), (256, 256), (1024, 256), (256, 1024)] * 8


@pytest.mark.parametrize("world", [2, 4, 8])
def test_owners_share_the_work_within_ten_percent(world: int) -> None:
    costs = [newton_schulz_cost(s) for s in GPT_SHAPES]
    owners = assign_owners(costs, world)
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(world)]
    assert max(loads) <= 1.1 * sum(costs) / world, loads
    assert owners == assign_owners(costs, world)  # a pure function: every rank agrees


def test_fewer_matrices_than_ranks() -> None:
    assert assign_owners([60], 4) == [0]
    assert assign_owners([10, 30], 4) == [1, 0]  # the larger first, to the first rank


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48), (3, 16)])
def test_orthogonalize_has_torch_muons_bits(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    matrices = torch.randn(3, *shape)
    theirs = [_zeropower_via_newtonschulz(m, DEFAULT_NS_COEFFICIENTS, 5, 1e-7) for m in matrices]
    ours = [orthogonalize(m, DEFAULT_NS_COEFFICIENTS, 5, 1e-7) for m in matrices]
    batched = orthogonalize_batch(matrices, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
    for t, o, b in zip(theirs, ours, batched, strict=True):
        assert torch.equal(t, o) and torch.equal(t, b)


_CALLS: list[tuple[int, int]] = []  # the shapes this worker orthogonalized, one per matrix


def _counted(matrix: torch.Tensor, options: Any) -> torch.Tensor:
    _CALLS.append((matrix.size(0), matrix.size(1)))
    return MUON_RULE.update(matrix, options)


def _counted_batch(matrices: torch.Tensor, options: Any) -> torch.Tensor:
    _CALLS.extend([(matrices.size(1), matrices.size(2))] * matrices.size(0))
    assert MUON_RULE.update_batch is not None
    return MUON_RULE.update_batch(matrices, options)


def _count_body(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    rule = dataclasses.replace(MUON_RULE, update=_counted, update_batch=_counted_batch)
    model = build("gpt")
    shard(model, "shardkit", world_size)
    matrices = [p for n, p in model.named_parameters() if takes_muon("gpt", n, p)]
    defaults = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                "ns_coefficients": DEFAULT_NS_COEFFICIENTS, "eps": 1e-7, "ns_steps": 5,
                "adjust_lr_fn": None}  # fmt: skip
    opt = WholeMatrixOptimizer(matrices, defaults, rule=rule)
    calls = []
    for step in range(steps):
        _CALLS.clear()
        x, y = batch("gpt", step, rank, world_size)
        loss_of("gpt", model(x), y).backward()
        opt.step()
        opt.zero_grad()
        calls.append(list(_CALLS))
    return {"calls": calls, "shapes": [tuple(p.shape) for p in matrices]}


def test_every_matrix_orthogonalized_once_in_the_job() -> None:
    results = run_on_ranks(2, _count_body, steps=3)
    shapes = Counter(results[0]["shapes"])
    for step in range(3):
        done = Counter(s for out in results for s in out["calls"][step])
        assert done == shapes  # each matrix once, on one rank
        assert all(out["calls"][step] for out in results)  # both ranks took a share


def test_a_matrix_held_whole_is_owned_where_it_is_held() -> None:
    # Four experts of one cost, FSDP's Shard(0) of the stack putting two whole on each rank:
    # each is owned where it is, and none moves (balancing alone would give [0, 1, 0, 1]).
    assert assign_owners([8] * 4, 2) == [0, 1, 0, 1]
    assert assign_owners([8] * 4, 2, [(0,), (0,), (1,), (1,)]) == [0, 0, 1, 1]
    # All whole on rank 0: it keeps its fair share, the rest are balanced as ever.
    assert assign_owners([8] * 4, 2, [(0,)] * 4) == [0, 0, 1, 1]
    # Replicated (whole everywhere): still balanced.
    owners = assign_owners([8, 8, 4, 4], 2, [(0, 1)] * 4)
    assert sorted(
        sum(c for c, o in zip([8, 8, 4, 4], owners, strict=True) if o == r) for r in (0, 1)
    ) == [12, 12]


@pytest.mark.parametrize("world", [2, 4])
def test_each_owner_gets_its_share_of_tall_and_wide_matrices_of_one_cost(world: int) -> None:
    # A GPT's blocks, in the step's order: qkv (3d, d), proj (d, d), up (4d, d), down (d, 4d).
    # Up and down cost the same; by order alone every up projection went to even ranks at
    # W=2 (and to ranks 0 and 2 at W=4), every down projection to the others.
    d = 256
    shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * 8
    costs = [newton_schulz_cost(s) for s in shapes]
    tall = [m > n for m, n in shapes]
    by_order = assign_owners(costs, world)
    assert {o for o, s in zip(by_order, shapes, strict=True) if s == (4 * d, d)} == {0, 2} & set(
        range(world)
    )
    owners = assign_owners(costs, world, tall=tall)
    for rank in range(world):
        mine = Counter(s for s, o in zip(shapes, owners, strict=True) if o == rank)
        assert mine == Counter({s: 8 // world for s in set(shapes)}), (rank, mine)
    # The cost balance is what it was: only which of two equal matrices goes where changed.
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(world)]
    assert loads == [sum(costs) // world] * world


def test_one_copy_of_each_block_from_the_owners_own_replica() -> None:
    # HSDP 2 x 2 (group ranks 0, 1 the first replica; 2, 3 the second): rows 0-3 on ranks 0
    # and 2, rows 3-6 on ranks 1 and 3. An owner gathers within its own replica.
    top, bottom = Block(0, 3, 0, 4), Block(3, 6, 0, 4)
    hsdp = MatrixPlacement("w", (6, 4), None, (top, bottom, top, bottom), ((0,), (0,), (1,), (1,)))
    assert [hsdp.senders(owner) for owner in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert hsdp.whole_on() == ()
    # Replicated: the owner holds it whole and gathers from itself alone.
    whole = Block(0, 6, 0, 4)
    replicated = MatrixPlacement("w", (6, 4), None, (whole,) * 2, ((0,), (1,)))
    assert [replicated.senders(owner) for owner in range(2)] == [(0,), (1,)]
    assert replicated.whole_on() == (0, 1)
    # A rank with an empty block (uneven rows) sends nothing.
    empty = Block(0, 0, 0, 0)
    uneven = MatrixPlacement("w", (1, 4), None, (Block(0, 1, 0, 4), empty), ((), ()))
    assert uneven.senders(1) == (0,) and uneven.whole_on() == (0,)


def test_rounds_cut_each_owners_work_into_near_equal_parts() -> None:
    # Rank 0 owns four matrices of cost 4, 3, 2, 1; rank 1 one of cost 5. In two rounds rank
    # 0's first round holds the matrices centred in the first half of its work (4: 0 to 4 of
    # 10), its second the rest; rank 1's one matrix sits in the round its middle falls in.
    costs, owners = [4, 5, 3, 2, 1], [0, 1, 0, 0, 0]
    assert rounds(costs, owners, 2) == [[0], [1, 2, 3, 4]]
    assert rounds(costs, owners, 1) == [[0, 1, 2, 3, 4]]
    cut = rounds([1] * 8, [0, 1] * 4, 4)  # 4 equal matrices each: one a round
    assert cut == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rounds([7], [0], 4) == [[0]]  # one matrix: one round, the empty ones left out
