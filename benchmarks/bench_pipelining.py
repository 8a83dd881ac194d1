"""Pipelined training steps: torch's pipeline schedules over shardkit's stages and torch's.

``torch.distributed.pipelining`` at pp=2 on two gloo ranks (each rank one pipeline rank, a
data-parallel mesh of one), each stage a stack of MLP blocks, every block and the stage
sharded with ``fully_shard``: torch's and shardkit's stages are built in the same workers from
the same weights, and every round runs one step of each (a schedule's ``step`` over 4
microbatches, then the optimizer), alternating which goes first. A step's time is that of the
slower rank; the figure is the median of the rounds' ratios (shardkit over torch).
tests/core/interop/test_pipelining.py checks that both give the same bits; this measures time.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest benchmarks/bench_pipelining.py -q -s``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest

from harness.pipelines import MULTI_STAGE, SCHEDULES, stage_indices
from harness.pool import run_on_ranks

PP = 2
MICROBATCHES = 4
HIDDEN = 1024
BLOCKS = 4  # per stage
BATCH = 256  # rows per step: 4 microbatches of 64
ROUNDS = 12
_STATE: dict[str, Any] = {}


def _build(engine: str, kind: str, mesh: Any) -> tuple[Any, Any]:
    """This rank's schedule and optimizer, its stages sharded by ``engine``."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.pipelining import PipelineStage, schedules

    import shardkit.core as sk

    fully_shard: Any = sk.fully_shard if engine == "shardkit" else torch_fully_shard
    indices = stage_indices(kind, mesh.get_local_rank("pp"), PP)
    n_stages = PP * len(indices)
    modules = []
    for index in indices:
        torch.manual_seed(100 + index)
        stage = nn.Sequential(
            *[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(BLOCKS)]
        )
        for block in stage:
            # zero-bubble needs the gathered weights kept (tests/core/interop/test_pipelining.py)
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=kind not in MULTI_STAGE)
        fully_shard(stage, mesh=mesh["dp"])
        modules.append(stage)
    stages = [
        PipelineStage(m, i, n_stages, torch.device("cpu"), group=mesh.get_group("pp"))
        for m, i in zip(modules, indices, strict=True)
    ]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    schedule_cls = getattr(schedules, SCHEDULES[kind])
    first = stages if kind in MULTI_STAGE else stages[0]
    schedule = schedule_cls(first, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    return (schedule, indices, n_stages), torch.optim.SGD(params, lr=0.01)


def _setup(rank: int, world_size: int, kind: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, world_size // PP), mesh_dim_names=("pp", "dp"))
    _STATE.clear()
    for engine in ("torch", "shardkit"):
        _STATE[engine] = _build(engine, kind, mesh)
        for step in range(2):  # warm-up: lazy init, the optimizer's buffers
            _step(rank, world_size, engine, step)


def _step(rank: int, world_size: int, engine: str, step: int) -> float:
    import torch
    import torch.distributed as dist

    (schedule, indices, n_stages), optimizer = _STATE[engine]
    data = torch.Generator().manual_seed(step)
    x, target = torch.randn(2, BATCH, HIDDEN, generator=data).unbind(0)
    dist.barrier()
    started = time.perf_counter()
    args = (x,) if 0 in indices else ()
    kwargs = {"target": target} if n_stages - 1 in indices else {}
    schedule.step(*args, **kwargs)
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - started


def _teardown(rank: int, world_size: int) -> None:
    _STATE.clear()


@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_pipelined_step_time(benchmark: Any, kind: str) -> None:
    from torch.distributed.pipelining import schedules

    if not hasattr(schedules, SCHEDULES[kind]):
        pytest.skip(f"this torch has no {SCHEDULES[kind]}")
    run_on_ranks(2, _setup, kind=kind, timeout_s=600)
    rounds: list[dict[str, float]] = []
    order = ["torch", "shardkit"]

    def one_round() -> None:
        order.reverse()
        measured = {}
        for engine in order:
            times = run_on_ranks(2, _step, engine=engine, step=len(rounds) + 2, timeout_s=600)
            measured[engine] = max(times)
        rounds.append(measured)

    try:
        benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    finally:
        run_on_ranks(2, _teardown)
    rounds = rounds[1:]  # not the warm-up
    ratios = [r["shardkit"] / r["torch"] for r in rounds]
    benchmark.extra_info.update(
        subject="shardkit",
        peer="torch fully_shard",
        schedule=kind,
        shardkit_over_torch=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        torch_step_s=statistics.median(r["torch"] for r in rounds),
        shardkit_step_s=statistics.median(r["shardkit"] for r in rounds),
    )
    print(f"\n{kind}, pp=2 at W=2, {MICROBATCHES} microbatches:")
    print("  " + " ".join(f"{k}={v}" for k, v in benchmark.extra_info.items()))
