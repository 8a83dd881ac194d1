"""The search's logic against brute force, on a synthetic model of memory and time.

The synthetic model has the properties the search relies on (memory grows, time falls, with
each block kept and each block not recomputed; prefetching deeper costs memory and saves
time), with a different cost per structure, so the search must find exactly the plan a
brute-force sweep of the same space finds, for every budget, and say when nothing fits.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from shardkit.tools.plan.gpt import GPT, GPTConfig
from shardkit.tools.plan.search.budget import parse_budget
from shardkit.tools.plan.search.candidates import Choice, model_shape, sharding_plan
from shardkit.tools.plan.search.search import Estimate, SearchSpace, search
from shardkit.tools.plan.sharding_plan import ShardingPlan

_MIB = 2**20


def _model() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=64, dim=32, n_layers=8, n_heads=2, max_seq_len=16))


def _synthetic(plan: ShardingPlan) -> Estimate:
    units = len(plan.units)
    kept = sum(1 for u in plan.units if u.reshard_after_forward is False)
    # Blocks recomputed (per sub-module units, a block recomputes through its children).
    full = len({".".join(m.split(".")[:2]) for m, mode in plan.checkpoint if mode == "full"})
    selective = len(
        {".".join(m.split(".")[:2]) for m, mode in plan.checkpoint if mode == "selective"}
    )
    unsharded = 40 * _MIB * 16 // units  # a larger unit gathers more at once
    peak = (
        200 * _MIB
        + unsharded * (1 + plan.prefetch)
        + 10 * _MIB * kept
        + 30 * _MIB * (8 - full - selective)
        + 12 * _MIB * selective
    )
    seconds = (
        1.0
        + 0.004 * units  # per-collective latency
        + 0.02 * (units - kept)  # backward re-gathers
        + 0.05 * full
        + 0.015 * selective
        - 0.01 * (plan.prefetch - 1)
    )
    return Estimate(peak_bytes=peak, seconds=seconds)


def _brute_force(space: SearchSpace, budget: int) -> tuple[float, int] | None:
    shape = model_shape(_model())
    levels = [("full", n) for n in space.checkpoint_levels] + [("selective", 1)]
    best: tuple[float, int] | None = None
    for b, e, p, (mode, every), keep in itertools.product(
        space.boundaries, space.edges_apart, space.prefetch, levels, range(9)
    ):
        if b == "sub" and p > 1:
            continue  # sub-module units are not in forward order: no explicit prefetch
        choice = Choice(
            boundary=b,
            edges_apart=e,
            prefetch=p,
            checkpoint_every=every,
            checkpoint_mode=mode,  # type: ignore[arg-type]
            keep_last=keep,
        )
        est = _synthetic(sharding_plan(shape, choice))
        if est.peak_bytes <= budget and (best is None or est.seconds < best[0]):
            best = (est.seconds, est.peak_bytes)
    return best


@pytest.mark.parametrize("budget_mib", [300, 420, 520, 640, 800, 1100, 2000])
def test_the_search_finds_the_brute_force_best(budget_mib: int) -> None:
    space = SearchSpace()
    budget = budget_mib * _MIB
    result = search(model_shape(_model()), _synthetic, budget_bytes=budget, space=space)
    expected = _brute_force(space, budget)
    if expected is None:
        assert result.best is None
        closest = result.closest
        assert not closest.fits and closest.estimate.peak_bytes > budget
        return
    assert result.best is not None
    assert result.best.estimate.seconds == pytest.approx(expected[0])
    assert result.best.estimate.peak_bytes <= budget
    # Fewer predictions than the sweep: the bounds and bisection prune.
    assert len(result.evaluated) < 3 * 2 * 2 * 5 * 9


def test_nothing_fits_says_which_plan_came_closest() -> None:
    result = search(model_shape(_model()), _synthetic, budget_bytes=100 * _MIB)
    assert result.best is None
    closest = result.closest
    assert closest.estimate.peak_bytes == min(e.estimate.peak_bytes for e in result.evaluated)
    reasons = [why for _, why in result.runners_up()]
    assert reasons and all(why.startswith("does not fit") for why in reasons)


def test_runners_up_say_why_they_lost() -> None:
    result = search(model_shape(_model()), _synthetic, budget_bytes=640 * _MIB)
    assert result.best is not None
    reasons = [why for _, why in result.runners_up(count=50)]
    assert any(why.startswith("fits, +") for why in reasons)
    assert any(why.startswith("does not fit") for why in reasons)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_a_bad_budget_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        search(model_shape(_model()), _synthetic, budget_bytes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("80 GiB", 80 * 2**30),
        ("75GB", 75 * 10**9),
        ("141e9", 141 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5g", 3 * 2**29),
        ("4096", 4096),
    ],
)
def test_budgets_parse_as_written(text: str, expected: int) -> None:
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "80 parsecs", "-1GiB", "0", "nan", "1e400GB"])
def test_bad_budgets_are_refused_naming_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="budget"):
        parse_budget(text)
