"""The planner runs the engine's schedule: the same events, in the same order, from both.

The engine's events of a steady-state step (``shardkit.core.subscribe``: every group's
pre-forward, unshard, reshard, post-forward, pre-backward and post-backward, and every
data-parallel collective, with the group it serves) must be exactly the planner's, which
replays the step on a meta-device model through ``shardkit.core.schedule``, the module the
engine's hooks decide with. Cases: plain, frozen blocks (a frozen block, one frozen in part,
and a frozen bottom that backward never reaches), shared parameters (tied embeddings),
activation checkpointing, HSDP and tensor parallelism.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.planner import plan
from tests.core import models
from tests.tools.plan.plan_checks import Event, event_recorder
from tests.tp import tp_models
from tests.tp.tp_parity import TPRun, build_sharded, global_mesh


def _prepare(model: Any, case: str) -> Any:
    """What a case does to the model before sharding (and to the planner's meta model)."""
    if case == "half-frozen block":  # LoRA's shape: frozen and trainable in one group
        next(model.blocks[0].parameters()).requires_grad_(False)
    if case in ("frozen block", "frozen bottom"):
        frozen = list(model.blocks[0].parameters())
        if case == "frozen bottom":  # the first block's output then needs no gradient
            frozen += [*model.tok.parameters(), *model.pos.parameters()]
        for param in frozen:
            param.requires_grad_(False)
    if case == "checkpointed":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    return model


_MODEL = {"tied": "gpt_tied"}  # the model of each case; "gpt" for the others


def _engine_events(rank: int, world_size: int, case: str, mesh_shape: tuple[int, ...]) -> Any:
    from shardkit.core import fully_shard, subscribe

    model = _prepare(models.build(_MODEL.get(case, "gpt")), case)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    events: list[Event] = []
    for step in range(2):  # the second: a steady state (the first has no forward order)
        events.clear()
        unsubscribe = subscribe(event_recorder(events))
        x, y = models.batch("gpt", step, 2)
        models.loss_of("gpt", model(x), y).backward()
        unsubscribe()
        opt.step()
        opt.zero_grad()
    return events


def _planned_events(case: str, mesh_shape: tuple[int, ...]) -> list[Event]:
    def model() -> nn.Module:
        with torch.device("meta"):
            built: nn.Module = _prepare(models.build(_MODEL.get(case, "gpt")), case)
        return built

    x, y = models.batch("gpt", 0, 2)
    options = PlanOptions(
        mesh_shape=mesh_shape if len(mesh_shape) == 2 else None,
        inputs=lambda: x.to("meta"),
        loss=lambda out: models.loss_of("gpt", out, y.to("meta")),
        backend="gloo",
    )
    return list(plan(model, world_size=math.prod(mesh_shape), options=options).events)


CASES = [
    ("plain", (2,)),
    ("frozen block", (2,)),
    ("frozen bottom", (2,)),
    ("half-frozen block", (2,)),
    ("tied", (2,)),
    ("checkpointed", (2,)),
    ("plain", (2, 2)),  # HSDP: the all-reduces across replicas
    ("plain", (4,)),
]


@pytest.mark.parametrize(("case", "mesh_shape"), CASES)
def test_the_planner_and_the_engine_run_one_schedule(
    case: str, mesh_shape: tuple[int, ...]
) -> None:
    engine = run_on_ranks(math.prod(mesh_shape), _engine_events, case=case, mesh_shape=mesh_shape)
    assert all(events == engine[0] for events in engine), "ranks disagree"
    assert engine[0], "no event recorded"
    assert _planned_events(case, mesh_shape) == engine[0]


# Tensor parallelism: the TP models and plans of tests/tp, sharded per block and root.
_TP_SHAPES = {"mlp": ((4,), (10,)), "sp": ((tp_models.SEQ, 7), (tp_models.SEQ, 3))}


def _tp_step(model: nn.Module, run: TPRun, step: int) -> None:
    x, y = tp_models.batch(run.model, step, 2 * run.mesh[0])
    x, y = x.chunk(run.mesh[0])[0], y.chunk(run.mesh[0])[0]  # each dp rank: the same rows
    F.mse_loss(model(x).float(), y).backward()


def _tp_engine_events(rank: int, world_size: int, run: TPRun) -> list[Event]:
    from shardkit.core import subscribe

    model = build_sharded("shardkit", run, global_mesh(run))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    events: list[Event] = []
    for step in range(2):
        events.clear()
        unsubscribe = subscribe(event_recorder(events))
        _tp_step(model, run, step)
        unsubscribe()
        opt.step()
        opt.zero_grad()
    return events


def _tp_planned_events(run: TPRun) -> list[Event]:
    inputs, outputs = _TP_SHAPES[run.model]
    options = PlanOptions(
        tp_degree=run.mesh[-1],
        tp_plan=functools.partial(tp_models.plan, run.model),
        inputs=lambda: torch.zeros(2, *inputs, device="meta"),
        loss=lambda out: F.mse_loss(out.float(), torch.zeros(2, *outputs, device="meta")),
        backend="gloo",
    )

    def model() -> nn.Module:
        with torch.device("meta"):
            built: nn.Module = tp_models.build(run.model)
        return built

    return list(plan(model, world_size=math.prod(run.mesh), options=options).events)


@pytest.mark.parametrize("model", ["mlp", "sp"])
def test_the_planner_and_the_engine_run_one_schedule_under_tp(model: str) -> None:
    run = TPRun(model=model, mesh=(2, 2))
    engine = run_on_ranks(4, _tp_engine_events, run=run)
    assert all(events == engine[0] for events in engine), "ranks disagree"
    assert _tp_planned_events(run) == engine[0]


def _skip(*_args: Any, **_kwargs: Any) -> None:
    """An operation that does nothing."""


def _skipped_prefetch(original: Any) -> Any:
    """``unshard`` that skips the prefetches (skipping every one would leave nothing to wait
    for: ``wait`` gathers what it finds not gathered)."""

    def unshard(step: Any, group: int, *, prefetch: bool = False) -> None:
        if not prefetch:
            original(step, group)

    return unshard


# The planner's operations (``schedule.StepOps``), each made to skip its work.
_SKIPPED: dict[str, Any] = {
    "wait": _skip,
    "reshard": _skip,
    "free_after_forward": _skip,
    "take_grads": _skip,  # no reduction starts
    "start_reduction": _skip,
    # A reduction dropped, not finished.
    "finish_oldest_reduction": lambda step: step.reductions.in_flight.popleft(),
}


def test_a_planner_that_skips_an_operation_fails_the_comparison(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # HSDP, where every kind of operation shows in the events (reductions finish with an
    # all-reduce across replicas).
    engine = run_on_ranks(4, _engine_events, case="plain", mesh_shape=(2, 2))[0]
    assert _planned_events("plain", (2, 2)) == engine
    from shardkit.tools.plan.step_ops import LedgerOps

    skipped = {**_SKIPPED, "unshard": _skipped_prefetch(LedgerOps.unshard)}
    for name, replacement in skipped.items():
        with monkeypatch.context() as patch:
            patch.setattr(LedgerOps, name, replacement)
            assert _planned_events("plain", (2, 2)) != engine, f"skipping {name} went unseen"
