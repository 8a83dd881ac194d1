import time
import torch, torch.distributed as dist
from tests.harness.pool import run_on_ranks
from tests.harness.compare import assert_all_equal


def _assert_body(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    print("about to check", rank)
    assert t.item() == 0.0, f"rank {rank} has {t.item()}"
    return t.item()


def test_assert_fails():
    run_on_ranks(2, _assert_body)


def _hang(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(100)


def test_hang():
    run_on_ranks(2, _hang, timeout_s=60)


def _differ(rank: int, world_size: int) -> dict:
    return {"loss": [1.0, float(rank)]}


def test_differ():
    assert_all_equal(run_on_ranks(2, _differ))
