"""The planner with tensor parallelism: TP-local layouts, tp collectives, refusals (one process).

Measured against the engine and DTensor in ``test_plan_vs_trackers_tp.py``; here the shapes
and counts that follow from the plan alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput

from shardkit.core.layout import ParamSpec, group_layout
from shardkit.tools.plan.examples import llama_tiny, llama_tiny_inputs, llama_tp_plan
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.planner import plan
from shardkit.tools.records import Phase
from tests.tp import tp_models

_OUTPUT_STYLE = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate())
_SHAPES = {"mlp": ((2, 4), (2, 10)), "sp": ((2, tp_models.SEQ, 7), (2, tp_models.SEQ, 3))}


def _meta(name: str) -> nn.Module:
    with torch.device("meta"):
        model: nn.Module = tp_models.build(name)
    return model


def _options(name: str, **overrides: Any) -> PlanOptions:
    inputs, outputs = _SHAPES[name]
    settings: dict[str, Any] = {
        "tp_degree": 2,
        "tp_plan": lambda model: tp_models.plan(name, model),
        "inputs": lambda: torch.zeros(inputs, device="meta"),
        "loss": lambda out: F.mse_loss(out.float(), torch.zeros(outputs, device="meta")),
        "backend": "gloo",
    }
    return PlanOptions(**{**settings, **overrides})


def _tp_plan(name: str, world_size: int = 4, **overrides: Any) -> Plan:
    return plan(lambda: _meta(name), world_size=world_size, options=_options(name, **overrides))


def test_the_layout_is_asked_with_tp_local_shapes() -> None:
    # mlp at TP 2: colwise a and c keep half their rows, rowwise b half its columns and all
    # of its (replicated) bias; dp then shards those over its 2 ranks.
    local = {
        "a.weight": (3, 4),
        "a.bias": (3,),
        "b.weight": (8, 3),
        "b.bias": (8,),
        "c.weight": (5, 8),
        "c.bias": (5,),
    }
    specs = [ParamSpec(fqn=n, shape=s, dtype=torch.float32) for n, s in local.items()]
    expected = group_layout(specs, shard_world=2)
    (root,) = _tp_plan("mlp").groups
    assert (root.sharded_bytes, root.unsharded_bytes) == (
        expected.sharded_bytes,
        expected.unsharded_bytes,
    )
    assert root.gather_input_bytes == expected.all_gather_input_bytes
    # "sp": inp's 7 input features split 4 + 3 and head's 3 rows 2 + 1, so the tp ranks'
    # root groups differ: 6x4 + 6 + 6 + 6 + 2x6 + 2 elements against 6x3 + 6 + 6 + 6 + 6 + 1.
    first, second = (_tp_plan("sp", rank=r).groups[-1] for r in (0, 1))
    assert (first.param_count, second.param_count) == (56, 43)
    assert first.unsharded_bytes > second.unsharded_bytes


def test_parameter_counts_are_the_models() -> None:
    result = _tp_plan("mlp")
    assert result.param_count == sum(p.numel() for p in tp_models.build("mlp").parameters())
    assert result.tp_degree == 2 and (result.replicas, result.shard_size) == (1, 2)


def test_torchtitans_llama_plan() -> None:
    """Per block: 2 all-gathers and 2 reduce-scatters each way, 2 norm gradients all-reduced."""
    options = PlanOptions(tp_degree=2, tp_plan=llama_tp_plan, inputs=llama_tiny_inputs)
    result = plan(llama_tiny, world_size=4, options=options)
    tp = [c for c in result.schedule if c.axis == "tp"]
    layers = 4
    forward = [c for c in tp if c.phase is Phase.FORWARD]
    backward = [c for c in tp if c.phase is Phase.BACKWARD]
    # Forward: the embedding's reduce-scatter, per block two gathers and two reduce-scatters,
    # the output's input and logits gathers. Backward mirrors them; the embedding's ids and the
    # logits' gradient need nothing; every norm's gradient is all-reduced.
    assert len(forward) == 4 * layers + 3
    assert len([c for c in backward if c.kind != "all_reduce"]) == 4 * layers + 2
    norms = [c for c in backward if c.kind == "all_reduce"]
    assert len(norms) == 2 * layers + 1
    assert {(c.input_bytes, c.sent_bytes) for c in norms} == {(64 * 4, 64 * 4)}
    # (B, T, dim) = (2, 128, 64) in fp32: a sequence shard is 32 KiB, the whole 64 KiB.
    shard, whole = 2 * 64 * 64 * 4, 2 * 128 * 64 * 4
    gathers = {c.input_bytes for c in tp if c.kind == "all_gather" and c.group != "output"}
    assert gathers == {shard}
    assert {c.input_bytes for c in tp if c.kind == "reduce_scatter"} == {whole}
    logits = [c for c in forward if c.group == "output"][-1]
    assert (logits.kind, logits.input_bytes) == ("all_gather", 2 * 128 * 500 * 4)
    assert "layers.3.feed_forward.w2" in {c.group for c in tp}  # "layers.*" matched each
    # Bytes per axis add up; the theory compares the data-parallel ones only.
    by_axis = result.sent_bytes_by_axis
    assert by_axis["tp"] == sum(c.sent_bytes for c in tp)
    assert sum(by_axis.values()) == result.sent_bytes_per_step
    assert result.sent_over_theory == pytest.approx(by_axis["dp"] / result.theory_sent_bytes)
    assert {c.axis for c in result.collectives} == {"dp", "tp"}
    assert result.to_dict()["sent_bytes_by_axis"] == by_axis


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"tp_plan": None}, ValueError, "no tp_plan says what to shard"),
        ({"inputs": None}, ValueError, "tp_plan needs inputs"),
        ({"tp_plan": {"nothing.*": ColwiseParallel()}}, ValueError, "matches no module"),
        ({"tp_plan": {"a": _OUTPUT_STYLE}}, ValueError, "PrepareModuleOutput on a is not modelled"),
        ({"tp_plan": {"a": "colwise"}}, TypeError, "not a ParallelStyle"),
        ({"tp_plan": 3}, TypeError, "dict of ParallelStyles"),
        ({"tp_degree": 0}, ValueError, "positive int"),
    ],
)
def test_bad_tp_options_are_refused(
    overrides: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        _tp_plan("mlp", **overrides)


def test_unplannable_meshes_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="tp_degree 4 does not divide the world size 6"):
        _tp_plan("mlp", world_size=6, tp_degree=4)
    with pytest.raises(ValueError, match=r"mesh_shape \(2, 2\) x tp_degree 2 has 8 ranks"):
        _tp_plan("mlp", mesh_shape=(2, 2))
    # A head of 3 outputs over 4 ranks: DTensor would gather its weight inside the matmul.
    with pytest.raises(ValueError, match=r"head\.weight shards dim 0 of size 3 over tp_degree 4"):
        _tp_plan("sp", tp_degree=4)
    with pytest.raises(ValueError, match=r"nn\.Linear and nn\.Embedding only"):
        _tp_plan("sp", tp_plan={"norm": ColwiseParallel()})
