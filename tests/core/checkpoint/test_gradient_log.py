"""The gradient log: a lost node's ranks replay their replica's log to the newest step, bit for bit.

Two gloo ranks, each its own "node" (a directory each), a snapshot every step, the full state
replicated every fourth step (and at the first snapshot), log entries on the steps between
(``MemorySnapshots(optimizer=...)``). After 7 steps, rank 1's node holds steps 6 and 7 of its
own (and 4, pinned), rank 0's node holds rank 1's replicas of steps 1 and 4 and its log
entries of steps 5, 6 and 7. Wiping node 1 leaves rank 1 only those: it must replay steps 5 to
7 from step 4. The oracle is the state itself at each step (every parameter and optimizer
tensor, full), and an uninterrupted run's next step.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core.checkpoint.checkpoint_app import TrainingApp, build_app, state_of, train_app

RUN = "log-run"


def _snapshots(root: str, rank: int, app: TrainingApp | None, **options: Any) -> Any:
    from shardkit.core import MemorySnapshots

    optimizer = app.optimizer if app is not None else None
    directory = f"{root}/node{rank}"
    options = {"ranks_per_node": 1, "replicate_every": 4, "optimizer": optimizer, **options}
    return MemorySnapshots(RUN, directory=directory, **options)


def _train(rank: int, world_size: int, root: str, skip: int = 0) -> dict[str, Any]:
    """Steps 1 to 7 with a snapshot after each (but ``skip``), then step 8 without one."""
    app = build_app(world_size)
    snapshots = _snapshots(root, rank, app)
    kept = {}
    while app.step < 7:
        train_app(app, app.step + 1, rank, world_size)
        if app.step != skip:
            snapshots.snapshot(app.step, {"app": app})
        kept[app.step] = state_of(app)
    snapshots.close(remove=False)  # as a killed worker leaves them
    files = sorted(p.name for p in Path(f"{root}/node{rank}").iterdir())
    train_app(app, 8, rank, world_size)
    kept[8] = state_of(app)
    return {"at": kept, "files": files}


def _lose_node1_and_resume(
    rank: int, world_size: int, root: str, replays: bool = True, nudge: bool = False
) -> dict[str, Any]:
    """Node 1's memory gone, both ranks restart and resume; then one step and its snapshot."""
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(f"{root}/node1", ignore_errors=True)
    torch.distributed.barrier()
    app = build_app(world_size)
    if nudge:  # a hook the log knows nothing of: the replay cannot give the logged bits
        app.optimizer.register_step_post_hook(lambda *_: _nudge(app))
    snapshots = _snapshots(root, rank, app if replays else None)
    point = snapshots.resume({"app": app})
    resumed = {"step": point.step, "from_replicas": point.from_replicas, "refused": point.refused}
    resumed["state"] = state_of(app)
    train_app(app, app.step + 1, rank, world_size)
    snapshots.snapshot(app.step, {"app": app})
    snapshots.close(remove=False)
    return resumed | {"after": state_of(app)}


def _nudge(app: TrainingApp) -> None:
    with torch.no_grad():
        next(iter(app.model.parameters())).to_local().mul_(1.0 + 2**-10)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_a_lost_node_replays_its_replicas_log_to_the_newest_step(tmp_path: Path) -> None:
    root = str(tmp_path)
    trained = run_on_ranks(2, _train, root=root)
    own = [f"rank00000.slot{k}.snap" for k in range(3)]  # two, and step 4 pinned
    held = [f"replica-of-rank00001.slot{k}.snap" for k in range(2)]
    logs = [f"log-of-rank00001.slot{k}.snap" for k in range(3)]  # steps 5, 6, 7
    assert trained[0]["files"] == sorted(own + held + logs)
    results = run_on_ranks(2, _lose_node1_and_resume, root=root)
    for result in results:
        assert (result["step"], result["from_replicas"], result["refused"]) == (7, (1,), ())
        assert _same(result["state"], trained[0]["at"][7])
        assert _same(result["after"], trained[0]["at"][8])  # and trains on as it would have
    # The restarted run's first snapshot (step 8) is replicated whole: lost again, 8 is back.
    for result in run_on_ranks(2, _lose_node1_and_resume, root=root):
        assert (result["step"], result["from_replicas"]) == (8, (1,))
        assert _same(result["state"], trained[0]["at"][8])


def _tear_log_entry_of_step(root: str, step: int) -> None:
    from shardkit.core.checkpoint.snapshot_format import STATE_AT, peek_step

    for path in Path(f"{root}/node0").glob("log-of-rank00001.*"):
        raw = torch.from_file(str(path), shared=True, size=path.stat().st_size, dtype=torch.uint8)
        if peek_step(raw) == step:
            raw[STATE_AT] = 0  # as a writer killed mid-transfer leaves it
            return
    raise AssertionError(f"no log entry of step {step}")


def test_a_torn_log_entry_ends_the_chain_before_it(tmp_path: Path) -> None:
    root = str(tmp_path)
    trained = run_on_ranks(2, _train, root=root)
    _tear_log_entry_of_step(root, 6)
    for result in run_on_ranks(2, _lose_node1_and_resume, root=root):
        # Rank 1 reaches step 5 at most; rank 0 holds 6, 7 and 4: both have step 4.
        assert (result["step"], result["from_replicas"]) == (4, (1,))
        assert _same(result["state"], trained[0]["at"][4])
        torn = "rank 1's log entry held by rank 0, slot 1: torn"  # step 6's slot
        assert any(torn in r for r in result["refused"]), result["refused"]


def test_a_replay_that_does_not_reproduce_its_step_is_refused(tmp_path: Path) -> None:
    root = str(tmp_path)
    trained = run_on_ranks(2, _train, root=root)
    for result in run_on_ranks(2, _lose_node1_and_resume, root=root, nudge=True):
        # Steps 7 and 6 (by replay) are refused in turn; step 4 is a whole replica.
        assert (result["step"], result["from_replicas"]) == (4, (1,))
        assert _same(result["state"], trained[0]["at"][4])
        replays = [r for r in result["refused"] if "not replayable" in r]
        assert len(replays) == 2
        assert "replaying steps 5 to 7 did not give step 7's state" in replays[0]
        assert "and log to 7" in replays[0] and "and log to 6" in replays[1]


def test_an_entry_after_two_optimizer_steps_is_refused_by_its_writers_reason(
    tmp_path: Path,
) -> None:
    root = str(tmp_path)
    trained = run_on_ranks(2, _train, root=root, skip=5)  # no snapshot after step 5
    for result in run_on_ranks(2, _lose_node1_and_resume, root=root):
        assert result["step"] == 4 and _same(result["state"], trained[0]["at"][4])
        reason = "(step 6): not replayable: the optimizer stepped 2 times between two snapshots"
        assert any(reason in r for r in result["refused"]), result["refused"]


def test_without_an_optimizer_the_log_is_passed_over_by_name(tmp_path: Path) -> None:
    root = str(tmp_path)
    trained = run_on_ranks(2, _train, root=root)
    for result in run_on_ranks(2, _lose_node1_and_resume, root=root, replays=False):
        assert result["step"] == 4 and _same(result["state"], trained[0]["at"][4])
        assert any("has no optimizer to replay them" in r for r in result["refused"])


def _optimizer_on_rank0_only(rank: int, world_size: int, root: str) -> str:
    app = build_app(world_size)
    snapshots = _snapshots(root, rank, app if rank == 0 else None)
    train_app(app, 1, rank, world_size)
    try:
        snapshots.snapshot(1, {"app": app})
    except ValueError as error:
        return str(error)
    return "no error"


def test_the_log_on_some_ranks_only_is_refused_on_every_rank(tmp_path: Path) -> None:
    messages = run_on_ranks(2, _optimizer_on_rank0_only, root=str(tmp_path))
    assert all("optimizer= was given on some ranks only" in m for m in messages)


def test_the_log_needs_a_snapshot_every_step() -> None:
    from shardkit.core import MemorySnapshots

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="needs a snapshot every step, got every=2"):
        MemorySnapshots(RUN, every=2, replicate_every=4, optimizer=optimizer)


def test_an_accelerators_state_is_refused_with_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardkit.core import MemorySnapshots
    from shardkit.core.checkpoint import snapshots as snapshots_module

    monkeypatch.setattr(snapshots_module, "staging_device", lambda *_: torch.device("cuda", 0))
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    snapshots = MemorySnapshots(RUN, directory=tmp_path, replicate_every=4, optimizer=optimizer)
    with pytest.raises(ValueError, match=r"takes gradients on the host only for now.*cuda:0"):
        snapshots.snapshot(1, {"model": model, "optim": optimizer})
