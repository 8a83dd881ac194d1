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

import os
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
    staged = bool(snapshots._log._staged)  # the gradients went through a device buffer
    snapshots.close(remove=False)  # as a killed worker leaves them
    files = sorted(p.name for p in Path(f"{root}/node{rank}").iterdir())
    train_app(app, 8, rank, world_size)
    kept[8] = state_of(app)
    return {"at": kept, "files": files, "staged": staged}


def _lose_node1_and_resume(
    rank: int,
    world_size: int,
    root: str,
    restart: str = "restart",
    replays: bool = True,
    nudge: bool = False,
) -> dict[str, Any]:
    """Node 1's memory gone, both ranks restart and resume; then one step and its snapshot.

    On a copy of node 0's memory in ``{root}/{restart}``, made afresh each time: a worker
    crash makes the pool run the task again, which must find the files as they were.
    """
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(f"{root}/{restart}", ignore_errors=True)
        shutil.copytree(f"{root}/node0", f"{root}/{restart}/node0")
    torch.distributed.barrier()
    root = f"{root}/{restart}"
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
    assert not any(t["staged"] for t in trained)
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
    again = f"{root}/restart"
    for result in run_on_ranks(2, _lose_node1_and_resume, root=again):
        assert (result["step"], result["from_replicas"]) == (8, (1,))
        assert _same(result["state"], trained[0]["at"][8])


def _tear_log_entry_of_step(root: str, step: int) -> None:
    from shardkit.core.snapshots.format import STATE_AT, peek_step

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


def _train_staged(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """``_train`` with the host standing in for an accelerator: the state staged, and the
    gradients concatenated into a "device" buffer and moved by the background thread."""
    from shardkit.core.snapshots import memory_snapshots as snapshots_module

    with pytest.MonkeyPatch.context() as patch:  # undone: the worker runs other tests after
        patch.setattr(snapshots_module, "staging_device", lambda *_: torch.device("cpu"))
        return _train(rank, world_size, root)


def test_an_accelerators_gradients_staged_on_the_device_replay_alike(tmp_path: Path) -> None:
    root = str(tmp_path)
    trained = run_on_ranks(2, _train_staged, root=root)
    assert all(t["staged"] for t in trained)
    for result in run_on_ranks(2, _lose_node1_and_resume, root=root):
        assert (result["step"], result["from_replicas"], result["refused"]) == (7, (1,), ())
        assert _same(result["state"], trained[0]["at"][7])


def _rewrite_log_entry_of_step(root: str, step: int, change: str) -> None:
    """A log entry's header rewritten as a crafted writer would, its CRC made to match."""
    import dataclasses
    import json

    from shardkit.core.snapshots.format import (
        REGION_AT,
        Expected,
        capacity_in,
        data_offset,
        header_region,
        peek_step,
        read_header,
    )

    for path in Path(f"{root}/node0").glob("log-of-rank00001.*"):
        raw = torch.from_file(str(path), shared=True, size=path.stat().st_size, dtype=torch.uint8)
        if peek_step(raw) != step:
            continue
        if change == "cut":  # a file cut short, its last page of gradients gone
            os.truncate(path, path.stat().st_size - 4096)
            return
        if change == "data":  # one byte of the first gradient changed, its checksum not
            raw[data_offset(capacity_in(raw))] ^= 0xFF
            return
        header = read_header(raw, rank=1, expected=Expected(RUN, 2, None))
        values = dict(header.values)
        groups = json.loads(str(values["log/groups"]))
        if change == "params":  # a group that would replace the optimizer's parameters
            groups[0]["params"] = [0, 1]
        elif change == "lr":  # a value of a known key that the optimizer cannot use
            groups[0]["lr"] = "fast"
        elif change == "sums":
            values["log/full_checksums"] = "zz"
        values["log/groups"] = json.dumps(groups)
        crafted = dataclasses.replace(header, values=values)
        if change == "run":  # an entry another job left in this node's memory
            crafted = dataclasses.replace(crafted, run_id="another-run")
        elif change == "world":
            crafted = dataclasses.replace(crafted, world_size=4)
        region = header_region(crafted.to_json(), capacity_in(raw))
        raw[REGION_AT : REGION_AT + len(region)] = torch.frombuffer(
            bytearray(region), dtype=torch.uint8
        )
        return
    raise AssertionError(f"no log entry of step {step}")


# Refused when the chains through it are verified (one refusal each: to steps 7 and 6) or
# replayed, or at once by the survey (one refusal: the entry itself).
@pytest.mark.parametrize(
    ("change", "refusal", "times"),
    [
        ("params", "unreadable: its parameter groups are not objects of the live groups' keys", 2),
        ("sums", "unreadable: its step's checksums are malformed", 2),
        ("lr", "not replayable: the optimizer's step 5 raised TypeError", 2),
        ("run", "(step 5): another run: run 'another-run', this job is run 'log-run'", 1),
        ("world", "(step 5): another world size: written at world size 4, this job has 2", 1),
        ("cut", "log entry held by rank 0, slot 0: unreadable: its data is cut short", 1),
        ("data", ": checksum: log/grad/00000's", 2),
    ],
)
def test_a_crafted_log_entry_is_refused_never_raised(
    tmp_path: Path, change: str, refusal: str, times: int
) -> None:
    root = str(tmp_path)
    trained = run_on_ranks(2, _train, root=root)
    _rewrite_log_entry_of_step(root, 5, change)
    for result in run_on_ranks(2, _lose_node1_and_resume, root=root):
        assert result["step"] == 4 and _same(result["state"], trained[0]["at"][4])
        refused = [r for r in result["refused"] if refusal in r]
        assert len(refused) == times, result["refused"]


_CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


# "host": a host state, the gradients concatenated straight into the entry's bytes; "cpu": the
# host standing in for a device (a device buffer, no streams); "cuda": the real device path,
# the concatenation launched on the device and moved by the background thread on a stream of
# its own (make check-gpu's pytest-gpu chunk runs it).
@pytest.mark.parametrize("device", ["host", "cpu", _CUDA])
def test_an_entry_holds_the_consumed_gradients_and_replays_to_its_step(device: str) -> None:
    import json

    from shardkit.core.snapshots.checksum import checksums_of
    from shardkit.core.snapshots.contents import Layout, leaves_of
    from shardkit.core.snapshots.format import (
        REGION_AT,
        Expected,
        Header,
        data_offset,
        parse_region,
        region_bytes,
    )
    from shardkit.core.snapshots.gradient_log import GradientLog, LogPlan
    from shardkit.core.snapshots.log_replay import check_entry, reached, replay
    from shardkit.core.snapshots.slots import Topology
    from shardkit.core.snapshots.state_copy import restore_into

    on = "cuda" if device == "cuda" else "cpu"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).to(on)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    log = GradientLog(optimizer)

    def backward() -> None:
        model(torch.randn(2, 5, device=on)).sum().backward()

    backward()
    optimizer.step()  # the optimizer's state exists: the plan tells its tensors apart
    optimizer.zero_grad()
    state = {"model": model, "optim": optimizer}
    leaves = leaves_of(state)
    layout = Layout.of(leaves)

    def snapshot_bytes() -> torch.Tensor:  # the state as a snapshot's data, on the host
        data = torch.zeros(layout.data_bytes, dtype=torch.uint8)
        now = leaves_of(state).tensors
        for full_entry in layout.entries:
            full_entry.view(data).copy_(now[full_entry.key])
        return data

    before, values_before = snapshot_bytes(), dict(leaves_of(state).values)
    plan = LogPlan.of(layout, leaves, optimizer)
    assert plan.carried == ()  # parameters and AdamW's state: all of it the optimizer's
    staged_on = None if device == "host" else torch.device(on)
    log.start(plan, Topology("t", 0, 1, 1), layout, leaves.values, staged_on)
    backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # the log takes them after this
    consumed = [p.grad.detach().cpu().clone() for p in model.parameters() if p.grad is not None]
    assert len(consumed) == 4
    optimizer.param_groups[0]["lr"] = 0.05
    optimizer.step()
    optimizer.zero_grad()
    entry = log.take()
    assert (entry.staged is None) == (device == "host")
    full_data = snapshot_bytes()
    full = Header("t", 1, 0, 3, layout, checksums_of(full_data), dict(leaves_of(state).values))
    span = log.finish(entry, full, full_data, base=2)
    header = parse_region(
        span[: region_bytes(log.capacity)], rank=0, expected=Expected("t", 1, None)
    )
    data = span[data_offset(log.capacity) - REGION_AT :]
    assert header.values["log/base"] == 2 and header.values["log/stepped"] == 1
    assert header.values["log/present"] == "1111"
    assert json.loads(str(header.values["log/groups"]))[0]["lr"] == 0.05
    assert header.values["log/full_checksums"] == full.checksums.hex()
    for index, grad in enumerate(consumed):
        assert torch.equal(header.layout.entries[index].view(data), grad)
    # Back to the step before, then the entry replayed on the state's device: the step's bytes.
    restore_into(state, layout, before, values_before)
    assert not torch.equal(snapshot_bytes(), full_data)
    check_entry(header, layout, log)
    replay([(header, data)], log)
    replayed, values = reached(leaves_of(state), layout, [(header, data)], len(log.params))
    assert torch.equal(replayed, full_data) and values == full.values
    # Two steps on, the same buffer again, with one parameter left without a gradient: its
    # place holds zeros, not the bytes that buffer held two steps before, and it is absent.
    for absent in (False, True):
        backward()
        if absent:
            model[1].bias.grad = None
        optimizer.step()
        optimizer.zero_grad()
        entry = log.take()
    span = log.finish(entry, full, full_data, base=2)
    header = parse_region(
        span[: region_bytes(log.capacity)], rank=0, expected=Expected("t", 1, None)
    )
    data = span[data_offset(log.capacity) - REGION_AT :]
    assert header.values["log/present"] == "1110"
    assert not header.layout.entries[3].view(data).any()
    assert header.layout.entries[2].view(data).any()
    log.close()
