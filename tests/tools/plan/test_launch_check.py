"""The check before launch: one rank of a sharding plan's step on the fake group, against its plan.

The tiny GPT of the library tests at W=8, on real tensors and on fake ones (the two must
measure the same peak: fake tensors keep every storage's size); the 8B Llama at 64 ranks on
fake tensors. The peak within 3% of the plan's, every collective as planned. Byte counts and
operator counts, never times.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardkit.tools.examples import llama_8b, llama_8b_inputs
from shardkit.tools.plan.apply.launch_check import PlanCheck, check_plan
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.sharding_plan import ROOT, ShardingPlan, Unit
from tests.core import models

_ROWS, _SEQ = 2, 8  # one rank's tokens for the tiny GPT of tests.core.models


def _per_block(prefix: str, count: int) -> ShardingPlan:
    """Each block a unit, the root last keeping its parameters for backward."""
    blocks = [Unit(modules=(f"{prefix}.{i}",)) for i in range(count)]
    return ShardingPlan(units=(*blocks, Unit(modules=(ROOT,), reshard_after_forward=False)))


def _tiny_gpt() -> nn.Module:
    model: nn.Module = models.build("gpt")
    return model


def _tiny_inputs() -> torch.Tensor:
    return torch.zeros(_ROWS, _SEQ, dtype=torch.long, device="meta")


def _next_token_loss(out: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against token 0, its targets made where the output is (meta or not)."""
    rows = out.shape[0] * out.shape[1]
    targets = torch.zeros(rows, dtype=torch.long, device=out.device)
    return F.cross_entropy(out.float().reshape(rows, -1), targets)


@pytest.mark.parametrize("fake", [False, True])
def test_the_tiny_gpt_at_8_ranks_runs_as_planned(fake: bool) -> None:
    check = check_plan(
        _tiny_gpt,
        _per_block("blocks", 2),
        world_size=8,
        inputs=_tiny_inputs,
        loss=_next_token_loss,
        fake_tensors=fake,
    )
    print(check.summary())
    assert check.fake_tensors is fake
    assert check.collectives_match, check.first_mismatch
    assert check.measured_peak == pytest.approx(check.predicted_peak, rel=0.03)
    assert check.ops > 0
    assert not dist.is_initialized(), "the check's fake group outlived it"


def test_fake_tensors_measure_what_real_ones_do() -> None:
    real, fake = (
        check_plan(
            _tiny_gpt,
            _per_block("blocks", 2),
            world_size=8,
            inputs=_tiny_inputs,
            loss=_next_token_loss,
            fake_tensors=tensors,
        )
        for tensors in (False, True)
    )
    assert fake.measured_peak == real.measured_peak
    # The step check's message is all that differs: the engine skips it on fake tensors.
    assert real.measured_calls[: len(fake.measured_calls)] == fake.measured_calls
    assert len(real.measured_calls) == len(fake.measured_calls) + 1


def test_a_caller_s_fake_group_is_used_and_left_alone() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        check = check_plan(_tiny_gpt, _per_block("blocks", 2), world_size=8, inputs=_tiny_inputs)
        assert check.collectives_match, check.first_mismatch
        assert dist.is_initialized()
        with pytest.raises(RuntimeError, match="fake one of 4 ranks"):
            check_plan(_tiny_gpt, _per_block("blocks", 2), world_size=4, inputs=_tiny_inputs)
    finally:
        dist.destroy_process_group()


def test_steps_must_include_a_warm_up() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        check_plan(_tiny_gpt, _per_block("blocks", 2), world_size=8, inputs=_tiny_inputs, steps=1)


@pytest.fixture(scope="module")
def hsdp_check() -> PlanCheck:
    """Two replicas of 4 shards, the stand-in loss."""
    return check_plan(
        _tiny_gpt,
        _per_block("blocks", 2),
        world_size=8,
        inputs=_tiny_inputs,
        base_options=PlanOptions(mesh_shape=(2, 4)),
    )


@pytest.fixture(scope="module")
def ones_check() -> PlanCheck:
    """No loss: a ones gradient for the logits, as the planner assumes."""
    return check_plan(_tiny_gpt, _per_block("blocks", 2), world_size=8, inputs=_tiny_inputs)


@pytest.fixture(scope="module")
def llama_check() -> PlanCheck:
    """The 8B Llama at 64 ranks: on fake tensors, chosen by its predicted peak (~115 GB)."""
    check = check_plan(
        llama_8b,
        _per_block("layers", 32),
        world_size=64,
        inputs=llama_8b_inputs,
        loss=_next_token_loss,
    )
    print(check.summary())
    return check


def test_hsdp_runs_the_collectives_planned(hsdp_check: PlanCheck) -> None:
    """The replicas' all-reduces are planned and run too."""
    assert hsdp_check.collectives_match, hsdp_check.first_mismatch
    assert "all_reduce" in {kind for kind, _, _ in hsdp_check.measured_calls}


def test_a_ones_gradient_runs_the_collectives_planned(ones_check: PlanCheck) -> None:
    assert ones_check.collectives_match, ones_check.first_mismatch


def test_the_8b_llama_at_64_ranks_runs_the_collectives_planned(llama_check: PlanCheck) -> None:
    assert llama_check.fake_tensors
    assert llama_check.collectives_match, llama_check.first_mismatch


@pytest.mark.parametrize("name", ["hsdp_check", "ones_check", "llama_check"])
def test_the_peak_is_as_planned(name: str, request: pytest.FixtureRequest) -> None:
    check: PlanCheck = request.getfixturevalue(name)
    assert check.measured_peak == pytest.approx(check.predicted_peak, rel=0.03)


def test_a_given_prediction_is_used_and_must_be_rank_0_s_on_nccl() -> None:
    from shardkit.tools.plan.options import options_for
    from shardkit.tools.plan.planner import plan

    sharding = _per_block("blocks", 2)
    base = PlanOptions(inputs=_tiny_inputs, loss=_next_token_loss)
    predicted = plan(_tiny_gpt, world_size=8, options=options_for(sharding, base))
    check = check_plan(
        _tiny_gpt,
        sharding,
        world_size=8,
        inputs=_tiny_inputs,
        loss=_next_token_loss,
        predicted=predicted,
    )
    assert check.predicted_peak == predicted.memory.peak.total
    assert check.measured_peak == pytest.approx(check.predicted_peak, rel=0.03)
    gloo = plan(
        _tiny_gpt, world_size=8, options=options_for(sharding, replace(base, backend="gloo"))
    )
    with pytest.raises(ValueError, match="nccl"):
        check_plan(_tiny_gpt, sharding, world_size=8, inputs=_tiny_inputs, predicted=gloo)


def test_muon_runs_the_collectives_planned_its_exchange_too() -> None:
    # Muon on the blocks' matrices and AdamW on the rest: the plan's two all-to-alls of the
    # optimizer step (rows to owners, updates back, sized by the core's routes) are the ones
    # the step issues, to the byte.
    check = check_plan(
        _tiny_gpt,
        _per_block("blocks", 2),
        world_size=8,
        inputs=_tiny_inputs,
        loss=_next_token_loss,
        base_options=PlanOptions(optimizer="muon"),
    )
    print(check.summary())
    assert check.collectives_match, check.first_mismatch
    assert [k for k, _, _ in check.measured_calls].count("all_to_all") == 2
