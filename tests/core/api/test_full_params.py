"""full_params: full parameters registered for a while, and written back into the shards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply, full_params, make_mesh


def _sharded(name: str, world_size: int, hsdp: tuple[int, int] | None = None, **kw: Any) -> Any:
    model = models.build(name, seed=2)
    run = Run(model=name, hsdp=hsdp, shard_kwargs=kw)
    apply("shardkit", model, make_mesh(run, world_size), run)
    return model


def _writeback_body(rank: int, world_size: int, hsdp: tuple[int, int] | None) -> dict[str, Any]:
    from shardkit.core import MixedPrecisionPolicy
    from shardkit.core import full_params as core_full_params

    expected = dict(models.build("gpt_tied", seed=2).named_parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = _sharded("gpt_tied", world_size, hsdp, mp_policy=mp)
    out: dict[str, Any] = {}
    with core_full_params(model):
        seen = dict(model.named_parameters())
        out["plain"] = all(type(p) is torch.nn.Parameter for p in seen.values())
        out["equal"] = all(torch.equal(p, expected[n]) for n, p in seen.items())
        # The tied head and embedding stay one Parameter.
        out["tied"] = model.head.weight is model.tok.weight
        with torch.no_grad():
            for p in seen.values():
                p.mul_(2)
    after = full_params(model)
    out["doubled"] = all(torch.equal(after[n], 2 * expected[n]) for n in after)
    out["sharded_again"] = all(isinstance(p, DTensor) for p in model.parameters())
    with core_full_params(model, writeback=False), torch.no_grad():
        for p in model.parameters():
            p.zero_()
    out["discarded"] = all(torch.equal(full_params(model)[n], after[n]) for n in after)
    # Training goes on after it: a forward and backward with the shards registered.
    x, _ = models.batch("gpt_tied", 0, 2)
    model(x).sum().backward()
    out["trains"] = all(p.grad is not None for p in model.parameters())
    return out


@pytest.mark.parametrize(("world_size", "hsdp"), [(2, None), (4, (2, 2))])
def test_full_parameters_inside_and_edits_written_back(
    world_size: int, hsdp: tuple[int, int] | None
) -> None:
    for rank, out in enumerate(run_on_ranks(world_size, _writeback_body, hsdp=hsdp)):
        assert out == dict.fromkeys(out, True), (rank, out)


def _options_body(rank: int, world_size: int) -> dict[str, Any]:
    from shardkit.core import full_params as core_full_params

    model = _sharded("mlp", world_size)
    x, y = models.batch("mlp", 0, 2)
    models.loss_of("mlp", model(x), y).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    out: dict[str, Any] = {}
    with core_full_params(model, rank0_only=True, writeback=False, offload_to_cpu=True):
        params = list(model.parameters())
        out["rank0_only_full"] = all(type(p) is torch.nn.Parameter for p in params)
        out["rank0_only_sharded"] = all(isinstance(p, DTensor) for p in params)
    with core_full_params(model, with_grads=True, writeback=False):
        named = dict(model.named_parameters())
        out["grads"] = all(torch.equal(p.grad, grads[n]) for n, p in named.items())
    with core_full_params(model.blocks[0], recurse=False, writeback=False):
        out["own_only"] = [
            type(p) is torch.nn.Parameter for p in (model.blocks[0].fc1.weight, model.head.weight)
        ]
    nested = pytest.raises(RuntimeError, match="already has its full parameters registered")
    with nested, core_full_params(model), core_full_params(model.blocks[1]):
        pass
    both = pytest.raises(ValueError, match="writeback=True and rank0_only=True")
    with both, core_full_params(model, rank0_only=True):
        pass
    with pytest.raises(TypeError, match="Linear is not sharded"), core_full_params(nn.Linear(2, 2)):
        pass
    out["sharded_after_errors"] = all(isinstance(p, DTensor) for p in model.parameters())
    return out


def test_rank0_only_offload_grads_and_errors() -> None:
    zero, one = run_on_ranks(2, _options_body)
    assert zero["rank0_only_full"] and not zero["rank0_only_sharded"]
    assert one["rank0_only_sharded"] and not one["rank0_only_full"]
    for out in (zero, one):
        assert out["grads"] and out["own_only"] == [True, False] and out["sharded_after_errors"]
