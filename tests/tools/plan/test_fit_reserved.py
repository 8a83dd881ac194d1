"""``--fit`` budgets what the CUDA caching allocator reserves on CUDA, live bytes on a CPU.

The demo GPT at 8 ranks, searched over one structure (per block, no recomputation levels
beyond the search's own bound, prefetch 1): its fastest plan is found under an ample budget,
then searched again under a budget halfway between that plan's live peak and its reserved
peak. A plan for NCCL (CUDA) must be refused there; the same plan for gloo (a CPU, whose
budget counts live bytes) accepted.
"""

from __future__ import annotations

from typing import Literal

import pytest
from torch import nn

from shardkit.tools.plan.examples import gpt_demo, gpt_demo_inputs
from shardkit.tools.plan.meta_build import build_on_meta
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.search.fit import Fit, fit, fit_json, format_fit
from shardkit.tools.plan.search.search import SearchSpace
from shardkit.tools.plan.timing.hardware import H100

SPACE = SearchSpace(
    boundaries=("block",),
    edges_apart=(False,),
    prefetch=(1,),
    checkpoint_levels=(0,),
    selective=False,
)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return build_on_meta(gpt_demo, "gpt_demo")


def _fit(model: nn.Module, budget: int, backend: Literal["nccl", "gloo"]) -> Fit:
    base = PlanOptions(inputs=gpt_demo_inputs, backend=backend)
    return fit(model, world_size=8, budget_bytes=budget, base=base, hardware=H100, space=SPACE)


def test_a_budget_between_live_and_reserved_is_refused_on_cuda_and_accepted_on_cpu(
    model: nn.Module,
) -> None:
    ample = _fit(model, 2**30, "nccl")
    assert ample.result.best is not None and ample.budget_counts == "reserved"
    estimate = ample.result.best.estimate
    assert estimate.live_bytes is not None and estimate.peak_bytes > estimate.live_bytes
    budget = (estimate.live_bytes + estimate.peak_bytes) // 2
    chosen = ample.result.best.plan

    on_cuda = _fit(model, budget, "nccl")
    refused = next(e for e in on_cuda.result.evaluated if e.plan == chosen)
    assert not refused.fits and refused.estimate.live_bytes == estimate.live_bytes
    assert "reserved peak" in on_cuda.result.why_lost(refused)

    on_cpu = _fit(model, budget, "gloo")
    assert on_cpu.budget_counts == "live" and on_cpu.result.best is not None
    accepted = next(e for e in on_cpu.result.evaluated if e.plan == chosen)
    assert accepted.fits and accepted.estimate.live_bytes is None
    assert accepted.estimate.peak_bytes <= budget < accepted.estimate.peak_bytes * 2

    # What is printed and the JSON say which count the budget was compared with.
    assert "caching allocator reserves" in format_fit(ample, title="demo")
    assert "live tensor bytes" in format_fit(on_cpu, title="demo")
    document = fit_json(ample, title="demo")
    assert document["budget_counts"] == "reserved"
    assert document["peak"]["reserved_bytes"] == estimate.peak_bytes
    assert document["peak"]["live_bytes"] == estimate.live_bytes
    assert fit_json(on_cpu, title="demo")["budget_counts"] == "live"
