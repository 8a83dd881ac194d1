"""The floor of engine overhead at W=1 with DTensor parameters, on the model of 48 tiny layers.

An engine whose parameters stay DTensors between steps (as torch's ``fully_shard`` and
shardkit keep them) must, at every step, whatever else it does: register the full parameters
on their modules for forward, wrap each gradient as a DTensor and give it to its parameter,
register the DTensors back, and hand the optimizer each parameter's local tensor with its
gradient. This benchmark times exactly that, the bare Python and tensor-object work with no
hook, check or bookkeeping around it, on the 194 parameters of the model of 48 tiny layers,
next to the single-process training step of the same model in the same worker (what that
step does too, autograd setting gradients and ``zero_grad`` clearing them, is not counted).

``floor_ratio`` = (single-process step + floor) / single-process step: no engine meeting
those requirements can take less time than that, relative to single-process training. It
shows whether a target for the ``tiny-w1-local`` scenario of ``bench_train_step.py`` is
reachable at all.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from benchmarks import gpt
from harness.pool import run_on_ranks

ROUNDS = 400


def _slots(model: nn.Module) -> list[tuple[dict[str, Any], str, DTensor]]:
    """Every module slot that holds a DTensor parameter: (its module's dict, name, parameter)."""
    found: list[tuple[dict[str, Any], str, DTensor]] = []
    for module in model.modules():
        for name, param in module._parameters.items():
            if isinstance(param, DTensor):
                found.append((module._parameters, name, param))
    return found


def _floor_step(
    slots: list[tuple[dict[str, Any], str, DTensor]],
    full: list[nn.Parameter],
    grads: list[torch.Tensor],
) -> float:
    """Seconds of the per-step work any engine keeping DTensor parameters adds (docstring).

    What single-process training does too is done here untimed: autograd leaving each
    gradient on its (full) parameter, and ``zero_grad`` clearing the gradients.
    """
    started = time.perf_counter()
    for (params, name, _), param in zip(slots, full, strict=True):
        params[name] = param  # forward: the full parameters on the modules
    spent = time.perf_counter() - started
    for param, grad in zip(full, grads, strict=True):
        param.grad = grad  # autograd's part (untimed)
    started = time.perf_counter()
    taken: list[torch.Tensor] = []
    for (params, name, dparam), param in zip(slots, full, strict=True):
        local = param.grad
        assert local is not None
        param.grad = None
        dparam.grad = DTensor.__new__(DTensor, local, dparam._spec, requires_grad=False)
        params[name] = dparam  # the DTensors back on the modules
        taken.append(local)
    for param, local in zip(full, taken, strict=True):
        param.grad = local  # the optimizer steps local tensors, with their gradients
    for param in full:
        param.grad = None
    spent += time.perf_counter() - started
    for _, _, dparam in slots:
        dparam.grad = None  # zero_grad's part (untimed)
    return spent


def _measure(rank: int, world_size: int) -> dict[str, float]:
    model, opt = gpt.build("shardkit", "tiny", world_size)
    gpt.train_step(model, opt, gpt.batch("tiny", 0, rank, world_size))
    slots = _slots(model)
    full = [nn.Parameter(dparam._local_tensor.detach().clone()) for _, _, dparam in slots]
    grads = [torch.zeros_like(param) for param in full]
    local, local_opt = gpt.build("local", "tiny", world_size)
    floor: list[float] = []
    step: list[float] = []
    for i in range(ROUNDS):
        floor.append(_floor_step(slots, full, grads))
        step.append(gpt.train_step(local, local_opt, gpt.batch("tiny", i, rank, 1))["seconds"])
    for (params, name, dparam), _ in zip(slots, full, strict=True):
        params[name] = dparam
    return {
        "params": float(len(slots)),
        "floor_ms": statistics.median(floor[20:]) * 1e3,
        "single_process_step_ms": statistics.median(step[20:]) * 1e3,
    }


def test_w1_floor(benchmark: Any) -> None:
    result: dict[str, float] = {}

    def measure() -> None:
        result.update(run_on_ranks(1, _measure)[0])

    benchmark.pedantic(measure, rounds=1, iterations=1)
    step, floor = result["single_process_step_ms"], result["floor_ms"]
    result["floor_ratio"] = (step + floor) / step
    benchmark.extra_info.update(result)
    sys.stdout.write(
        f"\nW=1 floor, 48 tiny layers ({result['params']:.0f} DTensor parameters): "
        f"{floor:.3f} ms a step against a {step:.3f} ms single-process step: "
        f"at least {result['floor_ratio']:.3f}x single-process training\n"
    )
    assert result["params"] == 194  # the model the tiny-w1-local target is about
