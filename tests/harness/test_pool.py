"""The worker pool: values in rank order, collectives, failures, hangs and dead workers.

The bodies below run in the workers, imported by name, so they live at module level.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from harness import pool as pool_module
from harness.compare import assert_all_equal
from harness.pool import (
    RankTaskError,
    RankTaskTimeout,
    crashes_fail_at_once,
    crashes_recorded_apart,
    crashes_retried,
    crowded_restarts,
    get_pool,
    group_restarts,
    run_on_ranks,
)

WORLD_SIZES = [1, 2, 4]
_ENV_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def _whoami(rank: int, world_size: int) -> dict[str, object]:
    return {
        "rank": rank,
        "world_size": world_size,
        "group": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
        "pid": os.getpid(),
        "env": {name: os.environ[name] for name in _ENV_NAMES},
        "threads": torch.get_num_threads(),
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_values_come_back_in_rank_order(world_size: int) -> None:
    results = run_on_ranks(world_size, _whoami)

    assert [result["rank"] for result in results] == list(range(world_size))
    assert [result["group"] for result in results] == [
        (rank, world_size, "gloo") for rank in range(world_size)
    ]
    assert len({result["pid"] for result in results}) == world_size
    for rank, result in enumerate(results):
        env = result["env"]
        assert isinstance(env, dict)
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (
            str(rank),
            str(rank),
            str(world_size),
        )
        assert env["OMP_NUM_THREADS"] == "1"
        assert result["threads"] == 1


def _all_reduce(rank: int, world_size: int, scale: float) -> torch.Tensor:
    values = torch.full((3,), (rank + 1) * scale)
    dist.all_reduce(values)
    return values


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_sums_across_ranks(world_size: int) -> None:
    results = run_on_ranks(world_size, _all_reduce, scale=0.5)

    assert_all_equal(results)
    expected = 0.5 * world_size * (world_size + 1) / 2
    torch.testing.assert_close(results[0], torch.full((3,), expected))


def _mesh_all_reduce(rank: int, world_size: int) -> float:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ones = torch.ones(1)
    dist.all_reduce(ones, group=mesh.get_group("dp"))
    return ones.item()


def test_device_mesh_can_be_built_in_a_task() -> None:
    assert run_on_ranks(2, _mesh_all_reduce) == [2.0, 2.0]


def _global_state(rank: int, world_size: int) -> tuple[str, bool, torch.Tensor]:
    return str(torch.get_default_dtype()), torch.is_grad_enabled(), torch.rand(2)


def _change_global_state(rank: int, world_size: int) -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.manual_seed(1234 + rank)


def test_global_state_is_reset_between_tasks() -> None:
    before = run_on_ranks(2, _global_state)
    run_on_ranks(2, _change_global_state)
    after = run_on_ranks(2, _global_state)

    assert_all_equal(before + after)
    dtype, grad_enabled, random = after[0]
    assert (dtype, grad_enabled) == ("torch.float32", True)
    torch.testing.assert_close(random, torch.rand(2, generator=torch.Generator().manual_seed(0)))


def _print_rank(rank: int, world_size: int) -> None:
    print(f"hello from rank {rank}")


def test_task_output_is_shown_with_the_test(capsys: pytest.CaptureFixture[str]) -> None:
    run_on_ranks(2, _print_rank)

    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out
    assert "[rank 1] hello from rank 1" in out


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    dist.all_reduce(torch.ones(1))  # both ranks get through the collective, then one fails
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_exception_shows_remote_traceback_and_pool_survives() -> None:
    run_on_ranks(2, _whoami)
    pids = get_pool(2).pids

    with pytest.raises(RankTaskError, match="boom on rank 1") as raised:
        run_on_ranks(2, _raise_on_rank_1)

    message = str(raised.value)
    assert "_raise_on_rank_1 on world_size=2 failed on rank(s) [1]." in message
    assert 'raise ValueError("boom on rank 1")' in message  # the remote source line
    assert run_on_ranks(2, _all_reduce, scale=1.0)[0].tolist() == [3.0, 3.0, 3.0]
    assert get_pool(2).pids == pids  # the same workers: no restart was needed


def _raise_before_collective(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1, forever


def test_exception_while_others_wait_restarts_the_pool() -> None:
    run_on_ranks(2, _whoami)
    pids = get_pool(2).pids

    # The timeout also bounds how long the pool waits for rank 0 once rank 1 has failed.
    with pytest.raises(RankTaskError, match="rank 1 gives up") as raised:
        run_on_ranks(2, _raise_before_collective, timeout_s=1.0)

    assert not isinstance(raised.value, RankTaskTimeout)
    message = str(raised.value)
    assert "Rank(s) [0] were still running" in message
    assert "in _raise_before_collective" in message  # rank 0's stack, from faulthandler
    assert run_on_ranks(2, _all_reduce, scale=1.0)[1].tolist() == [3.0, 3.0, 3.0]
    assert get_pool(2).pids != pids


def _hang_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def test_timeout_kills_and_restarts_the_pool() -> None:
    with pytest.raises(RankTaskTimeout, match=r"timed out after 1 s: rank\(s\) \[0, 1\]") as raised:
        run_on_ranks(2, _hang_on_rank_1, timeout_s=1.0)

    assert "in _hang_on_rank_1" in str(raised.value)  # the ranks' stacks
    assert run_on_ranks(2, _all_reduce, scale=1.0)[0].tolist() == [3.0, 3.0, 3.0]


def _exit(rank: int, world_size: int) -> None:
    os._exit(3)


def test_dead_worker_fails_the_task_and_is_replaced() -> None:
    with pytest.raises(RankTaskError, match=r"exited \(code 3\)"):
        run_on_ranks(1, _exit)

    assert run_on_ranks(1, _whoami)[0]["rank"] == 0


def _crash_once(rank: int, world_size: int, marker: str, sig: int) -> int:
    """Rank 1 dies of ``sig`` the first time (no ``marker`` file yet); then all return."""
    if rank == 1 and not os.path.exists(marker):
        with open(marker, "w"):
            pass
        _die_of(sig)
    return os.getpid()


def test_a_crashed_worker_runs_its_task_once_more_and_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHARDKIT_POOL_RETRY_CRASH", raising=False)  # a crash hunt's run
    run_before = crashes_retried()
    first = run_on_ranks(2, _whoami)
    with (
        crashes_recorded_apart() as crashes,
        pytest.warns(RuntimeWarning, match=r"rank 1 \(SIGSEGV\) crashed; the task ran again"),
    ):
        pids = run_on_ranks(2, _crash_once, marker=str(tmp_path / "m"), sig=signal.SIGSEGV)

    assert set(pids).isdisjoint(p["pid"] for p in first)  # a fresh pool ran it again
    assert [c.signals for c in crashes] == [{1: "SIGSEGV"}]
    assert "exited (code -11)" in crashes[0].report()
    assert "Fatal Python error: Segmentation fault" in crashes[0].report()  # faulthandler's
    assert crashes_retried() == run_before  # the run's own list holds real crashes only


def _crash_in_the_barrier_once(rank: int, world_size: int, marker: str) -> int:
    """Returns on every rank; rank 1 then dies of SIGSEGV in the barrier after the task, once.

    The barrier is the worker's next all-gather: patched here, in this worker only, as the
    default run met it (a segfault inside gloo's all-gather between tasks).
    """
    import torch.distributed as dist

    if rank == 1 and not os.path.exists(marker):
        with open(marker, "w"):
            pass

        def dies(*args: object, **kwargs: object) -> None:
            _die_of(signal.SIGSEGV)

        dist.all_gather = dies
    return os.getpid()


def test_a_worker_crashed_in_the_barrier_after_its_task_runs_it_once_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SHARDKIT_POOL_RETRY_CRASH", raising=False)
    first = run_on_ranks(2, _whoami)
    with (
        crashes_recorded_apart() as crashes,
        pytest.warns(RuntimeWarning, match=r"rank 1 \(SIGSEGV\) crashed; the task ran again"),
    ):
        pids = run_on_ranks(2, _crash_in_the_barrier_once, marker=str(tmp_path / "m"))

    assert set(pids).isdisjoint(p["pid"] for p in first)  # a fresh pool ran it again
    assert [c.signals for c in crashes] == [{1: "SIGSEGV"}]
    assert "died in the barrier after the task" in crashes[0].report()
    assert "Fatal Python error: Segmentation fault" in crashes[0].report()  # faulthandler's
    assert run_on_ranks(2, _whoami)[1]["pid"] == pids[1]  # and the pool goes on


def _crash_always(rank: int, world_size: int, sig: int) -> None:
    if rank == 1:
        _die_of(sig)


def _die_of(sig: int) -> None:
    """Kill this worker with ``sig``, leaving no core file where cores are on."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.kill(os.getpid(), sig)


def test_a_second_crash_fails_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDKIT_POOL_RETRY_CRASH", raising=False)
    with (
        crashes_recorded_apart() as crashes,
        pytest.warns(RuntimeWarning),
        pytest.raises(RankTaskError, match=r"exited \(code -6\)"),
    ):
        run_on_ranks(2, _crash_always, sig=signal.SIGABRT)
    assert [c.signals for c in crashes] == [{1: "SIGABRT"}]  # run twice, retried once


def test_no_retry_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDKIT_POOL_RETRY_CRASH", "0")
    with (
        crashes_recorded_apart() as crashes,
        pytest.raises(RankTaskError, match=r"exited \(code -11\)"),
    ):
        run_on_ranks(2, _crash_always, sig=signal.SIGSEGV)
    assert crashes == []


def test_no_retry_where_the_caller_hunts_crashes() -> None:
    with (
        crashes_recorded_apart() as crashes,
        pytest.raises(RankTaskError, match=r"exited \(code -11\)"),
        crashes_fail_at_once(),
    ):
        run_on_ranks(2, _crash_always, sig=signal.SIGSEGV)
    assert crashes == []


def test_a_killed_worker_is_not_retried(tmp_path: Path) -> None:
    with (
        crashes_recorded_apart() as crashes,
        pytest.raises(RankTaskError, match=r"exited \(code -9\)"),
    ):
        run_on_ranks(2, _crash_once, marker=str(tmp_path / "m"), sig=signal.SIGKILL)
    assert crashes == []


def _destroy_group(rank: int, world_size: int) -> None:
    dist.destroy_process_group()


def test_broken_process_group_fails_the_task_and_is_replaced() -> None:
    with pytest.raises(RankTaskError, match=r"did not get through the barrier"):
        run_on_ranks(1, _destroy_group)

    assert run_on_ranks(1, _whoami)[0]["rank"] == 0


def _unpicklable(rank: int, world_size: int) -> object:
    return lambda: rank


def test_unpicklable_value_fails_and_pool_survives() -> None:
    run_on_ranks(1, _whoami)
    pids = get_pool(1).pids

    with pytest.raises(RankTaskError, match="returned a function that cannot be pickled"):
        run_on_ranks(1, _unpicklable)

    assert get_pool(1).pids == pids


def test_function_must_be_importable_by_name() -> None:
    def local(rank: int, world_size: int) -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        run_on_ranks(1, local)
    with pytest.raises(TypeError, match="module-level function"):
        run_on_ranks(1, lambda rank, world_size: None)


def test_arguments_are_checked_before_dispatch() -> None:
    with pytest.raises(TypeError, match=r"_all_reduce cannot be called as .*\['scael'\]"):
        run_on_ranks(1, _all_reduce, scael=1.0)
    with pytest.raises(TypeError, match=r"arguments for .*_all_reduce cannot be pickled"):
        run_on_ranks(1, _all_reduce, scale=lambda: 1.0)


def _group_on_rank0(rank: int, world_size: int) -> int:
    # A group of rank 0 alone, made by it alone: rank 0 now holds one group more.
    if rank == 0:
        dist.new_group([0], use_local_synchronization=True)
    return os.getpid()


def _members_group(rank: int, world_size: int) -> int:
    # A group of every rank made by its members alone: named by each rank's registry, it pairs
    # the ranks only where their registries agree (else each waits under its own name).
    group = dist.new_group(list(range(world_size)), use_local_synchronization=True)
    value = torch.ones(1)
    dist.all_reduce(value, group=group)
    return int(value.item())


def test_a_task_leaving_groups_out_of_step_gets_the_next_one_a_fresh_pool() -> None:
    run_on_ranks(2, _whoami)
    pids = get_pool(2).pids
    before = len(group_restarts())
    assert run_on_ranks(2, _group_on_rank0) == pids  # its own result stands
    assert group_restarts()[before:] == (f"{__name__}._group_on_rank0",)
    assert set(get_pool(2).pids).isdisjoint(pids)  # the next task's pool is fresh
    assert run_on_ranks(2, _members_group, timeout_s=30) == [2, 2]
    # Groups made on every rank leave the pool as it is.
    pids = get_pool(2).pids
    run_on_ranks(2, _members_group)
    assert get_pool(2).pids == pids and len(group_restarts()) == before + 1


def _make_groups(rank: int, world_size: int, count: int) -> int:
    for _ in range(count):
        dist.new_group(list(range(world_size)))
    return len(dist.distributed_c10d._world.pg_names)


def test_workers_holding_many_process_groups_start_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    held = run_on_ranks(2, _make_groups, count=0)[0]
    pids = get_pool(2).pids
    monkeypatch.setattr(pool_module, "MAX_GROUPS_HELD", held + 1)
    before = len(crowded_restarts())
    assert run_on_ranks(2, _make_groups, count=1) == [held + 1] * 2
    assert get_pool(2).pids == pids  # at the cap: kept
    assert run_on_ranks(2, _make_groups, count=1) == [held + 2] * 2  # its own result stands
    assert crowded_restarts()[before:] == (f"{__name__}._make_groups",)
    assert run_on_ranks(2, _make_groups, count=0) == [1, 1]  # fresh: the default group alone
    assert set(get_pool(2).pids).isdisjoint(pids)
