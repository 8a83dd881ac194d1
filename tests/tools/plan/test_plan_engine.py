"""The planner's collectives are the engine's: same calls, same order, same bytes (W=1, 2, 4)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from shardkit.tools.plan.examples import Llama, LlamaConfig
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.planner import plan
from tests.core import models

Call = tuple[str, int, int, int]  # (kind, group size, input bytes, sent bytes)

_LLAMA = LlamaConfig(
    dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=131, vocab_size=101, max_seq_len=32
)


def _build(name: str) -> Any:
    if name == "llama":
        torch.manual_seed(0)
        return Llama(_LLAMA)
    model = models.build(name)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            for param in module.parameters():
                param.keep_own_dtype = True  # type: ignore[attr-defined]  # for _keep_norms
    return model


def _batch(name: str, step: int) -> torch.Tensor:
    if name == "llama":
        return torch.randint(0, _LLAMA.vocab_size, (2, 16))
    return models.batch(name, step, 2)[0]


def _blocks(model: Any) -> list[nn.Module]:
    return list(model.layers if isinstance(model, Llama) else model.blocks)


def _freeze(model: Any, what: str | None) -> None:
    """'block0': the first block's parameters; 'bottom': also everything before it, so that
    the first block's output needs no gradient and the engine never gathers it in backward."""
    if what is None:
        return
    frozen = list(_blocks(model)[0].parameters())
    if what == "bottom":
        frozen += [*model.tok.parameters(), *model.pos.parameters()]
    for param in frozen:
        param.requires_grad_(False)


def _engine_calls(rank: int, world_size: int, name: str, options: dict[str, Any]) -> list[Call]:
    """The CollectiveEvents of the second training step (the first has no forward order)."""
    from shardkit.core import CollectiveEvent, MixedPrecisionPolicy, fully_shard, subscribe

    model = _build(name)
    _freeze(model, options.get("freeze"))
    mesh_shape = options.get("mesh_shape")
    if mesh_shape is None:
        mesh = init_device_mesh("cpu", (world_size,))
    else:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    mp = MixedPrecisionPolicy(
        param_dtype=options.get("param_dtype"),
        reduce_dtype=options.get("reduce_dtype"),
        param_dtype_override_fn=options.get("override"),
    )
    raf = options.get("raf")
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calls: list[Call] = []
    for step in range(2):
        calls.clear()

        def record(event: object) -> None:
            if isinstance(event, CollectiveEvent):
                calls.append((event.kind, event.group_size, event.input_bytes, event.sent_bytes))

        unsubscribe = subscribe(record)
        model(_batch(name, step)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        unsubscribe()
    return list(calls)


def _planned(world_size: int, name: str, options: dict[str, Any], traced: bool) -> list[Call]:
    with torch.device("meta"):
        model = _build(name)
    _freeze(model, options.get("freeze"))
    inputs = None
    if traced:
        example = _batch(name, 0)
        inputs = lambda: example.to("meta")  # noqa: E731
    result = plan(
        model,
        world_size=world_size,
        options=PlanOptions(
            mesh_shape=options.get("mesh_shape"),
            reshard_after_forward=options.get("raf"),
            param_dtype=options.get("param_dtype"),
            reduce_dtype=options.get("reduce_dtype"),
            param_dtype_override_fn=options.get("override"),
            inputs=inputs,
            backend="gloo",
        ),
    )
    return [(c.kind, c.group_size, c.input_bytes, c.sent_bytes) for c in result.schedule]


def _keep_norms(param: nn.Parameter) -> torch.dtype | None:
    """LayerNorms' parameters stay in their own dtype (CPU's layer norm takes fp32 weights
    with bf16 inputs). Marked on the parameter by ``_build``, so the engine's model and the
    planner's meta model get the same answer."""
    return param.dtype if getattr(param, "keep_own_dtype", False) else None


CASES = [
    (2, "gpt", {}, True),
    (2, "mlp", {"raf": True, "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}, False),
    (2, "llama", {"param_dtype": torch.bfloat16}, True),
    (4, "mlp", {"raf": False, "param_dtype": torch.bfloat16}, True),
    (4, "gpt", {"raf": True, "reduce_dtype": torch.bfloat16}, False),
    (4, "gpt", {"mesh_shape": (2, 2)}, True),
    (4, "llama", {"raf": True}, False),
    (2, "mlp", {"freeze": "block0"}, True),
    (2, "gpt", {"freeze": "bottom"}, True),
    (
        2,
        "gpt",
        {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "override": _keep_norms},
        True,
    ),
]


@pytest.mark.parametrize(("world_size", "name", "options", "traced"), CASES)
def test_planned_collectives_are_the_engines(
    world_size: int, name: str, options: dict[str, Any], traced: bool
) -> None:
    engine = run_on_ranks(world_size, _engine_calls, name=name, options=options)
    assert all(calls == engine[0] for calls in engine), "ranks disagree"
    assert _planned(world_size, name, options, traced) == engine[0]


def test_one_rank_sends_nothing() -> None:
    engine = run_on_ranks(1, _engine_calls, name="gpt", options={})[0]
    # At W=1 the full parameters are the shards themselves: the engine issues no collective,
    # as the plan says.
    assert engine == []
    assert _planned(1, "gpt", {}, traced=False) == []
