"""The cost of what keeps programs that are not SPMD correct, beside the SPMD program, at W=2.

- The step check (on by default): shardkit's model with the check paired with itself without
  it (``benchmarks/paired.py``: alternating rounds, the median of per-round ratios), on
  ``linear8`` (8 x Linear(128, 128), each its own group: little compute per collective) and
  the 8M GPT (``small``). The check adds one exchange of a few dozen bytes per step.

Nothing is asserted on time: the machine is noisy. See docs/guide/not-spmd.md for the figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks import paired

WORLD = 2
SCENARIOS = {"linear8-w2": ("linear8", 150), "gpt8m-w2": ("small", 16)}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_step_check_cost(benchmark: Any, scenario: str) -> None:
    size, rounds = SCENARIOS[scenario]

    def run_rounds(one_round: Callable[[], None], count: int) -> None:
        benchmark.pedantic(one_round, rounds=count, iterations=1, warmup_rounds=1)

    m = paired.measure(
        run_rounds,
        world=WORLD,
        size=size,
        impl="shardkit",
        peer="shardkit" + paired.NO_STEP_CHECK_SUFFIX,
        rounds=rounds,
    )
    assert m.ratio is not None and m.peer_step_s is not None
    benchmark.extra_info.update(
        {
            "scenario": scenario,
            "method": "paired",
            "median_step_s_checked": m.step_s,
            "median_step_s_unchecked": m.peer_step_s,
            "ratio_checked_vs_unchecked": m.ratio,
        }
    )
    print(
        f"\nstep check, {scenario}: {1e3 * m.step_s:.2f} ms vs {1e3 * m.peer_step_s:.2f} ms "
        f"a step, {m.ratio:.3f}"
    )


# --- a marked module that one rank skips, beside the SPMD program and the dummy forward -------

DIM, BLOCKS, ROUNDS = 256, 4, 40
VARIANTS = ("spmd", "marked", "dummy")
"""``spmd``: every rank runs the tower (an SPMD program, unmarked); ``marked``: rank 1 skips
it, marked with set_conditional(True); ``dummy``: rank 1 runs it on zeros and multiplies its
output by zero, the workaround users ship, unmarked."""

_MODELS: dict[str, Any] = {}


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(BLOCKS)
        )
        self.tower = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))

    def forward(self, x: torch.Tensor, tower: str) -> torch.Tensor:
        """``tower``: "run", "skip", or "dummy" (on zeros, its output times zero)."""
        for block in self.blocks:
            x = block(x)
        if tower == "run":
            x = x + self.tower(x)
        elif tower == "dummy":
            x = x + 0 * self.tower(torch.zeros_like(x))
        return x


def _tower_model(variant: str, world_size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core import fully_shard

    torch.manual_seed(0)
    model = _Tower()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.tower, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if variant == "marked":
        tower: Any = model.tower  # an FSDPModule now
        tower.set_conditional(True)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _tower_setup(rank: int, world_size: int) -> None:
    _MODELS.clear()
    for variant in VARIANTS:
        _MODELS[variant] = _tower_model(variant, world_size)
        for _ in range(2):
            _tower_step(rank, world_size, variant)


def _tower_step(
    rank: int, world_size: int, variant: str, count_ops: bool = False
) -> dict[str, float]:
    import time

    from shardkit.core import observe
    from shardkit.tools import OpCounter

    if count_ops:  # one step apart, not timed: the operators it dispatches (launches on a GPU)
        with OpCounter() as ops:
            _tower_step(rank, world_size, variant)
        return {"launches": float(ops.launches)}
    model, opt = _MODELS[variant]
    issued = [0]

    def count(event: object) -> None:
        issued[0] += isinstance(event, observe.CollectiveIssuedEvent)

    unsubscribe = observe.subscribe(count)
    start = time.perf_counter()
    tower = "run" if variant == "spmd" or rank == 0 else variant.replace("marked", "skip")
    model(torch.randn(16, DIM), tower).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    seconds = time.perf_counter() - start
    unsubscribe()
    return {"seconds": seconds, "collectives": float(issued[0])}


def _tower_teardown(rank: int, world_size: int) -> None:
    _MODELS.clear()


def test_marked_module_cost(benchmark: Any) -> None:
    import statistics

    from harness.pool import run_on_ranks

    run_on_ranks(WORLD, _tower_setup)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    collectives: dict[str, float] = {}
    turn = [0]

    def one_round() -> None:
        turn[0] += 1
        order = VARIANTS[turn[0] % 3 :] + VARIANTS[: turn[0] % 3]  # each goes first in turn
        for variant in order:
            ranks = run_on_ranks(WORLD, _tower_step, variant=variant)
            times[variant].append(max(r["seconds"] for r in ranks))
            collectives[variant] = max(r["collectives"] for r in ranks)

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    launches = {
        v: [r["launches"] for r in run_on_ranks(WORLD, _tower_step, variant=v, count_ops=True)]
        for v in VARIANTS
    }
    run_on_ranks(WORLD, _tower_teardown)
    spmd = times["spmd"]
    ratios = {
        v: statistics.median(t / s for t, s in zip(times[v], spmd, strict=True)) for v in VARIANTS
    }
    benchmark.extra_info.update(
        {
            "median_step_s": {v: statistics.median(times[v]) for v in VARIANTS},
            "ratio_vs_spmd": ratios,
            "collectives_per_step": collectives,
            "launches_per_step_by_rank": launches,
        }
    )
    for v in VARIANTS:
        print(
            f"\n{v}: {1e3 * statistics.median(times[v]):.2f} ms a step, {ratios[v]:.3f} of the "
            f"SPMD program's, {collectives[v]:.0f} collectives, operators per rank "
            f"{[int(n) for n in launches[v]]}"
        )
