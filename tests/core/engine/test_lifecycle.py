"""Meta-device construction, explicit unshard/reshard, exceptions mid-step, forward methods."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import Run, apply, full_params


def _meta_body(rank: int, world_size: int) -> dict[str, object]:
    """Both FSDPs built on meta, materialised with to_empty and initialised alike."""
    out: dict[str, object] = {}
    mesh = init_device_mesh("cpu", (world_size,))
    for impl in ("shardkit", "torch"):
        with torch.device("meta"):
            model: Any = models.TinyGPT()
        apply(impl, model, mesh, Run(model="gpt"))
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        model.scale.fill_(1.5)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(5):
            x, y = models.batch("gpt", step, 2 * world_size)
            loss = models.loss_of(
                "gpt", model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]
            )
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[impl] = (losses, full_params(model))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_meta_init_then_to_empty_matches_torch(world_size: int) -> None:
    results: list[Any] = run_on_ranks(world_size, _meta_body)
    ours, theirs = results[0]["shardkit"], results[0]["torch"]
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5)
    for name, value in ours[1].items():
        torch.testing.assert_close(value, theirs[1][name], rtol=1e-5, atol=1e-6)


def _meta_forward_error_body(rank: int, world_size: int) -> str:
    from shardkit.core import fully_shard

    with torch.device("meta"):
        model: Any = models.MLPNet()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    try:
        model(torch.randn(2, 5, 7))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_forward_on_meta_params_says_to_materialise() -> None:
    message = run_on_ranks(2, _meta_forward_error_body)[0]
    assert "meta device" in message and "to_empty" in message


def _unshard_reshard_body(rank: int, world_size: int) -> dict[str, bool]:
    model = models.build("gpt")
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply("shardkit", model, init_device_mesh("cpu", (world_size,)), Run(model="gpt"))
    handle = model.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    root_full = not isinstance(model.tok.weight, DTensor) and model.tok.weight.equal(
        reference["tok.weight"]
    )
    block_sharded = isinstance(model.blocks[0].ln1.weight, DTensor)  # not recursive
    model.blocks[0].unshard()
    block_full = model.blocks[0].attn.qkv.weight.equal(reference["blocks.0.attn.qkv.weight"])
    model.blocks[0].reshard()
    model.reshard()
    resharded = all(isinstance(p, DTensor) for p in model.parameters())
    return {
        "root_full": root_full,
        "block_sharded": block_sharded,
        "block_full": block_full,
        "resharded": resharded,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_unshard_and_reshard(world_size: int) -> None:
    results = run_on_ranks(world_size, _unshard_reshard_body)
    assert all(all(r.values()) for r in results), results


class _Boom(RuntimeError):
    pass


def _reset_body(rank: int, world_size: int, where: str) -> dict[str, list[float]]:
    """Step 2 fails in forward or backward; after reset_iter_state training goes on."""
    out: dict[str, list[float]] = {}
    for impl in ("shardkit", "local"):
        model = models.build("gpt")
        if impl != "local":
            apply(impl, model, init_device_mesh("cpu", (world_size,)), Run(model="gpt"))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(5):
            x, y = models.batch("gpt", step, 2 * world_size)
            if impl != "local":
                x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            if step == 2:
                if impl == "local":
                    continue
                try:
                    if where == "forward":
                        hook = model.blocks[1].register_forward_hook(
                            lambda *a: (_ for _ in ()).throw(_Boom())
                        )
                        model(x)
                    else:
                        out_t = model(x)
                        out_t.register_hook(lambda g: (_ for _ in ()).throw(_Boom()))
                        models.loss_of("gpt", out_t, y).backward()
                except _Boom:
                    if where == "forward":
                        hook.remove()
                    model.reset_iter_state()
                    opt.zero_grad()
                continue
            loss = models.loss_of("gpt", model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
            if impl != "local":
                dist.all_reduce(loss)
                loss /= world_size
            losses.append(loss.item())
        out[impl] = losses
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_reset_iter_state_after_exception(world_size: int, where: str) -> None:
    results = run_on_ranks(world_size, _reset_body, where=where)
    assert results[0]["shardkit"] == pytest.approx(results[0]["local"], rel=1e-5)


def _no_reset_body(rank: int, world_size: int, where: str) -> str:
    """An exception in backward, not followed by reset_iter_state: the next forward says so."""
    model = models.build("gpt")
    apply("shardkit", model, init_device_mesh("cpu", (world_size,)), Run(model="gpt"))
    x, y = models.batch("gpt", 0, 2)
    models.loss_of("gpt", model(x), y).backward()  # a healthy step first
    hook = model.get_submodule(where).register_forward_hook(
        lambda module, args, out: (
            out.register_hook(lambda g: (_ for _ in ()).throw(_Boom())) and None
        )
    )
    with contextlib.suppress(_Boom):
        models.loss_of("gpt", model(x), y).backward()
    hook.remove()
    try:
        models.loss_of("gpt", model(x), y).backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("where", ["blocks.0", "blocks.1", "head"])
def test_a_step_after_a_failed_backward_asks_for_reset_iter_state(where: str) -> None:
    # Depending on where backward failed, the next step used to fail with an internal state
    # error or `setStorage: ... out of bounds`, or run on with stale state.
    for message in run_on_ranks(2, _no_reset_body, where=where):
        assert "reset_iter_state()" in message, message


def _forward_method_body(rank: int, world_size: int, register: str) -> dict[str, bool]:
    # torch's own register_fsdp_forward_method (a library that imported it before any patch)
    # reads the state's forward hooks, which the torch-facing view serves.
    if register == "torch":
        from torch.distributed.fsdp import register_fsdp_forward_method
    else:
        from shardkit.core import register_fsdp_forward_method

    class WithEmbed(models.TinyGPT):
        def embed(self, idx: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.ln_f(self.tok(idx))
            return out

    torch.manual_seed(0)
    model: Any = WithEmbed()
    x, _ = models.batch("gpt", 0, 2)
    expected = model.embed(x)
    apply("shardkit", model, init_device_mesh("cpu", (world_size,)), Run(model="gpt"))
    register_fsdp_forward_method(model, "embed")
    got = model.embed(x)
    got.sum().backward()  # the method's backward reduces gradients too
    return {
        "equal": torch.allclose(got, expected, rtol=1e-6, atol=1e-6),
        "grad": isinstance(model.tok.weight.grad, DTensor),
        "resharded": isinstance(model.tok.weight, DTensor),
    }


@pytest.mark.parametrize(
    ("world_size", "register"), [(1, "shardkit"), (2, "shardkit"), (4, "shardkit"), (2, "torch")]
)
def test_register_fsdp_forward_method(world_size: int, register: str) -> None:
    results = run_on_ranks(world_size, _forward_method_body, register=register)
    assert all(all(r.values()) for r in results), results


def _hooks_after_assign_body(rank: int, world_size: int) -> list[str]:
    from shardkit.core import fully_shard

    torch.manual_seed(0)
    model = models.MLPNet()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    x, y = models.batch("mlp", 0, 2 * world_size)
    models.loss_of("mlp", model(x), y).backward()
    # New local tensors for every parameter: the groups rebuild their buffers and their
    # unsharded parameters, which need their gradient hooks again (not only the end-of-backward
    # callback), so that reductions still start while backward runs.
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    models.loss_of("mlp", model(x), y).backward()
    model(x)  # reshard_after_forward=False: the unsharded parameters stay registered
    return [
        name
        for name, p in model.blocks.named_parameters()
        if not getattr(p, "_post_accumulate_grad_hooks", None)
    ]


def test_unsharded_parameters_rebuilt_after_an_assign_load_keep_their_gradient_hooks() -> None:
    assert run_on_ranks(2, _hooks_after_assign_body)[0] == []
