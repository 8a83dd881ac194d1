"""Where a Muon step's time goes beyond Newton-Schulz: a phase-by-phase profile (issue 83).

Benchmark code only. Each worker builds ``muon_run``'s "muon" configuration (the benchmark
GPT, shardkit's Muon on the blocks' matrices, AdamW on the rest) and times every phase of the
optimizer step on this rank, by wrapping the step's functions in this process:

- ``prepare``: the elementwise momentum and the bf16 cast, on this rank's rows;
- ``pack``: both directions' packing (and the owner's own blocks copied into its matrices);
- ``wait out`` / ``wait back``: waiting for the rounds' exchanges, with unpacking: the
  transfer, and whatever the slowest rank (an owner still orthogonalizing) keeps the others
  waiting;
- ``newton-schulz``: the owned matrices' updates;
- ``apply``: every rank's rows stepped; ``adamw``: the other optimizer's step;
- ``forward+backward``: the rest of the training step.

The steps alternate between 1, 2 and 4 rounds (``exchange_rounds``), so that the overlap's
effect is measured in the same run, on the same load. Run::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.muon_profile [small|medium] [world] [scale]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import muon_run

PHASES = ("forward+backward", "prepare", "pack", "wait out", "newton-schulz", "wait back",
          "apply", "adamw", "muon", "step")  # fmt: skip
ROUND_CHOICES = (1, 2, 4)


class _Clock:
    """Seconds per phase in one step on this rank."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def wrap(self, name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name if isinstance(name, str) else name(*args)):
                return fn(*args, **kwargs)

        return timed


def _instrument(clock: _Clock, rounds: int) -> Callable[[], None]:
    """Wrap the step's functions with ``clock``'s phases, ``rounds`` rounds; returns the undo."""
    from shardkit.core.optim import exchange, whole_matrix

    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, new: Any) -> None:
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    opt_cls = whole_matrix.WholeMatrixOptimizer
    patch(opt_cls, "exchange_rounds", rounds)
    patch(opt_cls, "_prepared", clock.wrap("prepare", opt_cls._prepared))
    patch(opt_cls, "_update_owned", clock.wrap("newton-schulz", opt_cls._update_owned))
    patch(opt_cls, "_apply", clock.wrap("apply", opt_cls._apply))
    patch(whole_matrix, "start_gather", clock.wrap("pack", exchange.start_gather))

    def which(arrival: Any) -> str:  # a gather's route owns what it carries; a return's kept too
        return "wait back" if arrival in returns else "wait out"

    returns: list[Any] = []
    start_scatter = clock.wrap("pack", exchange.start_scatter)

    def noted(*args: Any, **kwargs: Any) -> Any:
        arrival = start_scatter(*args, **kwargs)
        returns.append(arrival)
        return arrival

    patch(whole_matrix, "start_scatter", noted)
    patch(exchange.Arrival, "wait", clock.wrap(which, exchange.Arrival.wait))

    def undo() -> None:
        for owner, attr, old in reversed(saved):
            setattr(owner, attr, old)

    return undo


def profile(rank: int, world_size: int, size: str, scale: int, steps: int) -> dict[str, float]:
    """Median seconds of each phase over ``steps`` Muon steps per round count, on this rank."""
    muon_run.setup(rank, world_size, size, scale, ("muon",))
    model, opts = muon_run._STATE["muon"]
    muon, adamw = opts
    per_step: defaultdict[str, list[float]] = defaultdict(list)
    for step in range(steps * len(ROUND_CHOICES)):
        rounds = ROUND_CHOICES[step % len(ROUND_CHOICES)]
        clock = _Clock()
        undo = _instrument(clock, rounds)
        try:
            data = muon_run._batch(rank, world_size, 100 + step)
            dist.barrier()
            started = time.perf_counter()
            for opt in opts:
                opt.zero_grad()
            with clock.phase("forward+backward"):
                out = model(data[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    out.float().reshape(-1, out.size(-1)), data[:, 1:].reshape(-1)
                )
                loss.backward()
            with clock.phase("muon"):
                muon.step()
            with clock.phase("adamw"):
                adamw.step()
            clock.seconds["step"] = time.perf_counter() - started
        finally:
            undo()
        for name, value in clock.seconds.items():
            per_step[f"{name} r{rounds}"].append(value)
    muon_run.teardown(rank, world_size)
    return {name: statistics.median(values) for name, values in per_step.items()}


def rounds_ab(rank: int, world_size: int, size: str, steps: int) -> dict[int, float]:
    """Median seconds of Muon's step alone (the same gradients each time, after a barrier),
    interleaving 1, 2 and 4 rounds ``steps`` times each: the overlap's A/B on one load."""
    muon_run.setup(rank, world_size, size, 1, ("muon",))
    model, (muon, _) = muon_run._STATE["muon"]
    data = muon_run._batch(rank, world_size, 100)
    out = model(data[:, :-1])
    torch.nn.functional.cross_entropy(
        out.float().reshape(-1, out.size(-1)), data[:, 1:].reshape(-1)
    ).backward()
    times: defaultdict[int, list[float]] = defaultdict(list)
    for step in range(steps * len(ROUND_CHOICES)):
        rounds = ROUND_CHOICES[(step + step // len(ROUND_CHOICES)) % len(ROUND_CHOICES)]
        muon.exchange_rounds = rounds
        dist.barrier()
        started = time.perf_counter()
        muon.step()
        elapsed = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's, as a step's
        times[rounds].append(float(elapsed))
    muon_run.teardown(rank, world_size)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    from benchmarks import muon_profile  # by its name: workers cannot import __main__
    from harness.pool import run_on_ranks

    size = sys.argv[1] if len(sys.argv) > 1 else "small"
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    scale = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    if scale == 0:  # the rounds' A/B on Muon's step alone
        ab = run_on_ranks(world, muon_profile.rounds_ab, timeout_s=1800, size=size, steps=steps)
        print(f"{size} W={world}: Muon's step alone, median ms by rounds: ", end="")
        print(", ".join(f"{k}: {v * 1e3:.1f}" for k, v in sorted(ab[0].items())))
        return
    results = run_on_ranks(
        world, muon_profile.profile, timeout_s=1800, size=size, scale=scale, steps=steps
    )
    print(f"{size} W={world} x{scale}: median ms per phase; rank by rank, for 1, 2, 4 rounds")
    for name in PHASES:
        cells = "  |".join(
            " ".join(f"{r.get(f'{name} r{k}', 0.0) * 1e3:7.1f}" for r in results)
            for k in ROUND_CHOICES
        )
        print(f"{name:>17} {cells}")


if __name__ == "__main__":
    main()
