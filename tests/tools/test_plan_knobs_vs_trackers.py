"""The planner's predictions of a ShardingPlan's knobs against the trackers, at W=2 on gloo.

Each test applies a plan to the tiny GPT on real ranks the way a script would (``fully_shard``
per unit, innermost first, ``fully_shard([...])`` for a unit of several modules, the prefetch
setters), trains two steps and measures the second; the plan of the same ``ShardingPlan``
(``options_for``) must match it: every collective with its bytes, every memory category the
engine owns to the byte, and the peak within 3%. Measured peak / predicted peak, per variant
(ranks 0 and 1): see ``_PEAK_RATIOS``, printed by ``-s``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from shardkit.tools import Category, Profiler, RankReport
from shardkit.tools.plan.options import PlanOptions, options_for
from shardkit.tools.plan.planner import Plan, plan
from shardkit.tools.plan.sharding_plan import ROOT, ShardingPlan, Unit
from tests.core import models
from tests.tools import workloads
from tests.tools.plan_checks import assert_comm_matches_plan

_ROWS, _SEQ, _VOCAB = 2, 8, 37  # per rank: the tiny GPT of tests.core.models
_W = 2


def _apply(model: torch.nn.Module, sharding: ShardingPlan, world_size: int) -> None:
    """What a training script does with a ShardingPlan (a local stand-in for apply_plan)."""
    import shardkit.core as core

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    named = dict(model.named_modules())  # names as the plan gives them, before any call
    mp = core.MixedPrecisionPolicy(
        param_dtype=sharding.param_dtype, reduce_dtype=sharding.reduce_dtype
    )
    handles: list[Any] = []
    for unit in sharding.units:
        modules = [named[fqn] for fqn in unit.modules]
        target: Any = modules if len(modules) > 1 else modules[0]
        core.fully_shard(
            target, mesh=mesh, reshard_after_forward=unit.reshard_after_forward, mp_policy=mp
        )
        handles.append(modules[0])
    lists = sharding.prefetch_lists()
    for handle, (forward, backward) in zip(handles, lists or (), strict=False):
        handle.set_modules_to_forward_prefetch([handles[i] for i in forward])
        handle.set_modules_to_backward_prefetch([handles[i] for i in backward])


def _measured(rank: int, world_size: int, sharding: ShardingPlan) -> dict[str, Any]:
    model = models.build("gpt")
    _apply(model, sharding, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    workloads.train_step(model, opt, 0, rank, world_size, "gpt")  # steady state from here
    with Profiler(model, optimizers=[opt]) as profiler:
        workloads.train_step(model, opt, 1, rank, world_size, "gpt")
    return profiler.rank_report().to_dict()


def _meta_model() -> torch.nn.Module:
    with torch.device("meta"):
        model: torch.nn.Module = models.build("gpt")
    return model


def _inputs() -> torch.Tensor:
    return torch.zeros(_ROWS, _SEQ, dtype=torch.long, device="meta")


def _loss(out: torch.Tensor) -> torch.Tensor:
    targets = torch.zeros(_ROWS * _SEQ, dtype=torch.long, device="meta")
    return F.cross_entropy(out.float().reshape(-1, _VOCAB), targets)


def _planned(sharding: ShardingPlan, rank: int) -> Plan:
    base = PlanOptions(inputs=_inputs, loss=_loss, backend="gloo", rank=rank)
    return plan(_meta_model, world_size=_W, options=options_for(sharding, base))


def _units(*modules: str | tuple[str, ...], root: bool | int = True) -> tuple[Unit, ...]:
    units = [Unit(modules=m if isinstance(m, tuple) else (m,)) for m in modules]
    return (*units, Unit(modules=(ROOT,), reshard_after_forward=root))


_BLOCKS = ("blocks.0", "blocks.1")
_SUBMODULES = (
    tuple(f"blocks.{i}.{part}" for i in range(2) for part in ("attn", "mlp")) + _BLOCKS
)  # attention and MLP units inside each block, the block a unit for its norms
_EDGES = ("tok", "pos", *_BLOCKS, "head")  # embeddings and head units of their own

_PLANS: dict[str, ShardingPlan] = {
    "pairs": ShardingPlan(units=_units(_BLOCKS)),
    "submodules": ShardingPlan(units=_units(*_SUBMODULES)),
    "edges": ShardingPlan(units=_units(*_EDGES, root=False)),
    "per_unit_reshard": ShardingPlan(
        units=(
            Unit(modules=("blocks.0",), reshard_after_forward=False),
            Unit(modules=("blocks.1",)),
            Unit(modules=(ROOT,), reshard_after_forward=False),
        )
    ),
    # At W=2 an int is 1 (the engine: False) or 2 (the engine: True).
    "int_reshard": ShardingPlan(
        units=(
            Unit(modules=("blocks.0",), reshard_after_forward=2),
            Unit(modules=("blocks.1",), reshard_after_forward=1),
            Unit(modules=(ROOT,), reshard_after_forward=2),
        )
    ),
    "prefetch_2": ShardingPlan(units=_units(*_EDGES), prefetch=2),
    "bf16_submodules": ShardingPlan(units=_units(*_SUBMODULES), param_dtype=torch.bfloat16),
}

# Measured peak over predicted peak, ranks 0 and 1 (tiny GPT, W=2, gloo).
_PEAK_RATIOS: dict[str, tuple[float, float]] = {}


@pytest.mark.parametrize("name", list(_PLANS))
def test_plan_knob_matches_trackers(name: str) -> None:
    sharding = _PLANS[name]
    measured = run_on_ranks(_W, _measured, sharding=sharding)
    ratios = []
    for rank, raw in enumerate(measured):
        report, predicted = RankReport.from_dict(raw), _planned(sharding, rank)
        assert_comm_matches_plan(report, predicted, rank)
        _assert_engine_memory_matches(report, predicted, rank)
        assert report.memory is not None
        ratios.append(report.memory.peak.total / predicted.memory.peak.total)
        assert report.memory.peak.total == pytest.approx(predicted.memory.peak.total, rel=0.03)
    print(f"{name}: measured/predicted peak {[round(r, 4) for r in ratios]}")


def _assert_engine_memory_matches(report: RankReport, predicted: Plan, rank: int) -> None:
    # Every category the engine owns exactly; activations within 10% (as test_plan_vs_trackers).
    memory = report.memory
    assert memory is not None
    measured_max = {c: max(s.by_category[c] for s in memory.timeline) for c in Category}
    exact = (
        Category.SHARDED_PARAMS,
        Category.UNSHARDED_PARAMS,
        Category.GRADIENTS,
        Category.OPTIMIZER_STATE,
        Category.COMM_BUFFERS,
    )
    for category in exact:
        planned = predicted.memory.category_max[category]
        assert measured_max[category] == planned, f"rank {rank}: {category}"
    assert measured_max[Category.ACTIVATIONS] == pytest.approx(
        predicted.memory.category_max[Category.ACTIVATIONS], rel=0.10
    )
