"""Sharding plans measured against the planner: W gloo ranks for step time and peak memory.

:func:`measure_configs` runs each plan on the worker pool's W gloo ranks (the processes are
reused across plans, so start-up is paid once), ``ROUNDS`` times, the plans interleaved: the
model is built on the meta device, sharded by ``apply_plan``, materialized, trained ``WARMUP``
steps, then ``STEPS`` timed steps (a step's time is its slowest rank's; the fastest over every
round's steps is kept); in the first round one more step runs under
:class:`~shardkit.tools.track.live_peak.LivePeak` and :class:`CommTracker` for rank 0's peak of
live tensor bytes and bytes sent (the trackers slow a step, so it is not timed). Beside each,
the plan's prediction for the same world size on gloo: ``memory.peak.total``, the bytes sent
and, where a step-time model is given, the step time.

:func:`check_configs` runs each plan as rank 0 of a larger W on the fake group
(:func:`shardkit.tools.plan.apply.launch_check.check_plan`): the peak the planner predicts at a
scale this machine has no ranks for, measured.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.pool import RankTaskError, run_on_ranks
from shardkit.tools.examples import gpt_35m, gpt_35m_inputs, gpt_demo, gpt_demo_inputs
from shardkit.tools.plan import Plan, PlanOptions, plan
from shardkit.tools.plan.apply.apply import apply_plan
from shardkit.tools.plan.apply.launch_check import PlanCheck, check_plan
from shardkit.tools.plan.options import options_for
from shardkit.tools.plan.sharding_plan import ShardingPlan
from shardkit.tools.plan.timing.calibrate import calibrate
from shardkit.tools.plan.timing.hardware import Hardware
from shardkit.tools.plan.timing.step_time import estimate_step_time

MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "demo": (gpt_demo, gpt_demo_inputs),
    "35m": (gpt_35m, gpt_35m_inputs),
}
"""Model name -> (meta factory, one rank's meta inputs)."""

logger = logging.getLogger(__name__)

WARMUP, STEPS, ROUNDS = 2, 6, 4
_TIMEOUT_S = 600.0  # a 35M model's build and eight steps on two busy cores

PredictMs = Callable[[Plan], float | None]
"""A step-time model: the plan's step in milliseconds (None: no prediction)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One plan on W gloo ranks, measured and predicted."""

    name: str
    model: str
    world_size: int
    step_ms: float
    """The fastest of the timed steps (each its slowest rank's): on a shared 2-core machine
    other work only ever adds time, and medians ranked the plans less consistently run to
    run (benchmarks/plan_time_run.py found the same)."""
    peak_bytes: int
    """Rank 0's peak of live tensor bytes in one step."""
    sent_bytes: int
    """Bytes rank 0 sent in that step (the step check's few included)."""
    predicted_peak: int | None
    """The plan's ``memory.peak.total`` (None: the planner refused the plan)."""
    predicted_sent: int | None
    """The plan's bytes sent per step, the step check's included."""
    predicted_ms: float | None
    """The step-time model's step, where one was given."""
    error: str | None = None
    """Why the planner refused the plan."""


def cpu_step_time_model(world_size: int) -> tuple[Hardware, PredictMs]:
    """This machine's calibrated profile for ``world_size`` gloo ranks of one thread each,
    and the step-time model on it."""
    hardware = calibrate(world_size, threads=1)
    return hardware, lambda predicted: 1000 * estimate_step_time(predicted, hardware).total_s


def next_token_loss(out: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against token 0, its targets made where the output is (meta or not)."""
    rows = out.shape[0] * out.shape[1]
    targets = torch.zeros(rows, dtype=torch.long, device=out.device)
    return F.cross_entropy(out.float().reshape(rows, -1), targets)


def predict(model_name: str, sharding: ShardingPlan, world_size: int, backend: str) -> Plan:
    """The plan of ``sharding`` for ``model_name`` on ``world_size`` ranks of ``backend``."""
    factory, inputs = MODELS[model_name]
    base = PlanOptions(inputs=inputs, loss=next_token_loss, backend=backend)  # type: ignore[arg-type]
    return plan(factory, world_size=world_size, options=options_for(sharding, base))


def measure_configs(
    model_name: str,
    plans: dict[str, ShardingPlan],
    world_size: int = 2,
    predict_ms: PredictMs | None = None,
    rounds: int = ROUNDS,
) -> list[Measurement]:
    """Each plan on ``world_size`` gloo ranks of the worker pool, beside its prediction.

    Plans are interleaved: each round builds and times every plan once, in an order rotated
    from round to round, so a change in the machine's load over the minutes a matrix takes
    reaches every plan alike (the house's paired rounds, for many configurations). A plan's
    step time is the fastest of all its timed steps; its peak and bytes come from round 0.
    """
    names = list(plans)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    tracked: dict[str, dict[str, Any]] = {}
    refused: set[str] = set()
    for rnd in range(rounds):
        shift = rnd * len(names) // rounds  # each round starts a part of the list further on
        for name in names[shift:] + names[:shift]:
            if name in refused:
                continue
            try:
                ranks = run_on_ranks(
                    world_size,
                    _run_plan,
                    timeout_s=_TIMEOUT_S,
                    model_name=model_name,
                    sharding=plans[name],
                    track=rnd == 0,
                )
            except RankTaskError as err:  # the engine refused the plan: recorded, not fatal
                logger.warning("%s %s: %s", model_name, name, str(err).splitlines()[-1])
                refused.add(name)
                continue
            seconds[name] += [max(r["seconds"][i] for r in ranks) for i in range(STEPS)]
            if rnd == 0:
                tracked[name] = ranks[0]
    return [
        _measurement(
            model_name, name, plans[name], world_size, seconds[name], tracked[name], predict_ms
        )
        for name in names
        if name not in refused
    ]


def _measurement(
    model_name: str,
    name: str,
    sharding: ShardingPlan,
    world_size: int,
    seconds: list[float],
    tracked: dict[str, Any],
    predict_ms: PredictMs | None,
) -> Measurement:
    predicted: Plan | None = None
    error = None
    try:
        predicted = predict(model_name, sharding, world_size, "gloo")
    except (NotImplementedError, ValueError) as err:
        error = f"{type(err).__name__}: {err}"
    return Measurement(
        name=name,
        model=model_name,
        world_size=world_size,
        step_ms=1000 * min(seconds),
        peak_bytes=tracked["peak"],
        sent_bytes=tracked["sent"],
        predicted_peak=predicted.memory.peak.total if predicted else None,
        predicted_sent=_sent_with_check(predicted) if predicted else None,
        predicted_ms=predict_ms(predicted) if predicted and predict_ms else None,
        error=error,
    )


def check_configs(
    model_name: str, plans: dict[str, ShardingPlan], world_size: int = 8
) -> dict[str, PlanCheck | str]:
    """Each plan as rank 0 of ``world_size`` on the fake group (this process): its check,
    or why the planner refused it."""
    factory, inputs = MODELS[model_name]
    checks: dict[str, PlanCheck | str] = {}
    for name, sharding in plans.items():
        try:
            checks[name] = check_plan(
                factory, sharding, world_size=world_size, inputs=inputs, loss=next_token_loss
            )
        except (NotImplementedError, ValueError) as err:
            checks[name] = f"{type(err).__name__}: {err}"
    return checks


def _sent_with_check(predicted: Plan) -> int:
    return predicted.sent_bytes_per_step + sum(c.sent_bytes for c in predicted.step_check)


def _run_plan(
    rank: int, world_size: int, model_name: str, sharding: ShardingPlan, track: bool
) -> dict[str, Any]:
    """Worker task: build, warm up, time ``STEPS`` steps, then (``track``) track one."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.tools import CommTracker
    from shardkit.tools.track.live_peak import LivePeak

    torch.set_num_threads(1)
    factory, inputs = MODELS[model_name]
    with torch.device("meta"):
        model = factory()
    model = apply_plan(model, sharding, mesh=init_device_mesh("cpu", (world_size,)))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.normal_(0.0, 0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shape = inputs().shape
    vocab = next(p for n, p in model.named_parameters() if n.endswith("head.weight")).shape[0]
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, vocab, (shape[0], shape[1] + 1), generator=gen)

    def step() -> float:
        loss = _loss_of_forward(model, batch, vocab)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.item())

    for _ in range(WARMUP):
        step()
    seconds = []
    for _ in range(STEPS):
        dist.barrier()
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    result: dict[str, Any] = {"seconds": seconds}
    if track:
        with LivePeak(model, optimizers=[optimizer]) as live, CommTracker() as comm:
            step()
        result |= {"peak": live.peak, "sent": sum(r.sent_bytes for r in comm.records)}
    optimizer.state.clear()  # the next plan's model starts from a clean heap
    gc.collect()
    return result


def _loss_of_forward(model: nn.Module, batch: torch.Tensor, vocab: int) -> torch.Tensor:
    """Forward and the loss; the logits go out of scope here, as in a training loop that
    does not keep them (the plan assumes it: only the loss's graph holds them)."""
    out = model(batch[:, :-1])
    return F.cross_entropy(out.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))
