"""The planner's Muon under FSDP x TP against what the comm tracker sees Muon do, at W=4.

A small network whose blocks hold a colwise / rowwise pair that TP cuts and a router matrix
that TP leaves whole, on a (dp, tp) mesh of 2 x 2, at two widths: even, and fc1's 50 rows over
2 tp ranks, each TP block of 25 cut 13 and 12 by the 2 dp ranks. shardkit's ``fully_shard`` per
block and root on dp; shardkit's Muon on the blocks' matrices with
``replicated_over=mesh["tp"]`` (the program the planner plans), AdamW on the rest. On every
rank the plan's optimizer-phase collectives (two all-to-alls over the whole mesh, sized by the
core's routes on the blocks TP and FSDP cut) are the tracked ones, to the byte, and the
matrices it says the rank orthogonalizes are the ones the step updated. Under the memory
tracker, the optimizer state is the plan's to the byte, and the step's transient (the rows, the
owned matrices whole, Newton-Schulz's temporaries, the exchanges' buffers: an approximation)
within 15% of the tracked comm and other buffers of the optimizer phase, as on FSDP.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from harness.pool import run_on_ranks
from shardkit.core import fully_shard
from shardkit.core.optim import Muon
from shardkit.tools.plan import PlanOptions, plan
from shardkit.tools.records import Category, Phase
from shardkit.tools.track.comm import CommTracker
from shardkit.tools.track.memory import MemoryTracker
from tests.tools.plan.plan_checks import optimizer_memory

_BATCH = 2  # rows per data-parallel rank
_WIDTH = 64


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, width, bias=False)
        self.router = nn.Linear(width, width, bias=False)  # no TP style: whole on tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = h + self.fc2(F.gelu(self.fc1(h))) + self.router(h)
        return out


class _Net(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.inp = nn.Linear(6, _WIDTH)
        self.blocks = nn.ModuleList(_Block(_WIDTH, hidden) for _ in range(3))
        self.head = nn.Linear(_WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def _tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    styles: dict[str, ParallelStyle] = {}
    for i in range(len(model.blocks)):  # type: ignore[arg-type]
        styles[f"blocks.{i}.fc1"] = ColwiseParallel()
        styles[f"blocks.{i}.fc2"] = RowwiseParallel()
    return styles


def _step(model: nn.Module, optimizers: list[Any], step: int, dp: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(2 * _BATCH, 6, generator=gen), torch.randn(2 * _BATCH, 4, generator=gen)
    F.mse_loss(model(x.chunk(2)[dp]), y.chunk(2)[dp]).backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def _measured(rank: int, world_size: int, *, hidden: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = _Net(hidden)
    parallelize_module(model, mesh["tp"], _tp_plan(model))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    named = list(model.named_parameters())
    matrices = [(n, p) for n, p in named if p.dim() == 2 and n.startswith("blocks.")]
    others = [p for n, p in named if not (p.dim() == 2 and n.startswith("blocks."))]
    muon = Muon(matrices, lr=0.02, replicated_over=mesh["tp"])
    optimizers = [muon, torch.optim.AdamW(others, lr=1e-3)]
    dp = mesh["dp"].get_local_rank()
    _step(model, optimizers, 0, dp)  # steady state from here (and replicated_over checked)
    with CommTracker() as comm:
        _step(model, optimizers, 1, dp)
    # gloo's worker thread lets go of a finished collective's buffers a moment after wait()
    # returns, so a step's peak may catch one still counted: the least of three steps' peaks
    # is the step's own.
    tracked = []
    for step in (2, 3, 4):
        with MemoryTracker(model, optimizers=optimizers) as tracker:
            _step(model, optimizers, step, dp)
        tracked.append(optimizer_memory(list(tracker.report().timeline)))
    state = max(s for s, _ in tracked)
    transient = min(t for _, t in tracked)
    calls = [
        (c.kind, c.input_bytes, c.sent_bytes)
        for c in comm.rank_report().collectives
        if c.phase is Phase.OPTIMIZER
    ]
    stats = muon.last_step_stats
    assert stats is not None
    return {
        "calls": calls,
        "updates": stats.updates,
        "cost": stats.cost,
        "state": state,
        "transient": transient,
    }


def _planned(rank: int, hidden: int) -> tuple[list[tuple[str, int, int]], int, int, int, int]:
    options = PlanOptions(
        optimizer="muon",
        tp_degree=2,
        tp_plan=_tp_plan,
        inputs=lambda: torch.zeros(_BATCH, 6, device="meta"),
        loss=lambda out: F.mse_loss(out, torch.zeros(_BATCH, 4, device="meta")),
        backend="gloo",
        rank=rank,
    )
    planned = plan(lambda: _Net(hidden), world_size=4, options=options)
    calls = [
        (c.kind, c.input_bytes, c.sent_bytes)
        for c in planned.schedule
        if c.phase is Phase.OPTIMIZER
    ]
    assert planned.muon is not None
    owned = planned.muon.owned
    cost = sum(m * n * min(m, n) for m, n in owned)
    memory = planned.memory
    state = memory.category_max[Category.OPTIMIZER_STATE]
    step = max(p.by_category[Category.OTHER] for p in memory.timeline if p.phase is Phase.OPTIMIZER)
    return calls, len(owned), cost, state, step


@pytest.mark.parametrize("hidden", [128, 50])
def test_the_plan_under_tp_is_muons_exchange_and_share(hidden: int) -> None:
    measured = run_on_ranks(4, _measured, hidden=hidden)
    assert sum(m["updates"] for m in measured) == 9  # 3 blocks x 3 matrices, each once
    for rank, got in enumerate(measured):
        calls, updates, cost, state, step = _planned(rank, hidden)
        assert [k for k, _, _ in calls] == ["all_to_all"] * 2, calls
        assert calls == got["calls"], (rank, calls, got["calls"])
        assert (updates, cost) == (got["updates"], got["cost"]), rank
        print(f"rank {rank}: state {state} / {got['state']}, step {step} / {got['transient']}")
        assert state == got["state"], rank  # Muon's one buffer a matrix, AdamW's two
        assert abs(step - got["transient"]) <= 0.15 * got["transient"], rank
