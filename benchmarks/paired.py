"""Paired training-step rounds on the worker pool: an implementation and its peer, side by side.

Both are built in the same workers (so start-up is never timed). Every round runs one step of
each, alternating which goes first, and a step's time is that of its slowest rank; the ratio
is the median of the per-round ratios, so drift in the machine's load hits both sides alike.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks import gpt
from harness.pool import run_on_ranks

# Building two 134M-parameter models and their warm-up steps take minutes at W=4 on two cores,
# beyond the harness's default (meant for tests).
_TIMEOUT_S = 900.0

_STATE: dict[str, Any] = {}

# An implementation named with this suffix is shardkit's model run with desync checks on
# (``set_debug``) for its steps only: the same engine paired with itself, checks on and off.
DEBUG_SUFFIX = "-debug"
# The same with the lifetime checks (``SHARDKIT_DEBUG_LIFETIMES``) on for its steps only.
LIFETIMES_SUFFIX = "-lifetimes"
# The same with the step check (on by default) off for its steps only (``set_step_checks``).
NO_STEP_CHECK_SUFFIX = "-nocheck"
_SUFFIXES = (DEBUG_SUFFIX, LIFETIMES_SUFFIX, NO_STEP_CHECK_SUFFIX)


def _setup(
    rank: int, world_size: int, impls: tuple[str, ...], size: str, options: gpt.Options
) -> None:
    _STATE.clear()
    _STATE["size"] = size
    for impl in impls:
        engine = impl
        for suffix in _SUFFIXES:
            engine = engine.removesuffix(suffix)
        _STATE[impl] = gpt.build(engine, size, world_size, options)
        for step in range(2):  # warm-up: lazy init, allocator, the optimizer's first state
            _step(rank, world_size, impl, step)


def _step(rank: int, world_size: int, impl: str, step: int) -> dict[str, float]:
    data = gpt.batch(_STATE["size"], step, rank, world_size)
    model, opt = _STATE[impl]
    if impl.endswith(LIFETIMES_SUFFIX):
        from shardkit.core.runtime.watch.progress import SETTINGS

        SETTINGS.lifetime_checks = True
        try:
            return gpt.train_step(model, opt, data)
        finally:
            SETTINGS.lifetime_checks = False
    if impl.endswith(NO_STEP_CHECK_SUFFIX):
        from shardkit.core import set_step_checks

        set_step_checks(False)
        try:
            return gpt.train_step(model, opt, data)
        finally:
            set_step_checks(True)
    if not impl.endswith(DEBUG_SUFFIX):
        return gpt.train_step(model, opt, data)
    from shardkit.core import set_debug

    set_debug(True)
    try:
        return gpt.train_step(model, opt, data)
    finally:
        set_debug(False)


def _teardown(rank: int, world_size: int) -> None:
    _STATE.clear()
    gc.collect()
    # The pool's workers outlive the measurement: hand the freed heap back to the system, or
    # the 134M cells of every world size add up past this machine's memory.
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Paired:
    """What paired rounds measured."""

    step_s: float
    """Median over rounds of the slowest rank's step time."""
    wire_bytes: float
    """Median bytes rank 0 wrote to its sockets in a step."""
    ratio: float | None
    """Median of per-round step-time ratios to the peer (None when measured alone)."""
    peer_step_s: float | None
    """The peer's median step time in the same rounds."""


def _median_step(rounds: list[list[dict[str, float]]]) -> list[float]:
    return [max(r["seconds"] for r in ranks) for ranks in rounds]


def measure(
    run_rounds: Callable[[Callable[[], None], int], None],
    *,
    world: int,
    size: str,
    impl: str,
    peer: str | None,
    rounds: int,
    options: gpt.Options | None = None,
) -> Paired:
    """Build ``impl`` (and ``peer``) on ``world`` ranks, run ``rounds`` paired steps through
    ``run_rounds(one_round, rounds)`` (pytest-benchmark's pedantic, or a plain loop), and
    tear both down."""
    impls = (impl,) if peer is None or peer == impl else (impl, peer)
    setup = {"impls": impls, "size": size, "options": options or gpt.Options()}
    run_on_ranks(world, _setup, timeout_s=_TIMEOUT_S, **setup)
    records: list[list[dict[str, float]]] = []
    peer_records: list[list[dict[str, float]]] = []
    counter = [10]

    def step(which: str | None) -> list[dict[str, float]]:
        return run_on_ranks(world, _step, timeout_s=_TIMEOUT_S, impl=which, step=counter[0])

    def one_round() -> None:
        counter[0] += 1
        peer_first = len(impls) == 2 and counter[0] % 2 == 0
        if peer_first:
            peer_records.append(step(peer))
        records.append(step(impl))
        if len(impls) == 2 and not peer_first:
            peer_records.append(step(peer))

    run_rounds(one_round, rounds)
    run_on_ranks(world, _teardown)
    times = _median_step(records)
    wire = statistics.median(ranks[0]["wire_bytes"] for ranks in records)
    step_s = statistics.median(times)
    if not peer_records:
        return Paired(step_s=step_s, wire_bytes=wire, ratio=None, peer_step_s=None)
    peer_times = _median_step(peer_records)
    ratio = statistics.median(t / p for t, p in zip(times, peer_times, strict=True))
    return Paired(
        step_s=step_s, wire_bytes=wire, ratio=ratio, peer_step_s=statistics.median(peer_times)
    )
