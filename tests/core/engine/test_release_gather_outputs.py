"""torch 2.15's third all-gather hook: the all-gather outputs released after the post hook.

``fsdp_should_release_all_gather_outputs_after_post_all_gather``: a tensor subclass whose post
hook builds new tensors (torchao's MXFP8 does) may declare that the raw all-gather outputs are
no longer needed once the post hook has run; the engine then frees their memory there instead
of at reshard. What this changes is memory while a group stays unsharded, so the tests look at
the outputs' storage after forward with ``reshard_after_forward=False``, and train against
torch's ``fully_shard``. torch releases before 2.15 ignore the hook (their outputs stay until
reshard); shardkit honours it on every release, and the values are the same either way.
Misdeclared hooks fail as torch's do.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.pool import run_on_ranks
from tests.core import quant_support as qs
from tests.core.parity import fully_shard_of, global_loss, rank_batch

HOOK = "fsdp_should_release_all_gather_outputs_after_post_all_gather"


def _torch_honours_the_hook() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    return hasattr(_fsdp_param.FSDPParam, "_release_all_gather_outputs_if_needed")


def _outputs_freed() -> list[bool]:
    """Per parameter built by a post hook: whether its all-gather outputs' memory is freed."""
    return [all(t.untyped_storage().size() == 0 for t in outs) for _, outs in qs.GATHERED]


def _values_held() -> bool:
    return all(values.untyped_storage().size() > 0 for values, _ in qs.GATHERED)


def _plain(value: torch.Tensor) -> torch.Tensor:
    return value.plain() if isinstance(value, qs.QuantData) else value.detach().clone()


def _train_body(rank: int, world_size: int, tensor: str, impl: str) -> dict[str, Any]:
    qs.reset_records()
    model = qs.build("sharded", tensor_cls=getattr(qs, tensor))
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard_of(impl)(block, mesh=mesh, reshard_after_forward=False)
    fully_shard_of(impl)(model, mesh=mesh, reshard_after_forward=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses: list[float] = []
    after_forward: list[list[bool]] = []
    for step in range(3):
        x, y = rank_batch("mlp", step, rank, world_size, impl)
        loss = nn.functional.mse_loss(model(x).float(), y)
        # The groups stay unsharded until backward: their post hooks have run, and the
        # values they built are what forward used.
        after_forward.append(_outputs_freed())
        assert _values_held()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, impl, world_size))
    params = {n: _plain(cast(DTensor, p).full_tensor()) for n, p in model.named_parameters()}
    return {
        "losses": losses,
        "after_forward": after_forward,
        "params": params,
        "calls": dict(qs.CALLS),
    }


@pytest.mark.parametrize("tensor", ["ReleasingQuantTensor", "KeepingQuantTensor"])
def test_outputs_are_freed_after_the_post_hook_only_when_declared(tensor: str) -> None:
    ours = run_on_ranks(2, _train_body, tensor=tensor, impl="shardkit")[0]
    theirs = run_on_ranks(2, _train_body, tensor=tensor, impl="torch")[0]
    declared = tensor == "ReleasingQuantTensor"
    # Two quantized Linears per block, two blocks: four parameters built by the post hook,
    # then refilled (out=) at each later unshard; the release follows both calls.
    assert len(ours["after_forward"][0]) == 4
    assert ours["after_forward"] == [[declared] * 4] * 3
    if _torch_honours_the_hook():  # torch >= 2.15: the same memory as torch's
        assert theirs["after_forward"] == ours["after_forward"]
    else:  # older torch keeps them until reshard whatever the hook says
        assert theirs["after_forward"] == [[False] * 4] * 3
    # The values do not depend on when the outputs go: bit for bit torch's at W=2.
    assert ours["losses"] == theirs["losses"]
    assert ours["calls"] == theirs["calls"] and ours["calls"]["post_out"] > 0
    for name, value in ours["params"].items():
        assert torch.equal(value, theirs["params"][name]), name


def _error_body(rank: int, world_size: int, tensor: str, impl: str) -> dict[str, Any]:
    model = qs.build("sharded", tensor_cls=getattr(qs, tensor))
    mesh = init_device_mesh("cpu", (world_size,))
    try:
        for block in model.blocks:
            fully_shard_of(impl)(block, mesh=mesh)
        fully_shard_of(impl)(model, mesh=mesh)
        model(rank_batch("mlp", 0, rank, world_size, impl)[0])
    except AssertionError as error:
        return {"message": str(error), "untouched": type(model) is qs.QuantNet}
    return {"message": "no error"}


@pytest.mark.parametrize(
    ("tensor", "torch_text"),
    [
        ("NonBoolReleaseTensor", f"{HOOK} must return a bool, got <class 'int'>"),
        (
            "ReleaseOnlyTensor",
            f"{HOOK} requires fsdp_pre_all_gather and fsdp_post_all_gather to be defined",
        ),
    ],
)
def test_a_misdeclared_release_hook_fails_as_torch_at_fully_shard(
    tensor: str, torch_text: str
) -> None:
    ours = run_on_ranks(1, _error_body, tensor=tensor, impl="shardkit")[0]
    # torch's text first, then the parameter; refused before the model changed.
    assert ours["message"].startswith(torch_text), ours["message"]
    assert "fc1.weight" in ours["message"] and ours["untouched"]
    if _torch_honours_the_hook():
        theirs = run_on_ranks(1, _error_body, tensor=tensor, impl="torch")[0]
        assert theirs["message"].startswith(torch_text)
