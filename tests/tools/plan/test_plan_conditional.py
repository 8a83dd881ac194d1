"""The planner's prediction of conditional modules against a step on the fake group.

A tower inside each block (``set_conditional``: a module some ranks skip), marked through
``ShardingPlan.conditional`` and applied by ``apply_plan``; rank 0 runs it, as the plan's
trace does. ``check_plan`` runs the step on torch's fake group, on real tensors: every
collective as planned, in order and byte for byte (the step check's message too), and the
peak within 3%, as the other launch checks. Measured over predicted peak (printed with
``-s``): towers anchored by their block units 0.9963 at W=2, 0.9933 at W=8; anchored by the
root 0.9969 and 0.9954. Planned as if unmarked, the first case's collectives come in another
order (the block gathers its tower), and the second's peak is 6% and 15% low (the root holds
the towers from its forward to its backward's end).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from shardkit.tools.plan.apply.launch_check import check_plan
from shardkit.tools.plan.options import PlanOptions, options_for
from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.planner import plan
from shardkit.tools.plan.sharding_plan import ROOT, ShardingPlan, Unit

_DIM, _ROWS = 32, 4


class _Block(nn.Module):
    """A projection, then a tower beside it: the tower is what some ranks would skip."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(_DIM, _DIM)
        self.tower = nn.Sequential(nn.Linear(_DIM, 2 * _DIM), nn.ReLU(), nn.Linear(2 * _DIM, _DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        out: torch.Tensor = h + self.tower(h)
        return out


class _Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(_DIM, _DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def _inputs() -> torch.Tensor:
    return torch.zeros(_ROWS, _DIM, device="meta")


_TOWERS = ("blocks.0.tower", "blocks.1.tower")
_ROOT_KEEPS = Unit(modules=(ROOT,), reshard_after_forward=False)
_PLANS = {
    # Each block a unit: it anchors its tower (an inner anchor). The first block's inputs need
    # no gradient (its backward ends at the callback), the second's do (backward through them).
    "block_anchors": ShardingPlan(
        units=(
            *(Unit(modules=(fqn,)) for fqn in ("blocks.0.tower", "blocks.0")),
            *(Unit(modules=(fqn,)) for fqn in ("blocks.1.tower", "blocks.1")),
            _ROOT_KEEPS,
        ),
        conditional=_TOWERS,
    ),
    # Only the towers are units: the root anchors both.
    "root_anchor": ShardingPlan(
        units=(*(Unit(modules=(fqn,)) for fqn in _TOWERS), _ROOT_KEEPS), conditional=_TOWERS
    ),
}


@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("name", list(_PLANS))
def test_conditional_towers_run_as_planned(name: str, world_size: int) -> None:
    sharding = _PLANS[name]
    check = check_plan(_Towers, sharding, world_size=world_size, inputs=_inputs, fake_tensors=False)
    print(f"{name} W={world_size}: measured/predicted peak {check.ratio:.4f}")
    assert check.collectives_match, check.first_mismatch
    assert check.measured_peak == pytest.approx(check.predicted_peak, rel=0.03)
    # The plan would not hold unmarked: the towers' schedule is what made it match.
    unmarked = _predicted(dataclasses.replace(sharding, conditional=()), world_size)
    planned = [(c.kind, c.input_bytes, c.sent_bytes) for c in unmarked.schedule]
    assert (
        planned != list(check.measured_calls[: len(planned)])
        or unmarked.memory.peak.total < 0.97 * check.measured_peak
    )


def _predicted(sharding: ShardingPlan, world_size: int) -> Plan:
    base = PlanOptions(inputs=_inputs, backend="nccl", rank=0)
    return plan(_Towers, world_size=world_size, options=options_for(sharding, base))


def test_a_conditional_name_must_be_a_sharded_module() -> None:
    options = PlanOptions(inputs=_inputs, wrap={"_Block"}, conditional=("blocks.0.fc",))
    with pytest.raises(ValueError, match=r"conditional module 'blocks\.0\.fc' is not a sharded"):
        plan(_Towers, world_size=2, options=options)
    with pytest.raises(ValueError, match="the root cannot be conditional"):
        PlanOptions(conditional=(ROOT,))


def test_torch_s_fully_shard_has_no_conditional_modules() -> None:
    from torch.distributed.fsdp import fully_shard

    from shardkit.tools.plan.apply.apply import apply_plan

    with torch.device("meta"):
        model = _Towers()
    with pytest.raises(ValueError, match="only shardkit's engine has"):
        apply_plan(model, _PLANS["root_anchor"], fully_shard=fully_shard)
