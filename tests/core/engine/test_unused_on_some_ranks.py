"""Parameters used on some ranks only train as data parallel training says, with no setting.

Experts in one sharded module: rank 0 routes tokens to experts 0 and 1, rank 1 to expert 0
only, and no rank to expert 2. Missing gradients are reduced as zeros, so the ranks'
reductions agree and expert 1 gets the mean of rank 0's gradient and rank 1's zeros; expert 2,
which no rank used, keeps ``grad`` None on every rank, as torch gives it (the step check's
exchange tells which parameters no rank used). torch's ``fully_shard`` runs beside as the
control: its ranks reduce gradients of different sizes.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tests.core.parity import fully_shard_of
from tests.core.replica_oracle import ReplicaTraining, Turn, plain, sgd, train_replicas

DIM, EXPERTS, STEPS, LR = 6, 3, 3, 0.1


class Experts(nn.Module):
    """A trunk, then one expert per token as routed (an expert no token needs never runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, routes: list[int]) -> torch.Tensor:
        h = self.trunk(x)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = [i for i, r in enumerate(routes) if r == e]
            if rows:
                index = torch.tensor(rows)
                out = out.index_add(0, index, expert(h[index]))
        return out


def _make() -> nn.Module:
    torch.manual_seed(11)
    return Experts()


def _routes(rank: int, step: int, world_size: int = 2) -> list[int]:
    # W=2: rank 0 uses experts 0 and 1; rank 1 expert 0 only (expert 1 on step 2 too); none
    # uses 2. W=4 (HSDP, 2 x 2): expert 1 on rank 3 alone, which is in neither rank 0's shard
    # group nor its replicate group: the flags must cross both.
    if world_size == 4:
        return [0, 1, 0, 1] if rank == 3 else [0, 0, 0, 0]
    if rank == 0:
        return [0, 1, 0, 1]
    return [0, 0, 1, 0] if step == 2 else [0, 0, 0, 0]


def _loss(model: nn.Module, rank: int, step: int, world_size: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, DIM, generator=gen)
    return cast(torch.Tensor, model(x, _routes(rank, step, world_size)).pow(2).mean())


def _train(impl: str, rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    model = _make()
    fully_shard_of(impl)(model.trunk, mesh=mesh)
    fully_shard_of(impl)(model, mesh=mesh)  # the experts: one group, one reduction
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    first: dict[str, Any] = {}
    world_size = mesh.size()
    for step in range(STEPS):
        _loss(model, rank, step, world_size).backward()
        if step == 0:
            first = plain({n: p.grad for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"first": first, "params": plain(dict(model.named_parameters()))}


def _body(rank: int, world_size: int) -> dict[str, Any]:
    shape = (2, 2) if world_size == 4 else (world_size,)
    names = ("replicate", "shard") if world_size == 4 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    ours = _train("shardkit", rank, mesh)

    def loss(model: nn.Module, turn: Turn) -> torch.Tensor:
        return _loss(model, turn.rank, turn.step, world_size)

    training = ReplicaTraining(
        make_model=_make, loss=loss, world_size=world_size, steps=STEPS, optimizer=sgd(LR)
    )
    run = train_replicas(training)
    return {"ours": ours, "oracle": {"first": run.grads[0], "params": run.params}}


@pytest.mark.parametrize("world_size", [2, 4], ids=["w2", "hsdp-2x2"])
def test_experts_unused_on_some_ranks_match_the_oracle(world_size: int) -> None:
    from harness.pool import run_on_ranks

    for result in run_on_ranks(world_size, _body):
        ours, oracle = result["ours"], result["oracle"]
        for name, expected in oracle["first"].items():
            got = ours["first"][name]
            if expected is None:
                assert got is None, f"{name}: no rank used it, yet it has a gradient"
            else:
                assert got is not None, name
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7, msg=name)
        assert ours["first"]["experts.2.weight"] is None
        assert ours["first"]["experts.1.weight"] is not None
        for name, expected in oracle["params"].items():
            torch.testing.assert_close(
                ours["params"][name], expected, rtol=1e-5, atol=1e-7, msg=name
            )


def torch_control(rank: int, world_size: int) -> str:
    """The program under torch's ``fully_shard`` (``tests.core.torch_control`` runs it)."""
    _train("torch", rank, init_device_mesh("cpu", (world_size,)))
    return "trained"


def test_torch_control_fails_on_the_same_program() -> None:
    from tests.core.torch_control import run_control

    outcome = run_control(f"{__name__}:torch_control")
    # torch reduces the gradients a rank has: 4 parameters' on rank 0, 2 on rank 1.
    assert not outcome.trained, outcome


class _Pair(nn.Module):
    """Two Linears (1 -> 5, no bias) in one list group; forward may skip the second."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(1, 5, bias=False)
        self.second = nn.Linear(1, 5, bias=False)

    def forward(self, x: torch.Tensor, use_second: bool = True) -> torch.Tensor:
        h = cast(torch.Tensor, self.first(x))
        return h + cast(torch.Tensor, self.second(x)) if use_second else h


def _deferred_body(rank: int, world_size: int) -> dict[str, Any]:
    from shardkit.core import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _Pair()
    fully_shard([model.first, model.second], mesh=mesh)
    sharded = cast(Any, fully_shard(model, mesh=mesh))
    sharded(torch.ones(1, 1)).sum().backward()  # a whole step first: the root initializes
    sharded.zero_grad(set_to_none=True)
    sharded.set_requires_all_reduce(False)  # each module alone, the all-reduce deferred
    sharded.first(torch.full((1, 1), 4.0)).sum().backward()
    sharded.second(torch.full((1, 1), 5.0)).sum().backward()
    sharded.set_requires_all_reduce(True)
    sharded(torch.full((1, 1), 2.0), use_second=False).sum().backward()  # second unused now
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {n: None if g is None else cast(Any, g).full_tensor() for n, g in grads.items()}


def test_a_gradient_carried_by_a_deferred_all_reduce_is_kept_when_unused_at_the_end() -> None:
    # torch's test_grad_dtype_pending_reductions (pending_grad, torch 2.15): the gradient of
    # a Linear's weight under sum() is its input, the same on every rank, so the means are
    # 4 + 2 and 5. The second module got no gradient in the backward that all-reduces, on any
    # rank: before, the automatic zeros' check gave it None, dropping its deferred 5.
    from harness.pool import run_on_ranks

    for grads in run_on_ranks(4, _deferred_body):
        assert torch.equal(grads["first.weight"], torch.full((5, 1), 6.0))
        assert grads["second.weight"] is not None
        assert torch.equal(grads["second.weight"], torch.full((5, 1), 5.0))
