"""An unused tensor-parallel (DTensor) parameter under FSDP x TP.

torch's ``fully_shard`` failed to reduce-scatter such a parameter with
``set_reduce_scatter_unused_params(True)``: its zero gradient was made a plain tensor beside
the group's DTensor gradients (pytorch#183040; torch 2.13 and later have the fix). shardkit
reduces it as zeros on every release, bit for bit as torch's fixed releases do; and, with its
automatic zero-fill (the step check on), a TP
parameter that only some data-parallel ranks use trains as data parallel replicas would.
Mesh (dp=2, tp=2): four ranks, TP ranks of one dp group run the same control flow.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from harness.pool import run_on_ranks
from tests.core.parity import fully_shard_of
from tests.core.replica_oracle import ReplicaTraining, Turn, plain, sgd, train_replicas

STEPS, LR, PER_RANK = 3, 0.1, 2


class WithSpare(nn.Module):
    """A column/row-parallel pair, and a column-parallel ``spare`` added in when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.spare = nn.Linear(4, 6)
        self.b = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, use_spare: bool) -> torch.Tensor:
        h = self.a(x)
        if use_spare:
            h = h + self.spare(x)
        return cast(torch.Tensor, self.b(F.relu(h)))


def _make() -> WithSpare:
    torch.manual_seed(5)
    return WithSpare()


def _batch(dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randn(PER_RANK, 4, generator=gen), torch.randn(PER_RANK, 5, generator=gen)


def _uses_spare(mode: str, dp_rank: int, step: int) -> bool:
    # "never": no rank uses it; "some": dp rank 0 at even steps only.
    return mode == "some" and dp_rank == 0 and step % 2 == 0


def _loss(model: nn.Module, mode: str, dp_rank: int, step: int) -> torch.Tensor:
    x, y = _batch(dp_rank, step)
    return F.mse_loss(model(x, _uses_spare(mode, dp_rank, step)), y)


def _train(impl: str, mode: str, explicit: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _make()
    plan = {
        "a": ColwiseParallel(),
        "spare": ColwiseParallel(),
        "b": RowwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh["tp"], plan)
    fully_shard_of(impl)(model, mesh=mesh["dp"])
    if explicit:
        cast(Any, model).set_reduce_scatter_unused_params(True)
    dp_rank = mesh.get_local_rank("dp")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    first: dict[str, Any] = {}
    for step in range(STEPS):
        _loss(model, mode, dp_rank, step).backward()
        if step == 0:
            first = plain({n: p.grad for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    params = plain({n: p for n, p in model.named_parameters()})
    return {"first": first, "params": params}


def _body(rank: int, world_size: int, mode: str, explicit: bool, impls: tuple[str, ...]) -> Any:
    out: dict[str, Any] = {}
    for impl in impls:
        try:
            out[impl] = _train(impl, mode, explicit)
        except Exception as error:  # torch before the fix: a mixed Tensor/DTensor error
            out[impl] = f"{type(error).__name__}: {error}"

    def loss(model: nn.Module, turn: Turn) -> torch.Tensor:
        return _loss(model, mode, turn.rank, turn.step)

    training = ReplicaTraining(
        make_model=_make, loss=loss, world_size=2, steps=STEPS, optimizer=sgd(LR)
    )
    run = train_replicas(training)
    out["oracle"] = (run.grads[0], run.params)
    return out


def _torch_has_the_fix() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    return hasattr(_fsdp_param.FSDPParam, "unsharded_zero_grad_data")


def _match_oracle(ours: dict[str, Any], oracle: tuple[dict[str, Any], dict[str, Any]]) -> None:
    first, params = oracle
    for name, expected in first.items():
        got = ours["first"][name]
        if expected is None:
            assert got is None, f"{name}: no rank used it, yet it has a gradient"
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7, msg=name)
    for name, expected in params.items():
        torch.testing.assert_close(ours["params"][name], expected, rtol=1e-5, atol=1e-7, msg=name)


def test_unused_tp_param_with_reduce_scatter_unused_params_as_torch() -> None:
    results = run_on_ranks(4, _body, mode="never", explicit=True, impls=("shardkit", "torch"))
    for result in results:
        ours, theirs = result["shardkit"], result["torch"]
        assert isinstance(ours, dict), ours
        # torch's meaning of the setting: the unused parameter is reduced, its gradient zeros.
        spare = ours["first"]["spare.weight"]
        assert spare is not None and not spare.any()
        for name in ("a.weight", "b.weight", "b.bias"):
            torch.testing.assert_close(
                ours["first"][name], result["oracle"][0][name], rtol=1e-5, atol=1e-7
            )
        for name, expected in result["oracle"][1].items():
            torch.testing.assert_close(ours["params"][name], expected, rtol=1e-5, atol=1e-7)
        if _torch_has_the_fix():  # before it torch fails here: no oracle (2.10 to 2.12)
            assert isinstance(theirs, dict), theirs
            for name, value in ours["first"].items():
                assert torch.equal(value, theirs["first"][name]), name
            for name, value in ours["params"].items():
                assert torch.equal(value, theirs["params"][name]), name


def test_tp_param_used_on_some_dp_ranks_trains_as_replicas() -> None:
    # The automatic zero-fill: no setting; dp rank 1 never runs ``spare``, dp rank 0 at
    # steps 0 and 2. torch's engine would pair different reductions here (not run).
    for result in run_on_ranks(4, _body, mode="some", explicit=False, impls=("shardkit",)):
        assert isinstance(result["shardkit"], dict), result["shardkit"]
        _match_oracle(result["shardkit"], result["oracle"])
        assert result["shardkit"]["first"]["spare.weight"] is not None


def test_tp_param_no_rank_uses_keeps_no_gradient() -> None:
    for result in run_on_ranks(4, _body, mode="never", explicit=False, impls=("shardkit",)):
        assert isinstance(result["shardkit"], dict), result["shardkit"]
        _match_oracle(result["shardkit"], result["oracle"])
        assert result["shardkit"]["first"]["spare.weight"] is None  # as torch leaves it
