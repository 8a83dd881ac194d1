"""The planner's FSDP x TP predictions against CommTracker's measurements of shardkit, at W=4.

The TP test models of ``tests/tp`` get their TP plan and ``fully_shard`` per block and root,
as in the TP parity tests; the planner gets the same plan and mesh shape. Every collective of
a steady-state step must match, on every rank, in issue order: its kind, its mesh axis (the
tracker finds it from the mesh of the model's DTensor parameters), and its bytes. Both axes
are exact: the engine's all-gathers and reduce-scatters over the TP-local shards (dp, or
dp_shard and dp_replicate), and DTensor's redistributions on tp (padding of uneven shards
included: "sp" cuts 7 input and 3 output features over 2 ranks) with the all-reduces of
sequence-parallel gradients.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from harness.pool import run_on_ranks
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.planner import plan
from shardkit.tools.records import RankReport
from shardkit.tools.track.comm import CommTracker
from tests.tools.plan.plan_checks import assert_comm_matches_plan
from tests.tp import tp_models
from tests.tp.tp_parity import TPRun, build_sharded, dp_rank_and_size, global_mesh

_BATCH = 2  # rows per data-parallel rank
_SHAPES = {"mlp": ((4,), (10,)), "sp": ((tp_models.SEQ, 7), (tp_models.SEQ, 3))}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, run: TPRun, step: int) -> None:
    mesh_dp_rank, dp_size = _dp_position(run)
    x, y = tp_models.batch(run.model, step, _BATCH * dp_size)
    x, y = x.chunk(dp_size)[mesh_dp_rank], y.chunk(dp_size)[mesh_dp_rank]
    F.mse_loss(model(x).float(), y).backward()
    opt.step()
    opt.zero_grad()


def _dp_position(run: TPRun) -> tuple[int, int]:
    return dp_rank_and_size(global_mesh(run))


def _measured(rank: int, world_size: int, run: TPRun) -> dict[str, Any]:
    model = build_sharded("shardkit", run, global_mesh(run))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _step(model, opt, run, 0)  # steady state from here
    with CommTracker() as comm:  # no meshes given: found on the model's parameters
        _step(model, opt, run, 1)
    return comm.rank_report().to_dict()


def _planned(run: TPRun, rank: int) -> Plan:
    inputs, outputs = _SHAPES[run.model]
    options = PlanOptions(
        mesh_shape=(run.mesh[0], run.mesh[1]) if len(run.mesh) == 3 else None,
        tp_degree=run.mesh[-1],
        tp_plan=lambda model: tp_models.plan(run.model, model),
        inputs=lambda: torch.zeros(_BATCH, *inputs, device="meta"),
        loss=lambda out: F.mse_loss(out.float(), torch.zeros(_BATCH, *outputs, device="meta")),
        backend="gloo",
        rank=rank,
    )

    def model() -> torch.nn.Module:
        with torch.device("meta"):
            built: torch.nn.Module = tp_models.build(run.model)
        return built

    return plan(model, world_size=math.prod(run.mesh), options=options)


@pytest.mark.parametrize(
    ("model", "mesh"),
    [
        ("mlp", (2, 2)),
        ("sp", (2, 2)),  # sequence parallelism: norms, PrepareModuleInput, Shard(1) outputs
        ("sp", (2, 1, 2)),  # HSDP x TP: the replicas' all-reduce on dp_replicate
        ("sp", (1, 2, 2)),  # HSDP x TP: dp_shard
    ],
)
def test_plan_matches_trackers_on_both_axes(model: str, mesh: tuple[int, ...]) -> None:
    run = TPRun(model=model, mesh=mesh)
    reports = [RankReport.from_dict(r) for r in run_on_ranks(4, _measured, run=run)]
    for rank, report in enumerate(reports):
        assert_comm_matches_plan(report, _planned(run, rank), rank)
