"""The search: the fastest sharding plan whose predicted peak fits a memory budget.

It compares the configurations of ``candidates`` by their predicted peak and step time (an
``Evaluate`` function: the planner's memory model and the step-time model), without running
anything. Trying every combination would cost hundreds of predictions; the search leans on
what each choice does to memory and time instead:

- per structure (unit boundary, edge modules, precision, offload), the plan that saves the
  most memory (every block recomputed, nothing kept) bounds what can fit: if it does not
  fit, no plan of that structure does;
- and the plan that saves the most time (nothing recomputed, every block kept, the deepest
  prefetch) bounds how fast the structure can be: a structure whose bound is no faster than
  the best plan found is not explored;
- within a structure, recomputing fewer blocks costs memory and saves time, and so does
  keeping more blocks' parameters: for each recomputation level (fewest blocks first), the
  search finds the most blocks it can keep by bisection (memory grows with each kept block),
  then tries the deeper prefetch there.

So the answer is the fastest plan among those tried, not a proof that no untried one is
faster; ``SearchResult.evaluated`` lists every plan predicted, so a user can see what was
compared. When nothing fits, the result says which plan came closest and by how much.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from shardkit.tools.plan.search.candidates import (
    Boundary,
    Choice,
    ModelShape,
    Precision,
    sharding_plan,
)
from shardkit.tools.plan.sharding_plan import CheckpointMode, ShardingPlan

__all__ = [
    "Estimate",
    "Evaluate",
    "Evaluated",
    "SearchResult",
    "SearchSpace",
    "search",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """What the models predict for one plan."""

    peak_bytes: int
    """Device memory at the step's peak, on the rank that needs the most: what the budget is
    compared with."""
    live_bytes: int | None = None
    """The live tensors' peak, where ``peak_bytes`` is what torch's CUDA caching allocator
    reserves (a plan for CUDA); None where ``peak_bytes`` is the live bytes (a CPU plan)."""
    seconds: float
    """Predicted step time."""
    parts: dict[str, float] = field(default_factory=dict)
    """The step time's parts by name (compute, exposed communication, recompute, ...), for
    saying why one plan is slower than another."""


Evaluate = Callable[[ShardingPlan], Estimate]
"""Predicts a plan's peak and step time (``evaluator.planner_evaluator`` builds one)."""


@dataclass(frozen=True, slots=True)
class Evaluated:
    """A plan the search predicted."""

    choice: Choice
    plan: ShardingPlan
    estimate: Estimate
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the choice in words, its peak, step time and the time's parts."""
        return {
            "choice": self.choice.describe(),
            "peak_bytes": self.estimate.peak_bytes,
            "live_peak_bytes": self.estimate.live_bytes,
            "step_seconds": self.estimate.seconds,
            "parts": dict(self.estimate.parts),
            "fits": self.fits,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpace:
    """What the search may choose from; the user's limits (precision, offload) go here."""

    boundaries: tuple[Boundary, ...] = ("block", "pair", "sub")
    edges_apart: tuple[bool, ...] = (False, True)
    prefetch: tuple[int, ...] = (1, 2)
    checkpoint_levels: tuple[int, ...] = (0, 4, 2, 1)
    """Recompute every n-th block (0: none), fewest recomputed first."""
    selective: bool = True
    """Also try selective recomputation of every block (where the installed torch has it)."""
    reshard_slices: tuple[int, ...] = ()
    """Slices ``n`` to try for ``reshard_after_forward=n`` (each must divide the shard count;
    the ranks of a node, say)."""
    precisions: tuple[Precision, ...] = (Precision(),)
    offload: tuple[bool, ...] = (False,)


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    """The chosen plan, the runners-up and every plan predicted."""

    budget_bytes: int
    best: Evaluated | None
    """The fastest plan that fits; None when none does."""
    evaluated: tuple[Evaluated, ...]
    """Every plan predicted, in the order predicted."""

    @property
    def closest(self) -> Evaluated:
        """The plan with the smallest predicted peak (what comes nearest when nothing fits)."""
        return min(self.evaluated, key=lambda e: (e.estimate.peak_bytes, e.estimate.seconds))

    def to_dict(self, runners_up: int = 5) -> dict[str, Any]:
        """A JSON-ready dict of the search's answer.

        The budget, how many plans were predicted, the best plan, the closest (the smallest
        peak), and ``runners_up`` plans that lost, each with why (:meth:`why_lost`).
        """
        return {
            "budget_bytes": self.budget_bytes,
            "plans_evaluated": len(self.evaluated),
            "best": None if self.best is None else self.best.to_dict(),
            "closest": self.closest.to_dict(),
            "runners_up": [
                {**entry.to_dict(), "why": why} for entry, why in self.runners_up(runners_up)
            ],
        }

    def runners_up(self, count: int = 5) -> list[tuple[Evaluated, str]]:
        """Plans that lost, each with why.

        The fastest plans that fit come first (slower than the best), then the plans faster
        than the best that came nearest to fitting; with nothing fitting, the nearest.
        """
        best = self.best
        seen = {best.plan} if best else set()
        unique: list[Evaluated] = []
        for entry in self.evaluated:
            if entry.plan not in seen:
                seen.add(entry.plan)
                unique.append(entry)
        fitting = sorted((e for e in unique if e.fits), key=lambda e: e.estimate.seconds)
        limit = best.estimate.seconds if best else float("inf")
        near = sorted(
            (e for e in unique if not e.fits and e.estimate.seconds < limit),
            key=lambda e: e.estimate.peak_bytes,
        )
        slower = fitting[: max(count - min(len(near), 2), 0)]
        chosen = [*slower, *near[: count - len(slower)]]
        return [(entry, self.why_lost(entry)) for entry in chosen]

    def why_lost(self, entry: Evaluated) -> str:
        """Why ``entry`` lost: by how much it is over the budget, or how much slower it is.

        A slower plan names the part of the step that grew most.
        """
        est = entry.estimate
        if not entry.fits:
            over = est.peak_bytes - self.budget_bytes
            what = "peak" if est.live_bytes is None else "reserved peak"
            return f"does not fit: {what} {_gib(est.peak_bytes)} is {_gib(over)} over the budget"
        best = self.best
        if best is None:  # pragma: no cover - a fitting entry implies a best
            return "fits"
        slower = est.seconds / best.estimate.seconds - 1.0
        deltas = {
            name: est.parts.get(name, 0.0) - best.estimate.parts.get(name, 0.0)
            for name in {*est.parts, *best.estimate.parts}
        }
        part = max(deltas, key=lambda n: deltas[n]) if deltas else None
        why = f" (mostly {part}: +{deltas[part] * 1e3:.1f} ms)" if part and deltas[part] > 0 else ""
        return f"fits, {slower:+.1%} step time{why}"


def search(
    shape: ModelShape,
    evaluate: Evaluate,
    *,
    budget_bytes: int,
    space: SearchSpace | None = None,
    progress: Callable[[str], None] | None = None,
) -> SearchResult:
    """The fastest plan for a model of ``shape`` whose predicted peak is within the budget.

    Args:
        shape: the model's blocks and edges (``candidates.model_shape``).
        evaluate: predicts a plan's peak and step time.
        budget_bytes: device memory a rank may use at its peak.
        space: what may be chosen; the defaults try every boundary, edges apart or not,
            prefetch 1 and 2, recomputation of none, every 4th, every 2nd and every block,
            and selective recomputation.
        progress: called with a line per structure explored (long searches say where
            they are).

    Raises:
        ValueError: a budget that is not a positive int.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"search: budget_bytes must be a positive int, got {budget_bytes!r}")
    space = space if space is not None else SearchSpace()
    memo: dict[Choice, Evaluated] = {}
    order: list[Evaluated] = []

    def predict(choice: Choice) -> Evaluated:
        hit = memo.get(choice)
        if hit is None:
            plan = sharding_plan(shape, choice)
            estimate = evaluate(plan)
            hit = Evaluated(choice, plan, estimate, estimate.peak_bytes <= budget_bytes)
            memo[choice] = hit
            order.append(hit)
        return hit

    best: Evaluated | None = None

    def consider(entry: Evaluated) -> None:
        nonlocal best
        if entry.fits and (best is None or entry.estimate.seconds < best.estimate.seconds):
            best = entry

    blocks = len(shape.blocks)

    def explore(structure: Choice) -> None:
        prefetches = space.prefetch if structure.boundary != "sub" else (1,)
        fastest = predict(replace(structure, keep_last=blocks, prefetch=max(prefetches)))
        consider(fastest)
        if fastest.fits or (best is not None and fastest.estimate.seconds >= best.estimate.seconds):
            _say(progress, f"{structure.describe()}: bounded ({len(order)} plans predicted)")
            return
        lightest = predict(replace(structure, checkpoint_every=1))
        if not lightest.fits:
            _say(progress, f"{structure.describe()}: no fit even recomputing every block")
            return

        def at_level(level: tuple[CheckpointMode, int]) -> Choice:
            return replace(structure, checkpoint_mode=level[0], checkpoint_every=level[1])

        for level in _levels_to_explore(space, lambda lv: predict(at_level(lv)).fits):
            start = at_level(level)
            if not predict(start).fits:
                continue
            bound = predict(replace(start, keep_last=blocks, prefetch=max(prefetches)))
            consider(bound)
            if best is not None and bound.estimate.seconds >= best.estimate.seconds:
                continue
            kept = _most_kept(_fits_keeping(predict, start), blocks)
            top = replace(start, keep_last=kept)
            for depth in prefetches:
                consider(predict(replace(top, prefetch=depth)))
            for n in space.reshard_slices:
                consider(predict(replace(top, reshard_slice=n)))
        _say(progress, f"{structure.describe()}: explored ({len(order)} plans predicted)")

    first_edges, *other_edges = space.edges_apart
    for structure in _structures(space, first_edges):
        explore(structure)
    # The edge modules' units change little of the step (two small groups): tried on the
    # structures of the best plan found, and on all of them when none fits yet.
    for edges in other_edges:
        for structure in _structures(space, edges):
            if best is None or _same_structure(structure, best.choice):
                explore(structure)
    return SearchResult(budget_bytes=budget_bytes, best=best, evaluated=tuple(order))


def _structures(space: SearchSpace, edges_apart: bool) -> list[Choice]:
    """Every (boundary, precision, offload) combination with these edges, the rest default."""
    return [
        Choice(boundary=b, edges_apart=edges_apart, precision=p, offload=o)
        for b, p, o in itertools.product(space.boundaries, space.precisions, space.offload)
    ]


def _same_structure(structure: Choice, choice: Choice) -> bool:
    """Whether ``choice`` has the boundary, precision and offload of ``structure``."""
    return (structure.boundary, structure.precision, structure.offload) == (
        choice.boundary,
        choice.precision,
        choice.offload,
    )


def _levels_to_explore(
    space: SearchSpace, fits: Callable[[tuple[CheckpointMode, int]], bool]
) -> list[tuple[CheckpointMode, int]]:
    """The recomputation levels worth exploring, fewest recomputed first.

    Full recomputation's levels save memory in order (every 4th block, every 2nd, every
    block): the first that fits is found by bisection, and the ones before it are skipped.
    Selective recomputation, whose memory falls anywhere among them, comes first (it keeps
    the matrix multiplies' outputs, so it costs less time than full recomputation).
    """
    full: list[tuple[CheckpointMode, int]] = [("full", n) for n in space.checkpoint_levels]
    low, high = 0, len(full) - 1  # the last (the most recomputed) fits: the caller checked
    while low < high:
        mid = (low + high) // 2
        if fits(full[mid]):
            high = mid
        else:
            low = mid + 1
    selective: list[tuple[CheckpointMode, int]] = [("selective", 1)] if space.selective else []
    return [*selective, *full[low:]]


def _fits_keeping(predict: Callable[[Choice], Evaluated], start: Choice) -> Callable[[int], bool]:
    """Whether ``start`` fits with its last k blocks kept, as a function of k."""
    return lambda k: predict(replace(start, keep_last=k)).fits


def _most_kept(fits: Callable[[int], bool], blocks: int) -> int:
    """The largest k in [0, blocks] with ``fits(k)``, given ``fits(0)``.

    Memory grows with k, so bisection finds it in log2(blocks) predictions.
    """
    low, high = 0, blocks
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _say(progress: Callable[[str], None] | None, line: str) -> None:
    logger.debug(line)
    if progress is not None:
        progress(line)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def describe_plans(entries: Sequence[Evaluated]) -> list[str]:
    """One line per plan: its choice, peak and step time."""
    return [
        f"{e.choice.describe()}: peak {_gib(e.estimate.peak_bytes)}, "
        f"{e.estimate.seconds * 1e3:.1f} ms{'' if e.fits else ' (does not fit)'}"
        for e in entries
    ]
