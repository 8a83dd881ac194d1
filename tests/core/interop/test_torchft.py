"""shardkit under torchft: replica groups that lose a rank, heal from a live group and rejoin.

Each run is demo/run_torchft.py's: torchft's lighthouse in this process, two replica groups of 2
gloo ranks under `torchrun --max-restarts` (demo/torchft_replicas.py: `fully_shard` inside a
group, torchft's all-reduce across groups as every FSDP module's all-reduce hook), and a rank of
group 1 SIGKILLed after its forward at step 3. Group 0 fails that step, commits steps 3 and 4
alone, then lets the restarted group 1 in; group 1 heals from group 0 over HTTP (weights and
the optimizer's state) and both commit the rest. The failure and the rejoin happen at the same
steps in every run, so the committed losses are a function of the engine alone.

The quorum is torchft's synchronous one where torch's `fully_shard` is the oracle: with
torchtitan's asynchronous quorum, torchft takes the live group's state dict on its quorum thread
while the training thread runs the step, and torch's `fully_shard` dies of it
(pytorch/torchtitan#4753). The slow test counts that on the demo's GPT.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (make setup installs it)")

from demo.run_torchft import RunFailed, RunResult, Schedule, check, heal_summary, run

SCHEDULE = Schedule()  # the tiny GPT, 8 steps, group 1's rank 1 killed at step 3


def _run_checked(tmp: Path, quorum: str, impl: str, hook: str) -> RunResult:
    result = run(tmp, impl=impl, hook=hook, quorum=quorum, schedule=SCHEDULE)
    assert check(result, SCHEDULE, quorum) == []
    return result


def test_a_killed_group_heals_and_commits_torchs_losses(tmp_path: Path) -> None:
    # shardkit with torchtitan main's private hook path, torch's fully_shard with the public one.
    ours = _run_checked(tmp_path / "shardkit", "sync", impl="shardkit", hook="private")
    theirs = _run_checked(tmp_path / "torch", "sync", impl="torch", hook="public")
    # 8 steps on each rank of group 0; group 1 lost steps 3 and 4 (it healed to step 5).
    assert len(ours.committed()) == 2 * 8 + 2 * 6
    assert ours.committed() == theirs.committed()  # the loss of every committed step, bit for bit
    assert ours.finals == theirs.finals  # each rank's shards and optimizer state at the end
    assert heal_summary(ours)["bytes"] > 0


def test_torchtitans_async_quorum_heals_shardkit(tmp_path: Path) -> None:
    # The live group's state dict is taken on torchft's quorum thread while its training thread
    # runs the step; the healing group runs its step beside the transfer and adds zeros.
    result = _run_checked(tmp_path, "async", impl="shardkit", hook="public")
    sent = [s for heal in result.heals.values() for s in heal["sent"]]
    assert len(sent) == 2  # each rank of group 0 sent its shards once


@pytest.mark.slow
def test_both_hook_paths_on_the_demo_gpt_commit_torchs_losses(tmp_path: Path) -> None:
    """The synchronous quorum on the demo's GPT: each engine through each hook path."""
    schedule = Schedule(model="demo")
    committed: dict[tuple[str, str], dict[tuple[int, int, int], str]] = {}
    for impl in ("shardkit", "torch"):
        for hook in ("public", "private"):
            result = run(
                tmp_path / f"{impl}-{hook}", impl=impl, hook=hook, quorum="sync", schedule=schedule
            )
            assert check(result, schedule, "sync") == []
            committed[(impl, hook)] = result.committed()
    assert len({tuple(sorted(losses.items())) for losses in committed.values()}) == 1


@pytest.mark.slow
def test_async_quorum_on_the_demo_gpt_against_torch(tmp_path: Path) -> None:
    """Each engine 3 times with torchtitan's asynchronous quorum on the demo's GPT (its forward
    is long enough for torchft's state dict to land in it): shardkit heals every time; torch's
    fully_shard's failures are counted (printed), and a torch run that completes must have
    committed shardkit's losses."""
    schedule = Schedule(model="demo")
    ours: dict[tuple[int, int, int], str] | None = None
    torch_failures: list[str] = []
    for trial in range(3):
        for hook in ("public", "private"):
            result = run(
                tmp_path / f"shardkit-{trial}-{hook}", hook=hook, quorum="async", schedule=schedule
            )
            assert check(result, schedule, "async") == []
            assert ours is None or result.committed() == ours
            ours = result.committed()
        try:
            theirs = run(
                tmp_path / f"torch-{trial}", impl="torch", quorum="async", schedule=schedule
            )
        except RunFailed as failure:
            assert failure.state_dict_race, failure.first_error  # any other failure is a bug
            torch_failures.append(failure.first_error)
            continue
        assert theirs.committed() == ours
    print(f"\ntorch's fully_shard under torchft's async quorum: {len(torch_failures)}/3 died:")
    for error in torch_failures:
        print(f"  {error[:120]}")
