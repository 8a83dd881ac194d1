"""``apply_plan`` against the same configuration written by hand with torch's own calls.

At W=2 on gloo, for each plan of ``tests.tools.plan.plan_runs`` (per-block units, pairs of blocks,
sub-module units, embeddings and head apart, units kept gathered, prefetch 2, full and
selective recomputation, bf16 parameters with fp32 reduction): ``apply_plan`` on shardkit's
engine, on torch's ``fully_shard`` and from the plan's JSON file, and the hand-written twin,
give the same losses over 3 AdamW steps and the same parameters, bit for bit.
``reduce_precision`` reaches every unit of shardkit's engine, and offloading on it trains as
without (on a CPU). Every mistake raises before the model changes: its state dict, module
tree and classes are compared before and after. Selective recomputation, counted op by op,
saves the matrix multiplies and recomputes the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

from harness.pool import run_on_ranks
from shardkit.core import ReducePrecision
from shardkit.tools.plan.sharding_plan import ROOT, ShardingPlan, Unit
from tests.tools.plan import plan_runs

WORLD_SIZE = 2


@pytest.mark.parametrize("plan_name", list(plan_runs.PLANS))
def test_apply_plan_is_bitwise_the_hand_written_calls(plan_name: str) -> None:
    hows = ("hand", "shardkit", "torch", "json")
    for traces in run_on_ranks(WORLD_SIZE, plan_runs.train_body, plan_name=plan_name, hows=hows):
        plan_runs.assert_bitwise(traces)


def _reduce_precision_body(rank: int, world_size: int) -> dict[str, Any]:
    """The ``blocks`` plan with a bf16 wire: by apply_plan, by hand, and without it."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core import fully_shard
    from shardkit.tools import apply_plan

    mesh = init_device_mesh("cpu", (world_size,))
    wire = ReducePrecision(wire_dtype=torch.bfloat16)
    base = ShardingPlan(units=(Unit(modules=("blocks.0",)), Unit(modules=(ROOT,))))
    planned = ShardingPlan(units=base.units, reduce_precision=wire)
    traces = {}
    for how, plan in (("apply", planned), ("plain", base)):
        model = plan_runs.build()
        apply_plan(model, plan, mesh=mesh)
        traces[how] = plan_runs.train(model, rank, world_size)
    model = plan_runs.build()
    fully_shard(model.blocks[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_reduce_precision(wire)
    traces["hand"] = plan_runs.train(model, rank, world_size)
    return traces


def test_reduce_precision_is_set_on_every_unit_of_shardkits_engine() -> None:
    for traces in run_on_ranks(WORLD_SIZE, _reduce_precision_body):
        plain = traces.pop("plain")
        plan_runs.assert_bitwise(traces)
        # The premise: a bf16 wire changes the result, so the equality above means it was set.
        assert any(
            not torch.equal(v, plain["params"][n]) for n, v in traces["hand"]["params"].items()
        )


def test_offload_on_shardkits_engine_trains_as_without() -> None:
    # On a CPU the shards live in host memory either way: offloading changes no number.
    plan = dataclasses.replace(plan_runs.PLANS["parts"], offload=True)
    hows = ("shardkit", "json", "source_shardkit")
    plain = run_on_ranks(WORLD_SIZE, plan_runs.train_body, plan_name="parts", hows=("shardkit",))
    offloaded = run_on_ranks(WORLD_SIZE, plan_runs.train_body, plan_name=plan, hows=hows)
    for rank, traces in enumerate(offloaded):
        plan_runs.assert_bitwise({**traces, "plain": plain[rank]["shardkit"]}, oracle="plain")


def _snapshot(model: nn.Module) -> dict[str, Any]:
    """What a failed apply_plan must leave as it was: tree, classes, tensors and their objects."""
    return {
        "tree": [(name, type(m)) for name, m in model.named_modules()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "params": [(name, id(p)) for name, p in model.named_parameters()],
    }


def _unchanged(before: dict[str, Any], after: dict[str, Any]) -> bool:
    return (
        before["tree"] == after["tree"]
        and before["params"] == after["params"]
        and before["state"].keys() == after["state"].keys()
        and all(torch.equal(v, after["state"][k]) for k, v in before["state"].items())
    )


_BLOCKS = plan_runs.PLANS["blocks"]
_ERROR_CASES: dict[str, tuple[dict[str, Any], str]] = {
    # name: (apply_plan's arguments, the words the error must contain)
    "missing_unit": (
        {"plan": ShardingPlan(units=(Unit(modules=("blocks.9",)),))},
        "units[0] names 'blocks.9', not a module of the model; close matches: 'blocks.3'",
    ),
    "missing_checkpoint": (
        {"plan": ShardingPlan(units=_BLOCKS.units, checkpoint=(("blocks.0.atn", "full"),))},
        "checkpoint[0] names 'blocks.0.atn', not a module of the model; close matches: "
        "'blocks.0.attn'",
    ),
    "outer_first": (
        {
            "plan": ShardingPlan(
                units=(Unit(modules=("blocks.0",)), Unit(modules=("blocks.0.attn",)))
            )
        },
        "units[0] module 'blocks.0' contains 'blocks.0.attn' of units[1], a later unit",
    ),
    "nested_in_unit": (
        {"plan": ShardingPlan(units=(Unit(modules=("blocks.0", "blocks.0.mlp")),))},
        "module 'blocks.0' contains 'blocks.0.mlp' of the same unit",
    ),
    "reshard_int": (
        {"plan": ShardingPlan(units=(Unit(modules=("blocks.0",), reshard_after_forward=3),))},
        "units[0] (blocks.0) reshard_after_forward=3 must divide the shard size 2",
    ),
    "reduce_precision_on_torch": (
        {
            "plan": ShardingPlan(
                units=_BLOCKS.units, reduce_precision=ReducePrecision(wire_dtype="bfloat16")
            ),
            "fully_shard": "torch",
        },
        "only shardkit's engine has",
    ),
    "offload_on_torch_without_accelerator": (
        {"plan": dataclasses.replace(_BLOCKS, offload=True), "fully_shard": "torch"},
        "torch's CPUOffloadPolicy pins host memory",
    ),
    "unknown_engine": ({"plan": _BLOCKS, "fully_shard": "other"}, "fully_shard must be None"),
    "mesh_type": ({"plan": _BLOCKS, "mesh": "cpu"}, "mesh must be a DeviceMesh"),
    "already_sharded": ({"plan": _BLOCKS, "prepare": "shard"}, "'blocks.1' is already sharded"),
    "already_wrapped": (
        {"plan": _BLOCKS, "prepare": "wrap"},
        "checkpoint[1]: module 'blocks.1' is already checkpoint-wrapped",
    ),
    "no_selective": (
        {"plan": plan_runs.PLANS["pairs"], "prepare": "no_selective"},
        "checkpoint[0]: selective checkpointing of 'blocks.0' needs",
    ),
}


def _prepare(model: Any, how: str | None, mesh: Any) -> None:
    """Make the model or the library into what an error case needs."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from shardkit.core import fully_shard

    if how == "shard":
        fully_shard(model.blocks[1], mesh=mesh)
    elif how == "wrap":
        model.blocks[1] = checkpoint_wrapper(model.blocks[1])
    elif how == "no_selective":  # as an older torch: undone by _errors_body
        delattr(checkpoint, "create_selective_checkpoint_contexts")


def _errors_body(rank: int, world_size: int) -> dict[str, tuple[str, str, bool]]:
    """Each error case on a fresh model: (error type, message, model unchanged)."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.tools import apply_plan

    mesh = init_device_mesh("cpu", (world_size,))
    engines: dict[str, Any] = {"torch": torch_fsdp.fully_shard, "other": lambda m, **kw: m}
    selective = checkpoint.create_selective_checkpoint_contexts
    found = {}
    for name, (args, _) in _ERROR_CASES.items():
        model = plan_runs.build()
        _prepare(model, args.get("prepare"), mesh)
        before = _snapshot(model)
        try:
            apply_plan(
                model,
                args["plan"],
                mesh=args.get("mesh", mesh),
                fully_shard=engines.get(args.get("fully_shard", "")),
            )
        except (ValueError, TypeError) as error:
            found[name] = (type(error).__name__, str(error), _unchanged(before, _snapshot(model)))
        else:
            found[name] = ("none", "", False)
        finally:
            checkpoint.create_selective_checkpoint_contexts = selective
    return found


def test_every_mistake_raises_before_the_model_changes() -> None:
    found = run_on_ranks(WORLD_SIZE, _errors_body)[0]
    for name, (_, words) in _ERROR_CASES.items():
        if name == "offload_on_torch_without_accelerator" and torch.cuda.is_available():
            continue
        kind, message, unchanged = found[name]
        assert words in message, (name, kind, message)
        assert unchanged, (name, message)
    assert found["unknown_engine"][0] == "TypeError"
    assert found["mesh_type"][0] == "TypeError"


def test_no_process_group_and_no_mesh_is_refused_before_any_change() -> None:
    from shardkit.tools import apply_plan

    model = plan_runs.build()
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match="no process group initialised"):
        apply_plan(model, plan_runs.PLANS["blocks"])
    assert _unchanged(before, _snapshot(model))


def test_the_root_cannot_be_checkpointed() -> None:
    with pytest.raises(ValueError, match="the root cannot be checkpointed"):
        ShardingPlan(units=(Unit(modules=(ROOT,)),), checkpoint=((ROOT, "full"),))


def _backward_ops(mode: str | None) -> dict[str, int]:
    """Operators of one GPT block's forward and backward, wrapped as apply_plan wraps it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    from shardkit.tools import OpCounter
    from shardkit.tools.plan.apply.apply import selective_context_fn
    from shardkit.tools.plan.gpt import GPTBlock

    torch.manual_seed(0)
    block: nn.Module = GPTBlock(16, 2)
    if mode is not None:
        kwargs: dict[str, Any] = {"context_fn": selective_context_fn} if mode == "selective" else {}
        block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
    x = torch.randn(2, 8, 16, requires_grad=True)
    with OpCounter() as ops:
        block(x).sum().backward()
    return {op: ops.by_op[op] for op in ("aten.addmm", "aten.mm", "aten.native_layer_norm")}


def test_selective_recomputes_all_but_the_matmuls_and_attention() -> None:
    plain, full, selective = (_backward_ops(mode) for mode in (None, "full", "selective"))
    # Full recomputation runs the forward's matmuls again; selective ones saved them.
    assert full["aten.addmm"] > plain["aten.addmm"]
    assert selective["aten.addmm"] == plain["aten.addmm"]
    assert selective["aten.mm"] == plain["aten.mm"]
    # The rest (here the layer norms) is recomputed by both.
    assert selective["aten.native_layer_norm"] == full["aten.native_layer_norm"]
    assert full["aten.native_layer_norm"] > plain["aten.native_layer_norm"]
