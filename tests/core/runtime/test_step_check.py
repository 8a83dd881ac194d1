"""The step check, on by default: collectives of different modules never pair silently.

Two sharded blocks of the same shape, run as B(A(x)) on rank 0 and A(B(x)) on rank 1: their
all-gathers have the same size, so rank 0's gather of A meets rank 1's gather of B and both go
on with the wrong parameters. The check compares every rank's collectives at the end of
backward (or of a forward no backward follows) and raises on every rank, naming each rank's
module, before the optimizer step. torch's ``fully_shard`` runs beside as the control.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardkit.core import DesyncError, set_step_checks
from tests.core.parity import fully_shard_of
from tests.core.replica_oracle import Grads, ReplicaTraining, Turn, plain, sgd, train_replicas

DIM = 8


class Swapped(nn.Module):
    """Two blocks of one shape; the order they run in is the caller's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return cast(torch.Tensor, self.head(x))


def _make() -> nn.Module:
    torch.manual_seed(3)
    return Swapped()


def _order(rank: int) -> tuple[int, int]:
    return (0, 1) if rank == 0 else (1, 0)


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
    return cast(torch.Tensor, model(x, _order(rank)).pow(2).mean())


def _oracle_grads(world_size: int) -> Grads:
    """The first step's gradient of unsharded replicas, each rank's blocks in its order."""

    def loss(model: nn.Module, turn: Turn) -> torch.Tensor:
        return _loss(model, turn.rank, turn.step)

    training = ReplicaTraining(
        make_model=_make, loss=loss, world_size=world_size, steps=1, optimizer=sgd(0.1)
    )
    return train_replicas(training).grads[0]


def _sharded(impl: str, world_size: int) -> nn.Module:
    model = _make()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in cast(nn.ModuleList, model.blocks):
        fully_shard_of(impl)(block, mesh=mesh)
    fully_shard_of(impl)(model, mesh=mesh)
    return model


def _train_body(rank: int, world_size: int, checks: bool) -> dict[str, Any]:
    model = _sharded("shardkit", world_size)
    before = plain(dict(model.named_parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    set_step_checks(checks)
    try:
        _loss(model, rank, 0).backward()
        opt.step()
        outcome = "trained"
    except DesyncError as error:
        outcome = str(error)
    finally:
        set_step_checks(True)
    grads = _oracle_grads(world_size)
    after = plain(dict(model.named_parameters()))
    moved = any(not torch.equal(before[n], after[n]) for n in before)
    expected = {n: before[n] - 0.1 * g for n, g in grads.items() if g is not None}
    wrong = max((after[n] - v).abs().max().item() for n, v in expected.items())
    return {"outcome": outcome, "moved": moved, "wrong": wrong}


def test_blocks_run_in_other_orders_raise_on_every_rank_before_the_optimizer_step() -> None:
    from harness.pool import run_on_ranks

    results = run_on_ranks(2, _train_body, checks=True)
    for rank, result in enumerate(results):
        message = result["outcome"]
        assert message != "trained", f"rank {rank} trained on mismatched collectives"
        assert "rank 0: all-gather of blocks.0 in forward" in message, message
        assert "rank 1: all-gather of blocks.1 in forward" in message, message
        assert not result["moved"], f"rank {rank}: the optimizer stepped on wrong gradients"
    assert results[0]["outcome"] == results[1]["outcome"]


def test_without_the_check_the_same_program_trains_silently_wrong() -> None:
    from harness.pool import run_on_ranks

    for result in run_on_ranks(2, _train_body, checks=False):
        assert result["outcome"] == "trained"
        assert result["wrong"] > 1e-3, "the check guards a real failure: this must be wrong"


def _eval_body(rank: int, world_size: int) -> str:
    model = _sharded("shardkit", world_size)
    x = torch.randn(4, DIM)
    try:
        with torch.no_grad():
            model(x, _order(rank))
    except DesyncError as error:
        return str(error)
    return "evaluated"


def test_a_forward_without_backward_is_checked_at_its_end() -> None:
    from harness.pool import run_on_ranks

    for message in run_on_ranks(2, _eval_body):
        assert "all-gather of blocks.0" in message and "all-gather of blocks.1" in message


def torch_control(rank: int, world_size: int) -> str:
    """The swapped program under torch's ``fully_shard`` (run by ``tests.core.torch_control``)."""
    model = _sharded("torch", world_size)
    _loss(model, rank, 0).backward()
    grads = _oracle_grads(world_size)
    ours = plain({n: p.grad for n, p in model.named_parameters()})
    wrong = max((ours[n] - g).abs().max().item() for n, g in grads.items() if g is not None)
    return f"trained, gradients {wrong:.1e} from the oracle"


def test_torch_control_trains_the_swapped_blocks_silently_wrong() -> None:
    from tests.core.torch_control import run_control

    outcome = run_control(f"{__name__}:torch_control")
    # Recorded, not required: torch either fails or trains without a word; it never names it.
    assert set(outcome.outcomes) == {0, 1}, outcome
    for text in outcome.outcomes.values():
        assert "blocks.1" not in text, text
        if text.startswith("trained"):
            assert float(text.split()[2]) > 1e-3, text


def _destroyed_body(rank: int, world_size: int) -> str:
    # A model trained on a group of its own that is then destroyed: the next model's check
    # forgets that group's window instead of exchanging on it.
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group(list(range(world_size)))
    first: Any = _make()  # an FSDPModule once sharded
    mesh = DeviceMesh.from_group(group, "cpu")
    fully_shard_of("shardkit")(first, mesh=mesh)
    first(torch.randn(4, DIM), (0, 1)).sum().backward()  # checked: its window is empty again
    first.reshard()
    first.unshard()  # a gather the group's window keeps: no backward or forward ends it
    first.reshard()
    dist.destroy_process_group(group)
    second = _sharded("shardkit", world_size)
    _loss(second, 0, 0).backward()
    return "trained"


def test_a_destroyed_group_is_forgotten() -> None:
    from harness.pool import run_on_ranks

    assert run_on_ranks(2, _destroyed_body) == ["trained", "trained"]
