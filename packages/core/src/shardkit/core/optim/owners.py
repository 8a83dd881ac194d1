"""Which rank orthogonalizes which matrix: owners balanced by the update's cost.

Each sharded matrix is updated whole on one rank of its group, its owner, and nowhere else.
The assignment is a pure function of the matrices' costs and the group's size, so every rank
computes the same one with no message. Longest first, each to the least loaded rank (ties to
the lowest rank): within 4/3 of the best balance, and equal-cost matrices (one shape, the
layers of a transformer) spread round the ranks, where each owner batches those it got.

A matrix some ranks already hold whole (an expert that FSDP's ``Shard(0)`` put on one rank, a
replicated matrix) moves no rows in when one of them owns it: it goes first to the least
loaded of them, as long as that keeps the rank within its fair share of the total; what does
not fit goes to the balancing above.

An optimizer may have each owner work through its matrices in rounds of about equal cost
(:func:`rounds`; ``WholeMatrixOptimizer.exchange_rounds``): the exchanges then carry one
round at a time, so that a round's updates travel back while the owner orthogonalizes the
next (``exchange.py``).
"""

from __future__ import annotations

import heapq

__all__ = ["assign_owners", "rounds"]


def assign_owners(
    costs: list[int],
    world: int,
    whole_on: list[tuple[int, ...]] | None = None,
    tall: list[bool] | None = None,
) -> list[int]:
    """The owning rank (0 to ``world`` - 1) of each matrix, given each one's cost.

    Args:
        costs: each matrix's work (``WholeMatrixRule.cost``), in the step's order of them.
        world: the ranks to spread them over.
        whole_on: each matrix's ranks that hold it whole already (none by default).
        tall: whether each matrix has more rows than columns (none is, by default). Among
            matrices of one cost the tall ones go after the others, so that each owner gets
            its share of both kinds: a transformer's up and down projections, (4d, d) and
            (d, 4d), cost the same and alternate in the step's order, so ties broken by order
            alone gave one rank every up projection at W=2. A tall matrix costs its owner a
            little more than its cost says (Newton-Schulz runs on its transpose, and the
            update is copied out of that layout before its rows leave): measured on the 8M
            benchmark GPT, the owner of the eight (1024, 256) matrices took 31 ms where the
            owner of the eight (256, 1024) took 29.

    Returns:
        One rank per matrix, in ``costs``' order.
    """
    assert world >= 1, "at least one rank"
    owners = [0] * len(costs)
    work = [0] * world
    kind = tall if tall is not None else [False] * len(costs)
    # Largest first; among equals the wide before the tall, then the earlier matrix first,
    # so that ties break one way on every rank.
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], kind[i], i))
    fair = sum(costs) / world
    left: list[int] = []
    for index in order:
        holders = whole_on[index] if whole_on is not None else ()
        rank = min(holders, key=lambda r: (work[r], r), default=None)
        if rank is None or work[rank] + costs[index] > fair:
            left.append(index)
            continue
        owners[index] = rank
        work[rank] += costs[index]
    loads = [(work[rank], rank) for rank in range(world)]  # (work so far, rank): a heap
    heapq.heapify(loads)
    for index in left:
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + costs[index], rank))
    return owners


def rounds(costs: list[int], owners: list[int], count: int) -> list[list[int]]:
    """The matrices of each round, every owner's cut into ``count`` of about equal cost.

    An owner's matrices keep their order (the step's); matrix i falls in the round where
    its owner's cost before it falls. Rounds that no owner has anything in are left out, so
    an owner of one matrix gives one round.

    Args:
        costs: each matrix's work, in the step's order.
        owners: each one's owner (:func:`assign_owners`).
        count: the most rounds.

    Returns:
        The matrices' indices in each round, in the step's order; every matrix in one.
    """
    assert count >= 1, "at least one round"
    total = [0] * (max(owners, default=0) + 1)
    for cost, owner in zip(costs, owners, strict=True):
        total[owner] += cost
    before = [0] * len(total)
    found: list[list[int]] = [[] for _ in range(count)]
    for i, (cost, owner) in enumerate(zip(costs, owners, strict=True)):
        # The middle of its work, so that a round holds the matrices centred in its share.
        share = (before[owner] + cost / 2) / max(total[owner], 1)
        found[min(count - 1, int(share * count))].append(i)
        before[owner] += cost
    return [r for r in found if r]
