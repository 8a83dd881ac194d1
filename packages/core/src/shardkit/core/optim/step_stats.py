"""What a whole-matrix optimizer's step did on this rank: its updates, collectives and bytes.

``WholeMatrixOptimizer`` counts as it steps (:class:`Tally`) and keeps the result as
``last_step_stats`` (:class:`StepStats`): the comm report, the tests that count every matrix
once in the job, and the benchmarks read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.core.optim.routes import Traffic
from shardkit.core.optim.rule import WholeMatrixRule

__all__ = ["StepStats", "Tally"]


@dataclass(slots=True)
class Tally:
    """What a step has done so far on this rank (:class:`StepStats` once it ends)."""

    updates: int = 0
    cost: int = 0
    collectives: int = 0
    sent: int = 0
    received: int = 0

    def updated(self, rule: WholeMatrixRule, shape: tuple[int, int]) -> None:
        """One whole-matrix update of ``shape`` ran here."""
        self.updates += 1
        self.cost += rule.cost(shape)

    def exchanged(self, traffic: Traffic) -> None:
        """One collective moved ``traffic``'s bytes."""
        self.collectives += 1
        self.sent += traffic.sent
        self.received += traffic.received

    def stats(self) -> StepStats:
        """The step's figures, once it ends."""
        return StepStats(self.updates, self.cost, self.collectives, self.sent, self.received)


@dataclass(frozen=True, slots=True)
class StepStats:
    """What this rank's last step did: its share of the updates, its collectives, its bytes."""

    updates: int
    """Whole-matrix updates this rank ran (the matrices it owns, and those it holds whole)."""
    cost: int
    """Their summed cost (``WholeMatrixRule.cost``: Newton-Schulz's m * n * min(m, n))."""
    collectives: int
    """Collectives issued: two per process group with sharded matrices (rows out, rows back),
    and round (``WholeMatrixOptimizer.exchange_rounds``) that holds any of them."""
    bytes_sent: int
    """Bytes sent to other ranks in them."""
    bytes_received: int
    """Bytes received from other ranks in them."""
