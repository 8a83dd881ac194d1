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
"""

from __future__ import annotations

import heapq

__all__ = ["assign_owners"]


def assign_owners(
    costs: list[int], world: int, whole_on: list[tuple[int, ...]] | None = None
) -> list[int]:
    """The owning rank (0 to ``world`` - 1) of each matrix, given each one's cost.

    Args:
        costs: each matrix's work (``WholeMatrixRule.cost``), in the step's order of them.
        world: the ranks to spread them over.
        whole_on: each matrix's ranks that hold it whole already (none by default).

    Returns:
        One rank per matrix, in ``costs``' order.
    """
    assert world >= 1, "at least one rank"
    owners = [0] * len(costs)
    work = [0] * world
    # Largest first; among equals the earlier matrix first, so that ties break one way.
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
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
