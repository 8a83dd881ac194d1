"""load_state_dict: all or nothing, partial, full tensors, assign on meta, offload checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply, full_params


def _sharded(world_size: int, impl: str = "shardkit", seed: int = 0, **kw: Any) -> Any:
    model = models.build("gpt", seed=seed)
    apply(impl, model, init_device_mesh("cpu", (world_size,)), Run(model="gpt", **kw))
    return model


def _snapshot(model: Any) -> dict[str, tuple[int, torch.Tensor]]:
    return {
        n: (p.to_local().data_ptr(), p.to_local().detach().clone())
        for n, p in model.named_parameters()
    }


def _unchanged(model: Any, snap: dict[str, tuple[int, torch.Tensor]]) -> bool:
    return all(
        p.to_local().data_ptr() == snap[n][0] and p.to_local().equal(snap[n][1])
        for n, p in model.named_parameters()
    )


def _bad_load_body(rank: int, world_size: int, impl: str) -> dict[str, Any]:
    model = _sharded(world_size, impl)
    good = _sharded(world_size, impl, seed=3).state_dict()
    bad = dict(good)
    bad["blocks.0.attn.qkv.weight"] = torch.zeros(5, 5)  # wrong shape
    bad["ln_f.weight"] = good["ln_f.weight"].to("meta")  # no data
    del bad["head.weight"]  # missing
    bad["extra.weight"] = torch.zeros(2)  # unexpected
    return _attempt_load(model, bad)


def _attempt_load(model: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Load ``state_dict``: the error message ("no error") and whether nothing changed."""
    snap = _snapshot(model)
    try:
        model.load_state_dict(state_dict)
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    return {"message": message, "unchanged": _unchanged(model, snap)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_failed_load_lists_every_key_and_changes_nothing(world_size: int) -> None:
    result = run_on_ranks(world_size, _bad_load_body, impl="shardkit")[0]
    message = result["message"]
    for key in ["blocks.0.attn.qkv.weight", "ln_f.weight", "head.weight", "extra.weight"]:
        assert key in message, message
    assert "(48, 16)" in message and "(5, 5)" in message  # expected and found shapes
    assert "meta tensor" in message and "nothing was loaded" in message
    assert result["unchanged"]


def test_torch_fully_shard_writes_before_raising() -> None:
    # The behaviour we improve on: torch's fully_shard has modified parameters when it raises.
    result = run_on_ranks(2, _bad_load_body, impl="torch")[0]
    assert result["message"] != "no error"
    assert not result["unchanged"]


def _one_bad_value_body(rank: int, world_size: int, bad: str) -> dict[str, Any]:
    model = _sharded(world_size)
    sd = dict(_sharded(world_size, seed=3).state_dict())
    key = "head.weight"  # the last key: every other one would be written before it fails
    if bad == "meta":
        sd[key] = sd[key].full_tensor().to("meta")
    elif bad == "meta_dtensor":
        sd[key] = sd[key].to("meta")
    else:  # a DTensor on another mesh: (1, W) instead of (W,)
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("a", "b"))
        sd[key] = distribute_tensor(sd[key].full_tensor(), mesh, [Replicate(), Shard(0)])
    return _attempt_load(model, sd)


@pytest.mark.parametrize("bad", ["meta", "meta_dtensor", "other_mesh"])
def test_a_value_that_cannot_be_copied_is_refused_before_any_write(bad: str) -> None:
    for result in run_on_ranks(2, _one_bad_value_body, bad=bad):
        assert "head.weight" in result["message"], result["message"]
        assert "nothing was loaded" in result["message"]
        assert result["unchanged"]


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _bf16_body(rank: int, world_size: int, impl: str, full: bool) -> dict[str, Any]:
    model = _sharded(world_size, impl)
    source = _sharded(world_size, impl, seed=3).state_dict()
    sd = {k: (_full(v) if full else v).to(torch.bfloat16) for k, v in source.items()}
    model.load_state_dict(sd)
    params = full_params(model)
    expected = {k: _full(v).float() for k, v in sd.items()}
    return {
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "converted": all(params[k].equal(expected[k]) for k in params),
    }


@pytest.mark.parametrize(
    ("impl", "full"), [("torch", False), ("shardkit", False), ("shardkit", True)]
)
def test_bf16_state_dict_loads_into_fp32_model_as_torch_does(impl: str, full: bool) -> None:
    # torch converts (its own fully_shard refuses plain full tensors of any dtype: not run).
    for result in run_on_ranks(2, _bf16_body, impl=impl, full=full):
        assert result == {"dtypes": ["torch.float32"], "converted": True}, result


def _other_model_body(rank: int, world_size: int) -> str:
    model = _sharded(world_size)
    other = models.build("mlp")
    apply("shardkit", other, init_device_mesh("cpu", (world_size,)), Run(model="mlp"))
    try:
        model.load_state_dict(other.state_dict())
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_checkpoint_of_another_model_is_refused() -> None:
    message = run_on_ranks(2, _other_model_body)[0]
    assert "tok.weight: missing" in message and "inp.weight: unexpected" in message


def _partial_and_full_body(rank: int, world_size: int) -> dict[str, bool]:
    model = _sharded(world_size)
    reference = models.build("gpt", seed=5)
    full_sd = reference.state_dict()  # plain full tensors, as a single process saves them
    before = full_params(model)
    partial = {k: v for k, v in full_sd.items() if k.startswith("blocks.0.")}
    model.load_state_dict(partial, strict=False)
    after_partial = full_params(model)
    loaded_only_partial = all(
        after_partial[k].equal(full_sd[k]) if k in partial else after_partial[k].equal(before[k])
        for k in after_partial
    )
    model.load_state_dict(full_sd)
    loaded_full = all(v.equal(full_sd[k]) for k, v in full_params(model).items())
    x, y = models.batch("gpt", 0, 2)
    expected = models.loss_of("gpt", reference(x), y)
    got = models.loss_of("gpt", model(x), y)
    return {
        "partial": loaded_only_partial,
        "full": loaded_full,
        "forward": torch.allclose(got, expected, rtol=1e-5),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_partial_and_plain_full_tensor_loads(world_size: int) -> None:
    results = run_on_ranks(world_size, _partial_and_full_body)
    assert all(all(r.values()) for r in results), results


def _assign_on_meta_body(rank: int, world_size: int) -> dict[str, bool]:
    source = _sharded(world_size, seed=9)
    sd = {k: v.detach() for k, v in source.state_dict().items()}
    with torch.device("meta"):
        model: Any = models.TinyGPT()
    apply("shardkit", model, init_device_mesh("cpu", (world_size,)), Run(model="gpt"))
    keys = list(sd)
    half = len(keys) // 2
    model.load_state_dict({k: sd[k] for k in keys[:half]}, strict=False, assign=True)
    still_meta = any(p.is_meta for p in model.parameters())
    model.load_state_dict({k: sd[k] for k in keys[half:]}, strict=False, assign=True)
    x, y = models.batch("gpt", 0, 2)
    loss = models.loss_of("gpt", model(x), y)
    loss.backward()
    expected = models.loss_of("gpt", source(x), y)
    return {
        "partly_meta_between": still_meta,
        "forward_matches": torch.allclose(loss, expected, rtol=1e-6),
        "grads": all(isinstance(p.grad, DTensor) for p in model.parameters()),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_assign_on_meta_piece_by_piece(world_size: int) -> None:
    results = run_on_ranks(world_size, _assign_on_meta_body)
    assert all(all(r.values()) for r in results), results


def _offload_device_body(rank: int, world_size: int) -> str:
    from shardkit.core import CPUOffloadPolicy

    model = _sharded(world_size, shard_kwargs={"offload_policy": CPUOffloadPolicy()})
    sd = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }
    sd["ln_f.bias"] = torch.empty(16, device="meta")
    sd["head.weight"] = torch.empty(37, 16, device="meta")
    try:
        model.load_state_dict(sd)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_offload_refuses_tensors_off_the_cpu() -> None:
    message = run_on_ranks(2, _offload_device_body)[0]
    assert "ln_f.bias: device mismatch" in message and "head.weight: device mismatch" in message
