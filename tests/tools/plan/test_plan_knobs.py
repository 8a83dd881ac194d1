"""The planner's ShardingPlan knobs in one process: options_for, units, prefetch lists,
checkpoint, and the clear refusals (measurements are test_plan_knobs_vs_trackers')."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardkit.tools.plan.options import PlanOptions, options_for
from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.planner import plan
from shardkit.tools.plan.sharding_plan import ROOT, ShardingPlan, Unit
from shardkit.tools.records import Category, Phase
from tests.core import models


def _meta_gpt() -> torch.nn.Module:
    with torch.device("meta"):
        model: torch.nn.Module = models.build("gpt")
    return model


def _inputs() -> torch.Tensor:
    return torch.zeros(2, 8, dtype=torch.long, device="meta")


def _loss(out: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        out.float().reshape(-1, 37), torch.zeros(16, dtype=torch.long).to("meta")
    )


_BASE = PlanOptions(inputs=_inputs, loss=_loss, backend="gloo")
_BLOCKS = (Unit(modules=("blocks.0",)), Unit(modules=("blocks.1",)))


def _plan(sharding: ShardingPlan, world_size: int = 2) -> Plan:
    return plan(_meta_gpt, world_size=world_size, options=options_for(sharding, _BASE))


def test_options_for_takes_the_plans_choices_and_the_rest_from_base() -> None:
    sharding = ShardingPlan(
        units=(*_BLOCKS, Unit(modules=(ROOT,))),
        prefetch=2,
        checkpoint=(("blocks.0", "full"),),
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    )
    base = PlanOptions(inputs=_inputs, backend="gloo", rank=1, wrap=("GPTBlock",))
    options = options_for(sharding, base)
    assert options.units == sharding.units and options.prefetch == 2
    assert options.checkpoint == sharding.checkpoint and options.offload is False
    assert (options.param_dtype, options.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert (options.rank, options.backend, options.inputs) == (1, "gloo", _inputs)
    assert options.wrap is None  # the units replace it
    assert options.checkpointed == {"blocks.0": "full"}


def test_units_as_the_per_block_wrap_plan_the_same_step() -> None:
    # The root's default (None) keeps its parameters; a unit says so explicitly.
    units = (*_BLOCKS, Unit(modules=(ROOT,), reshard_after_forward=False))
    by_units = _plan(ShardingPlan(units=units))
    by_wrap = plan(_meta_gpt, world_size=2, options=_BASE)
    assert by_units.schedule == by_wrap.schedule
    assert by_units.memory.peak.total == by_wrap.memory.peak.total


def test_a_unit_of_two_modules_is_one_group_named_as_the_engine_names_it() -> None:
    planned = _plan(
        ShardingPlan(units=(Unit(modules=("blocks.0", "blocks.1")), Unit(modules=(ROOT,))))
    )
    assert [g.fqn for g in planned.groups] == ["blocks.0, blocks.1", "<root>"]
    gathers = [(c.group, c.phase) for c in planned.schedule if c.kind == "all_gather"]
    assert gathers.count(("blocks.0, blocks.1", Phase.FORWARD)) == 1  # once for both calls
    # The root unit's True (given, not the default) frees the root after forward too.
    assert ("<root>", Phase.BACKWARD) in gathers


def test_per_unit_reshard_after_forward() -> None:
    units = (
        Unit(modules=("blocks.0",), reshard_after_forward=False),
        Unit(modules=("blocks.1",)),
        Unit(modules=(ROOT,), reshard_after_forward=False),
    )
    planned = _plan(ShardingPlan(units=units))
    assert [g.reshard_after_forward for g in planned.groups] == [False, True, False]
    backward = [
        c.group for c in planned.schedule if c.kind == "all_gather" and c.phase is Phase.BACKWARD
    ]
    assert backward == ["blocks.1"]


def test_int_reshard_after_forward_resolves_as_the_engine() -> None:
    def planned(n: int, world: int) -> Plan:
        units = (Unit(modules=("blocks.0",), reshard_after_forward=n), Unit(modules=(ROOT,)))
        return _plan(ShardingPlan(units=units), world)

    assert planned(2, 2).groups[0].reshard_after_forward is True  # n = shard count
    assert planned(1, 2).groups[0].reshard_after_forward is False  # a 1/1 slice
    with pytest.raises(ValueError, match="must divide the shard count 4"):
        planned(3, 4)
    sliced = planned(2, 4)  # a 1/2 slice kept, gathered within 2 ranks in backward
    backward = [c for c in sliced.schedule if c.group == "blocks.0" and c.phase is Phase.BACKWARD]
    assert [(c.kind, c.group_size) for c in backward][:1] == [("all_gather", 2)]
    labels = [p.label for p in sliced.memory.timeline]
    assert "post-forward slices blocks.0" in labels


def test_prefetch_lists_follow_the_plan_order() -> None:
    units = (Unit(modules=("tok",)), *_BLOCKS, Unit(modules=("head",)), Unit(modules=(ROOT,)))
    lists = ShardingPlan(units=units, prefetch=2).prefetch_lists()
    assert lists is not None
    # Forward: root, tok, blocks.0, blocks.1, head; backward: root, head, blocks.1, ...
    assert lists[4] == ((0, 1), (3, 2))  # the root
    assert lists[0] == ((1, 2), ())  # tok
    assert lists[2] == ((3,), (1, 0))  # blocks.1
    assert ShardingPlan(units=units).prefetch_lists() is None
    planned = _plan(ShardingPlan(units=units, prefetch=2))
    events = list(planned.events)
    first = events.index(("pre_forward", "<root>"))
    # The root's pre-forward gathers tok and blocks.0 ahead.
    assert events[first + 1 : first + 5] == [
        ("all_gather", "tok"),
        ("unshard", "tok"),
        ("all_gather", "blocks.0"),
        ("unshard", "blocks.0"),
    ]


def test_checkpoint_keeps_less_and_recomputes_in_backward() -> None:
    units = (*_BLOCKS, Unit(modules=(ROOT,), reshard_after_forward=False))
    plain = _plan(ShardingPlan(units=units))
    full = _plan(ShardingPlan(units=units, checkpoint=(("blocks.0", "full"), ("blocks.1", "full"))))
    selective = _plan(
        ShardingPlan(units=units, checkpoint=(("blocks.0", "selective"), ("blocks.1", "selective")))
    )
    act = Category.ACTIVATIONS
    assert full.memory.category_max[act] < selective.memory.category_max[act]
    assert selective.memory.category_max[act] < plain.memory.category_max[act]
    # Backward's recomputation shows as backward's own bytes, as the trackers count them.
    assert full.memory.category_max[Category.OTHER] > plain.memory.category_max[Category.OTHER]
    assert full.schedule == plain.schedule
    assert full.options.checkpointed == {"blocks.0": "full", "blocks.1": "full"}


@pytest.mark.parametrize(
    ("sharding", "error", "match"),
    [
        (ShardingPlan(units=_BLOCKS), ValueError, "no root unit"),
        (
            ShardingPlan(units=(Unit(modules=("blocks.9",)), Unit(modules=(ROOT,)))),
            ValueError,
            "near names: blocks.1, blocks.0",
        ),
        (
            ShardingPlan(units=(Unit(modules=("blocks",)), Unit(modules=(ROOT,)))),
            ValueError,
            "container",
        ),
        (
            ShardingPlan(
                units=(
                    Unit(modules=("blocks.0",)),
                    Unit(modules=("blocks.0.attn",)),
                    Unit(modules=(ROOT,)),
                )
            ),
            ValueError,
            "inner modules first",
        ),
        (
            ShardingPlan(
                units=(Unit(modules=("blocks.0.attn",)), Unit(modules=(ROOT,))),
                checkpoint=(("blocks.0", "full"),),
            ),
            NotImplementedError,
            "contains the unit blocks.0.attn",
        ),
        (
            ShardingPlan(units=(Unit(modules=(ROOT,)),), checkpoint=(("blocks.0.atn", "full"),)),
            ValueError,
            "near names: blocks.0.attn",
        ),
    ],
)
def test_refusals_name_the_unit_or_module(
    sharding: ShardingPlan, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        _plan(sharding)


def test_option_checks() -> None:
    with pytest.raises(ValueError, match="needs units"):
        PlanOptions(prefetch=2)
    with pytest.raises(ValueError, match="replaces wrap"):
        PlanOptions(units=(Unit(modules=(ROOT,)),), wrap=("GPTBlock",))
    with pytest.raises(TypeError, match="not a Unit"):
        PlanOptions(units=("blocks.0",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint entries"):
        PlanOptions(checkpoint=(("blocks.0", "sometimes"),))  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_offload_moves_shards_gradients_and_state_to_the_host(backend: str) -> None:
    units = (*_BLOCKS, Unit(modules=(ROOT,), reshard_after_forward=False))
    base = PlanOptions(inputs=_inputs, loss=_loss, backend=backend)  # type: ignore[arg-type]

    def planned(offload: bool) -> Plan:
        options = options_for(ShardingPlan(units=units, offload=offload), base)
        return plan(_meta_gpt, world_size=2, options=options)

    on, off = planned(True), planned(False)
    assert on.schedule == off.schedule  # the same collectives, the same bytes
    on_max, off_max = on.memory.category_max, off.memory.category_max
    for category in (Category.SHARDED_PARAMS, Category.OPTIMIZER_STATE):
        assert on_max[category] == 0  # none on the device
    sharded = sum(g.sharded_bytes for g in on.groups)
    state = off_max[Category.OPTIMIZER_STATE]
    last = on.memory.timeline[-1]
    assert last.host_by_category[Category.SHARDED_PARAMS] == sharded
    assert last.host_by_category[Category.OPTIMIZER_STATE] == state
    # Host: shards, state and every group's sharded gradients at the optimizer step.
    grads = sum(g.reduce_output_bytes for g in on.groups)
    assert on.host_bytes >= sharded + state + grads
    assert off.host_bytes == 0
    # The device stages each all-gather's input (a copy of the host's shard) in the pool.
    staged = max(g.gather_input_bytes for g in on.groups)
    assert on_max[Category.COMM_BUFFERS] >= off_max[Category.COMM_BUFFERS]
    assert on.memory.peak.total < off.memory.peak.total + staged
    assert on.to_dict()["memory"]["host_peak"] == on.host_bytes


def test_a_unit_of_several_modules_with_frozen_parameters_is_refused() -> None:
    def frozen() -> torch.nn.Module:
        model = _meta_gpt()
        model.get_submodule("blocks.0").requires_grad_(False)
        return model

    units = (Unit(modules=("blocks.0", "blocks.1")), Unit(modules=(ROOT,)))
    options = options_for(ShardingPlan(units=units), _BASE)
    with pytest.raises(NotImplementedError, match=r"blocks\.0, blocks\.1 of several modules"):
        plan(frozen, world_size=2, options=options)
