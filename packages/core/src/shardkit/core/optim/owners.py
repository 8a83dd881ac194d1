"""Which rank orthogonalizes which matrix: owners balanced by the update's cost.

Each sharded matrix is updated whole on one rank of its group, its owner, and nowhere else.
The assignment is a pure function of the matrices' costs and the group's size, so every rank
computes the same one with no message. Longest first, each to the least loaded rank (ties to
the lowest rank): within 4/3 of the best balance, and equal-cost matrices (one shape, the
layers of a transformer) spread round the ranks, where each owner batches those it got.
"""

from __future__ import annotations

import heapq

__all__ = ["assign_owners"]


def assign_owners(costs: list[int], world: int) -> list[int]:
    """The owning rank (0 to ``world`` - 1) of each matrix, given each one's cost.

    Args:
        costs: each matrix's work (``WholeMatrixRule.cost``), in the step's order of them.
        world: the ranks to spread them over.

    Returns:
        One rank per matrix, in ``costs``' order.
    """
    assert world >= 1, "at least one rank"
    owners = [0] * len(costs)
    loads = [(0, rank) for rank in range(world)]  # (work so far, rank): a heap
    # Largest first; among equals the earlier matrix first, so that ties break one way.
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + costs[index], rank))
    return owners
