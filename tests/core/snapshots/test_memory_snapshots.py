"""Memory snapshots: a restart resumes from the newest step every rank holds, bit for bit.

Two gloo ranks, each its own "node" (``ranks_per_node=1``, a directory per rank standing for
each node's shared memory), so each rank's snapshots are replicated to the other. The oracle
is the state itself at the snapshot's step: every parameter and optimizer tensor, full.
A restart is a fresh app (new model and optimizer, as a restarted worker builds them) and a
fresh ``MemorySnapshots`` on the same directories.
"""

from __future__ import annotations

import datetime
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core.checkpoint.checkpoint_app import build_app, state_of, train_app

RUN = "test-run"
REPO = Path(__file__).resolve().parents[3]


def _snapshots(root: str, rank: int, **options: Any) -> Any:
    from shardkit.core import MemorySnapshots

    options = {"ranks_per_node": 1, **options}
    return MemorySnapshots(options.pop("run_id", RUN), directory=f"{root}/node{rank}", **options)


def _train_with_snapshots(rank: int, world_size: int, root: str, until: int, **options: Any) -> Any:
    """An app trained to ``until`` with a snapshot after every step (or every ``every``)."""
    app = build_app(world_size, options.pop("model_name", "gpt"))
    snapshots = _snapshots(root, rank, **options)
    while app.step < until:
        train_app(app, app.step + 1, rank, world_size)
        snapshots.snapshot(app.step, {"app": app})
    snapshots.close(remove=False)  # as a killed worker leaves them
    return app


def _resume(rank: int, world_size: int, root: str, disk: str | None = None) -> dict[str, Any]:
    from shardkit.core import CheckpointManager

    app = build_app(world_size)
    checkpoints = CheckpointManager(disk) if disk is not None else None
    point = _snapshots(root, rank).resume({"app": app}, checkpoints)
    return {
        "source": point.source,
        "step": point.step,
        "app_step": app.step,
        "from_replicas": point.from_replicas,
        "refused": point.refused,
        "state": state_of(app),
    }


def _rank0_files(own: int) -> list[str]:
    """Rank 0's slot files at W=2 on two nodes: ``own`` of its own, two replicas of rank 1's."""
    replicas = [f"replica-of-rank00001.slot{k}.snap" for k in range(2)]
    return [f"rank00000.slot{k}.snap" for k in range(own)] + replicas


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def _train_and_keep(rank: int, world_size: int, root: str) -> dict[str, Any]:
    app = _train_with_snapshots(rank, world_size, root, 5)
    at_five = state_of(app)
    files = sorted(p.name for p in Path(f"{root}/node{rank}").iterdir())
    train_app(app, 7, rank, world_size)  # the live state moves on; no snapshot is taken
    return {"state": at_five, "files": files}


def test_a_restart_resumes_from_own_copies_then_from_the_peers_replica(tmp_path: Path) -> None:
    root = str(tmp_path)
    trained = run_on_ranks(2, _train_and_keep, root=root)
    # Bounded memory: 2 slots of its own and 2 replicas of the other rank's, per rank.
    assert trained[0]["files"] == _rank0_files(own=2)
    for result in run_on_ranks(2, _resume, root=root):
        assert (result["source"], result["step"], result["app_step"]) == ("memory", 5, 5)
        assert result["from_replicas"] == () and result["refused"] == ()
        assert _same(result["state"], trained[0]["state"])
    shutil.rmtree(tmp_path / "node0")  # node 0's memory is gone: rank 0 restores from rank 1
    for result in run_on_ranks(2, _resume, root=root):
        assert (result["source"], result["step"], result["app_step"]) == ("memory", 5, 5)
        assert result["from_replicas"] == (0,)
        assert _same(result["state"], trained[0]["state"])


def _replicated_every_five(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Snapshots after steps 1 to 8, replicas of steps 1 (the first) and 5; the states."""
    app = build_app(world_size)
    snapshots = _snapshots(root, rank, replicate_every=5)
    kept = {}
    while app.step < 8:
        train_app(app, app.step + 1, rank, world_size)
        snapshots.snapshot(app.step, {"app": app})
        kept[app.step] = state_of(app)
    snapshots.close(remove=False)
    files = sorted(p.name for p in Path(f"{root}/node{rank}").iterdir())
    return {"at": kept, "files": files}


def _restart_and_train_one_step(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A restarted worker: resumed from memory, then one step more with its snapshot."""
    app = build_app(world_size)
    snapshots = _snapshots(root, rank, replicate_every=5)
    point = snapshots.resume({"app": app})
    resumed = {"step": point.step, "from_replicas": point.from_replicas, "state": state_of(app)}
    train_app(app, app.step + 1, rank, world_size)
    snapshots.snapshot(app.step, {"app": app})
    snapshots.close(remove=False)
    return resumed | {"after": state_of(app)}


def _steps_held(root: str, rank: int) -> list[int]:
    from shardkit.core.snapshots.format import peek_step

    steps = []
    for path in sorted(Path(f"{root}/node{rank}").iterdir()):
        step = peek_step(torch.from_file(str(path), size=path.stat().st_size, dtype=torch.uint8))
        steps.append(-1 if step is None else step)
    return steps


def test_replicating_every_fifth_step_keeps_that_step_for_a_lost_node(tmp_path: Path) -> None:
    root = str(tmp_path)
    trained = run_on_ranks(2, _replicated_every_five, root=root)
    # One more own slot, which the rotation skips while it holds step 5, the newest replicated
    # (three slots in turn would hold steps 6, 7, 8); two replica slots (steps 1 and 5).
    assert trained[0]["files"] == _rank0_files(own=3)
    assert sorted(_steps_held(root, 0)) == [1, 5, 5, 7, 8]  # own 5, 7, 8; replicas of 1, 5
    # A node lost now: everyone goes back to step 5, the lost node's rank from its replica.
    lost = tmp_path / "node1-lost"
    shutil.copytree(tmp_path / "node0", lost / "node0")  # a copy: the files below go on
    for result in run_on_ranks(2, _resume, root=str(lost)):
        assert (result["source"], result["step"], result["from_replicas"]) == ("memory", 5, (1,))
        assert _same(result["state"], trained[0]["at"][5])
    # A killed process instead: its own copy of the step before, as with every step replicated.
    # The restore keeps what is older (step 5's), the restarted writer finds its own slot of
    # step 5 pinned (step 9 overwrites step 7's), and its first snapshot is replicated.
    restarted = run_on_ranks(2, _restart_and_train_one_step, root=root)
    for result in restarted:
        assert (result["step"], result["from_replicas"]) == (8, ())
        assert _same(result["state"], trained[0]["at"][8])
    assert sorted(_steps_held(root, 1)) == [5, 5, 8, 9, 9]  # own 5, 8, 9; replicas of 5, 9
    shutil.rmtree(tmp_path / "node1")  # node 1 is lost after the restart: back to step 9
    for result in run_on_ranks(2, _resume, root=root):
        assert (result["source"], result["step"], result["from_replicas"]) == ("memory", 9, (1,))
        assert _same(result["state"], restarted[0]["after"])


def test_one_node_pins_no_slot_for_replicas_it_never_sends(tmp_path: Path) -> None:
    from shardkit.core import MemorySnapshots

    model = torch.nn.Linear(4, 3)
    with MemorySnapshots(RUN, directory=tmp_path, replicate_every=4) as snapshots:
        for step in range(1, 6):
            model.weight.data.fill_(step)
            snapshots.snapshot(step, {"model": model})
        snapshots.wait()
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "rank00000.slot0.snap",
            "rank00000.slot1.snap",
        ]
        model.weight.data.zero_()  # the live state moves on
        point = MemorySnapshots(RUN, directory=tmp_path).restore({"model": model})
        assert point.step == 5 and bool((model.weight == 5).all())


def test_replicate_every_must_be_a_multiple_of_every() -> None:
    from shardkit.core import MemorySnapshots

    with pytest.raises(ValueError, match="replicate_every=3 must be a multiple of every=2"):
        MemorySnapshots(RUN, every=2, replicate_every=3)
    with pytest.raises(ValueError, match="replicate_every=1 must be a multiple of every=2"):
        MemorySnapshots(RUN, every=2, replicate_every=1)


def _without_rank1_step5(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    app = _train_with_snapshots(rank, world_size, root, 4)
    at_four = state_of(app)
    _train_with_snapshots(rank, world_size, root, 5)  # a fresh app to 5: the same steps
    return at_four


def test_the_newest_step_every_rank_holds_is_restored(tmp_path: Path) -> None:
    root = str(tmp_path)
    at_four = run_on_ranks(2, _without_rank1_step5, root=root)[0]
    # Rank 1's step 5 is gone on both nodes (its own copy and rank 0's replica of it).
    for path in [*tmp_path.glob("node1/rank00001.*"), *tmp_path.glob("node0/replica-of-*")]:
        if b'"step":5,' in path.read_bytes()[:4096]:
            path.unlink()
    for result in run_on_ranks(2, _resume, root=root):
        assert (result["source"], result["step"]) == ("memory", 4)
        assert _same(result["state"], at_four)


# --- bad snapshots: each refused by name on every rank, and the job resumes from disk --------


def _disk_at_five(rank: int, world_size: int, root: str, step6: str) -> dict[str, torch.Tensor]:
    """Snapshots at 3 (every 3), a disk checkpoint at 5, then step 6's snapshot by ``step6``.

    "ours": as the run takes it; "another run" / "another model": by a job of another run id /
    model in the same directories; "rank 1 only": rank 1's alone (unreplicated), rank 0's
    going elsewhere; "none": no step 6. Returns the state at 5.
    """
    from shardkit.core import CheckpointManager

    app = _train_with_snapshots(rank, world_size, root, 5, every=3)
    CheckpointManager(f"{root}/disk").save(5, {"app": app})
    at_five = state_of(app)
    if step6 != "none":
        app = build_app(world_size, "gpt_tied" if step6 == "another model" else "gpt")
        app.step = 5
        options: dict[str, Any] = {"every": 3}
        if step6 == "another run":
            options["run_id"] = "another-job"
        if step6 == "rank 1 only":  # one node of two ranks: no replicas
            options["ranks_per_node"] = 2
            root = f"{root}/elsewhere" if rank == 0 else root
        snapshots = _snapshots(root, rank, **options)
        train_app(app, 6, rank, world_size)
        snapshots.snapshot(6, {"app": app})
        snapshots.close(remove=False)
    return at_five


def _expect_disk(tmp_path: Path, at_five: dict[str, torch.Tensor], refusal: str) -> list[str]:
    """Resume on both ranks: from disk at step 5, with rank 0's step 6 refused as ``refusal``."""
    results = run_on_ranks(2, _resume, root=str(tmp_path), disk=str(tmp_path / "disk"))
    for result in results:
        assert (result["source"], result["step"], result["app_step"]) == ("disk", 5, 5)
        assert _same(result["state"], at_five)
        named = [r for r in result["refused"] if r.startswith("rank 0's") and f": {refusal}:" in r]
        assert named, result["refused"]
    assert results[0]["refused"] == results[1]["refused"]  # every rank names the same ones
    return list(results[0]["refused"])


def _holding_step6(paths: list[Path]) -> list[Path]:
    return [path for path in paths if b'"step":6,' in path.read_bytes()[:8192]]


def test_a_snapshot_that_fails_its_checksum_is_refused(tmp_path: Path) -> None:
    from shardkit.core.snapshots.format import capacity_in, data_offset

    at_five = run_on_ranks(2, _disk_at_five, root=str(tmp_path), step6="ours")[0]
    rank0s = [*tmp_path.glob("node0/rank00000.*"), *tmp_path.glob("node1/replica-of-*")]
    for path in _holding_step6(rank0s):  # both copies of rank 0's step 6: one bit flipped
        data = bytearray(path.read_bytes())
        start = data_offset(capacity_in(torch.frombuffer(data[:64], dtype=torch.uint8)))
        data[start + 5] ^= 0x10  # in the first tensor's bytes
        path.write_bytes(bytes(data))
    refused = _expect_disk(tmp_path, at_five, "checksum")
    assert any("bytes do not match their checksum" in r for r in refused), refused


def test_a_snapshot_of_the_previous_format_is_refused(tmp_path: Path) -> None:
    """Format 2 wrote the checksums as a JSON list of numbers: read as unreadable, by name."""
    import json
    import struct

    from shardkit.core.snapshots.format import (
        JSON_AT,
        REGION_AT,
        capacity_in,
        header_region,
    )

    at_five = run_on_ranks(2, _disk_at_five, root=str(tmp_path), step6="ours")[0]
    rank0s = [*tmp_path.glob("node0/rank00000.*"), *tmp_path.glob("node1/replica-of-*")]
    for path in _holding_step6(rank0s):  # both copies of rank 0's step 6, as format 2 wrote
        data = bytearray(path.read_bytes())
        capacity = capacity_in(torch.frombuffer(data[:64], dtype=torch.uint8))
        (length,) = struct.unpack("<Q", data[REGION_AT + 4 : REGION_AT + 12])
        header = json.loads(bytes(data[JSON_AT : JSON_AT + length]))
        sums = bytes.fromhex(header["checksums"])
        header["format"], header["checksums"] = 2, list(struct.unpack(f"<{len(sums) // 8}Q", sums))
        region = header_region(json.dumps(header, separators=(",", ":")).encode(), capacity)
        data[REGION_AT : REGION_AT + len(region)] = region
        path.write_bytes(bytes(data))
    refused = _expect_disk(tmp_path, at_five, "unreadable")
    assert any("format 2, this reader knows 3" in r for r in refused), refused


def test_a_snapshot_of_another_run_is_refused(tmp_path: Path) -> None:
    at_five = run_on_ranks(2, _disk_at_five, root=str(tmp_path), step6="another run")[0]
    refused = _expect_disk(tmp_path, at_five, "another run")
    assert any("run 'another-job', this job is run 'test-run'" in r for r in refused), refused


def test_a_snapshot_of_another_model_is_refused(tmp_path: Path) -> None:
    at_five = run_on_ranks(2, _disk_at_five, root=str(tmp_path), step6="another model")[0]
    refused = _expect_disk(tmp_path, at_five, "another model")
    assert any("head.weight/exp_avg: absent in the snapshot" in r for r in refused), refused


def _one_rank_step6(rank: int, world_size: int, root: str) -> None:
    app = build_app(world_size)
    app.step = 5
    snapshots = _snapshots(root, rank, every=3)
    train_app(app, 6, rank, world_size)
    snapshots.snapshot(6, {"app": app})
    snapshots.close(remove=False)


def test_a_snapshot_of_another_world_size_is_refused(tmp_path: Path) -> None:
    at_five = run_on_ranks(2, _disk_at_five, root=str(tmp_path), step6="none")[0]
    run_on_ranks(1, _one_rank_step6, root=str(tmp_path))  # a job of one rank, same directory
    refused = _expect_disk(tmp_path, at_five, "another world size")
    assert any("written at world size 1, this job has 2" in r for r in refused), refused


def _rank0_step6(rank: int, world_size: int, root: str) -> dict[str, Any] | None:
    """Rank 0's state at step 6, as its snapshot writer would copy it (rank 0 only)."""
    from shardkit.core.snapshots.contents import Layout, leaves_of
    from shardkit.core.snapshots.format import capacity_in
    from shardkit.core.snapshots.slots import map_existing

    app = build_app(world_size)
    app.step = 5
    train_app(app, 6, rank, world_size)
    leaves = leaves_of({"app": app})
    if rank != 0:
        return None
    raw = map_existing(Path(f"{root}/node0/rank00000.slot0.snap"))
    assert raw is not None
    return {
        "tensors": {k: t.detach().clone() for k, t in leaves.tensors.items()},
        "global_shapes": leaves.global_shapes,
        "values": leaves.values,
        "layout": Layout.of(leaves).to_json(),
        "capacity": capacity_in(raw),
    }


def test_a_torn_snapshot_writer_killed_mid_copy_is_refused(tmp_path: Path) -> None:
    root = str(tmp_path)
    at_five = run_on_ranks(2, _disk_at_five, root=root, step6="rank 1 only")[0]
    rank0 = run_on_ranks(2, _rank0_step6, root=root)[0]
    leaves = tmp_path / "rank0_step6.pt"
    torch.save(rank0, leaves)
    # Rank 0's writer, SIGKILLed in the middle of copying step 6 into its slot.
    command = [sys.executable, "-m", "tests.core.snapshots.torn_writer", str(leaves), root, RUN]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    refused = _expect_disk(tmp_path, at_five, "torn")
    assert "rank 0's own slot 1: torn: its writer stopped before it was complete" in refused


# --- four ranks on two nodes: replicas go to the same local rank on the next node ----------


def _four_ranks(rank: int, world_size: int, root: str, wipe: bool) -> dict[str, Any]:
    from shardkit.core import MemorySnapshots

    node = f"{root}/node{rank // 2}"  # ranks 0, 1 on node 0; ranks 2, 3 on node 1
    app = build_app(world_size)
    snapshots = MemorySnapshots(RUN, directory=node, ranks_per_node=2)
    while app.step < 3:
        train_app(app, app.step + 1, rank, world_size)
        snapshots.snapshot(app.step, {"app": app})
    snapshots.close(remove=False)
    at_three = state_of(app)
    files = sorted(p.name for p in Path(node).iterdir())
    torch.distributed.barrier()  # every rank has listed its node before one is lost
    if wipe and rank == 0:
        shutil.rmtree(f"{root}/node1")  # node 1 is lost: ranks 2 and 3 restore from node 0
    torch.distributed.barrier()
    fresh = build_app(world_size)
    point = MemorySnapshots(RUN, directory=node, ranks_per_node=2).resume({"app": fresh})
    return {
        "files": files,
        "step": point.step,
        "from_replicas": point.from_replicas,
        "same": _same(state_of(fresh), at_three),
    }


def test_four_ranks_on_two_nodes_restore_a_lost_node_from_the_other(tmp_path: Path) -> None:
    results = run_on_ranks(4, _four_ranks, root=str(tmp_path), wipe=True)
    own = ["rank00000.slot0.snap", "rank00000.slot1.snap", "rank00001.slot0.snap"]
    own += ["rank00001.slot1.snap"]
    held = [f"replica-of-rank0000{r}.slot{k}.snap" for r in (2, 3) for k in (0, 1)]
    assert results[0]["files"] == sorted(own + held)  # node 0 keeps node 1's replicas
    for result in results:
        assert result["step"] == 3 and result["same"]
        assert result["from_replicas"] == (2, 3)


def test_one_process_without_a_process_group(tmp_path: Path) -> None:
    from shardkit.core import MemorySnapshots

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    loop = {"step": 0, "rng": torch.get_rng_state()}
    with MemorySnapshots(RUN, directory=tmp_path) as snapshots:
        for step in range(1, 4):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            loop["step"] = step
            snapshots.snapshot(step, {"model": model, "optim": optimizer, "loop": loop})
        snapshots.wait()
        want = {k: v.clone() for k, v in model.state_dict().items()}
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()  # the live state moves on; no snapshot
        fresh = {"step": -1, "rng": torch.zeros_like(loop["rng"])}  # type: ignore[arg-type]
        state = {"model": model, "optim": optimizer, "loop": fresh}
        point = MemorySnapshots(RUN, directory=tmp_path).restore(state)
        assert point.step == 3 and state["loop"]["step"] == 3  # type: ignore[index]
        assert torch.equal(state["loop"]["rng"], loop["rng"])  # type: ignore[index,arg-type]
        assert all(torch.equal(want[k], model.state_dict()[k]) for k in want)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # close() freed the memory


_CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


# "cpu": every tensor staged in the buffer; "cpu:0" is another device than the tensors' "cpu",
# so every tensor is copied aside as an optimizer's host step counts are beside a GPU's state;
# "cpu-inline": one core, so no copying threads: each chunk lands on the background thread itself;
# "cuda": the real path, a GPU's state staged with the step counts copied aside (make check-gpu's
# pytest-gpu chunk runs it).
@pytest.mark.parametrize("device", ["cpu", "cpu:0", "cpu-inline", _CUDA])
def test_a_staged_snapshot_summed_in_pieces_restores_its_own_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """An accelerator's path: staged in a buffer, moved by the background thread in chunks
    through bounce buffers, summed on several threads. Each snapshot holds its step's
    values, not later ones, the optimizer's step counts included."""
    from shardkit.core import MemorySnapshots
    from shardkit.core.snapshots import device_staging
    from shardkit.core.snapshots import memory_snapshots as snapshots_module
    from shardkit.core.snapshots import writer as writer_module
    from shardkit.core.snapshots.checksum import BLOCK_BYTES

    pieces = 1 if device == "cpu-inline" else 3
    device = device.removesuffix("-inline")
    if device != "cuda":  # the host stands in for the device
        monkeypatch.setattr(snapshots_module, "staging_device", lambda *_: torch.device(device))
    monkeypatch.setattr(device_staging, "CHUNK_BYTES", 2 * BLOCK_BYTES)  # dozens of chunks
    monkeypatch.setattr(writer_module, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(writer_module, "_cores_per_rank", lambda _: pieces)
    torch.manual_seed(0)
    on = "cuda" if device == "cuda" else "cpu"
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 3)).to(on)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train() -> None:
        model(torch.randn(2, 300, device=on)).sum().backward()
        optimizer.step()

    def state() -> dict[str, torch.Tensor]:
        steps = {f"step{k}": s["step"] for k, s in enumerate(optimizer.state.values())}
        return {k: v.clone() for k, v in (model.state_dict() | steps).items()}

    kept: dict[int, dict[str, torch.Tensor]] = {}
    with MemorySnapshots(RUN, directory=tmp_path) as snapshots:
        for step in range(1, 5):
            train()
            snapshots.snapshot(step, {"model": model, "optim": optimizer})
            kept[step] = state()
        writer = snapshots._writer
        assert writer is not None and writer._staging is not None
        assert (writer._summers is not None) == (pieces > 1)
        assert writer._staging.device.type == on
        snapshots.wait()
        for _ in range(2):  # the live state moves on
            train()
        point = MemorySnapshots(RUN, directory=tmp_path).restore(
            {"model": model, "optim": optimizer}
        )
        assert point.step == 4
        assert all(torch.equal(kept[4][k], v) for k, v in state().items())
        assert not all(torch.equal(kept[3][k], v) for k, v in state().items())


def test_a_value_that_is_neither_a_tensor_nor_json_is_refused_by_key(tmp_path: Path) -> None:
    from shardkit.core import MemorySnapshots

    snapshots = MemorySnapshots(RUN, directory=tmp_path)
    with pytest.raises(TypeError, match=r"'loop/when' is a datetime.*never pickles"):
        snapshots.snapshot(1, {"loop": {"when": datetime.datetime(2026, 11, 25)}})
    snapshots.close()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("a tensor reshaped", r"model/weight: float32 \[3, 4\] in the snapshot, float32 \[4, 3\]"),
        ("a tensor of another dtype", r"model/bias: float32 \[3\] in the snapshot, float64"),
        ("a tensor more", r"model/extra: absent in the snapshot"),
        ("a plain value more", r"loop/seed: absent in the snapshot, a plain value here"),
        ("a plain value now a tensor", r"loop/step: a plain value in the snapshot, int64 \[\]"),
    ],
)
def test_a_state_whose_tensors_changed_since_the_first_snapshot_is_refused(
    tmp_path: Path, change: str, named: str
) -> None:
    """Each snapshot is checked against the first one's layout: a state that changed is
    refused by its first key that differs, and the slots keep what they held; the same state
    walked in another order still fits."""
    from shardkit.core import MemorySnapshots, SnapshotError

    def state() -> dict[str, Any]:
        return {"model": {"weight": weight, "bias": bias}, "loop": {"step": 2, "name": "x"}}

    weight, bias = torch.ones(3, 4), torch.zeros(3)
    changed = state()
    if change == "a tensor reshaped":
        changed["model"]["weight"] = torch.ones(4, 3)
    elif change == "a tensor of another dtype":
        changed["model"]["bias"] = torch.zeros(3, dtype=torch.float64)
    elif change == "a tensor more":
        changed["model"]["extra"] = torch.zeros(2)
    elif change == "a plain value more":
        changed["loop"]["seed"] = 7
    else:
        changed["loop"]["step"] = torch.tensor(2)
    snapshots = MemorySnapshots(RUN, directory=tmp_path)
    snapshots.snapshot(1, state())
    snapshots.snapshot(2, state())  # the same state: it fits (and is remembered)
    with pytest.raises(SnapshotError, match=f"step 3: the state's tensors changed.*{named}"):
        snapshots.snapshot(3, changed)
    reordered = {"loop": {"name": "x", "step": 2}, "model": {"bias": bias, "weight": weight}}
    weight += 1  # step 3's values, in the same state walked in another order
    snapshots.snapshot(3, reordered)
    snapshots.close(remove=False)  # as a killed process leaves them
    with MemorySnapshots(RUN, directory=tmp_path) as again:
        model = {"weight": torch.zeros(3, 4), "bias": torch.ones(3)}
        target: dict[str, Any] = {"model": model, "loop": {"step": 0, "name": ""}}
        assert again.restore(target).step == 3
        assert torch.equal(target["model"]["weight"], weight) and weight[0, 0] == 2
        assert torch.equal(target["model"]["bias"], bias) and target["loop"]["step"] == 2


# --- the data's checksums, on their own --------------------------------------------------------


def _random_data(nbytes: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize("nbytes", [64, 16384, 16384 * 3 + 4160])  # less than, one, 3.25 blocks
def test_the_checksums_catch_a_changed_word_swapped_words_and_a_torn_write(
    nbytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardkit.core.snapshots import checksum
    from shardkit.core.snapshots.checksum import (
        BLOCK_BYTES,
        checksum_count,
        checksums_of,
        first_mismatch,
    )

    monkeypatch.setattr(checksum, "PARALLEL_BYTES", 0)  # any size may be in pieces
    data = _random_data(nbytes)
    sums = checksums_of(data)
    assert len(sums) == 8 * checksum_count(nbytes)
    assert first_mismatch(sums, data.clone()) is None
    last = nbytes - 8
    for at in (0, 8, last):  # one bit, in the first, second and last word
        changed = data.clone()
        changed[at + 7] ^= 0x80  # the sign bit of a word, the hardest for a sum
        assert first_mismatch(sums, changed) == at // BLOCK_BYTES * BLOCK_BYTES
    for size in (8, 4):  # two 8-byte words swapped, and two float32s
        words = data.clone().view(torch.int64 if size == 8 else torch.int32)
        far = min(words.numel() - 1, 1000)
        words[[2, far]] = words[[far, 2]]
        assert first_mismatch(sums, words.view(torch.uint8)) == 0, size
    old = _random_data(nbytes) ^ 1  # a writer killed mid-copy: the first half new, the rest old
    torn = torch.cat([data[: nbytes // 2], old[nbytes // 2 :]])
    assert first_mismatch(sums, torn) is not None
    assert first_mismatch(sums[:-16], data) == 0  # a count that does not fit the data
    with ThreadPoolExecutor(2) as executor:  # in pieces of whole blocks: the same sums
        for pieces in (2, 3, 7):
            assert checksums_of(data, executor, pieces) == sums


@pytest.mark.parametrize("nbytes", [8, 16384, 16384 * 2 + 40])  # a word, a block, 2 and a bit
def test_the_checksums_are_the_formats_sums_of_words_modulo_two_to_the_64(nbytes: int) -> None:
    """The sums, computed the slow way with Python's integers: the format, whatever the code."""
    import struct

    from shardkit.core.snapshots.checksum import BLOCK_BYTES, checksums_of

    data = _random_data(nbytes)  # words of every size: the sums wrap in most blocks
    words = [value for (value,) in struct.iter_unpack("<Q", bytes(data.numpy()))]
    expected = b""
    for start in range(0, len(words), BLOCK_BYTES // 8):
        block = words[start : start + BLOCK_BYTES // 8]
        plain = sum(block) % 2**64
        weighted = sum((k + 1) * word for k, word in enumerate(block)) % 2**64
        expected += struct.pack("<QQ", plain, weighted)
    assert checksums_of(data) == expected


def test_the_slot_copy_follows_tensors_changed_in_place_replaced_or_repointed() -> None:
    """One concatenation into the slot, its byte views kept between snapshots: never stale."""
    from shardkit.core.snapshots.contents import Layout, leaves_of
    from shardkit.core.snapshots.state_copy import SlotCopier

    c = torch.tensor(7, dtype=torch.int64)  # a 0-dim tensor, as an optimizer's step
    state: dict[str, Any] = {
        "a": torch.arange(5, dtype=torch.float32),  # 20 bytes, then a gap to the next 64
        "b": torch.ones(3, 3, dtype=torch.float64),
        "c": c,
        "lr": 0.1,
    }
    layout = Layout.of(leaves_of(state))
    data = torch.zeros(layout.data_bytes, dtype=torch.uint8)  # a new slot's bytes
    views = [entry.view(data) for entry in layout.entries]
    copier = SlotCopier(layout)

    def copied_exactly() -> bool:
        leaves = leaves_of(state)
        copier.copy(data, views, leaves)
        expected = torch.zeros(layout.data_bytes, dtype=torch.uint8)
        for entry in layout.entries:
            entry.view(expected).copy_(leaves.tensors[entry.key])
        return torch.equal(data, expected)

    assert copied_exactly()
    state["a"].add_(1)  # the optimizer's step: in place
    assert copied_exactly()
    state["a"] = state["a"].detach()  # another tensor over the same memory (a state_dict())
    state["a"].add_(1)
    assert copied_exactly()
    state["b"] = state["b"] * 2  # another tensor (a state dict loaded, a DTensor re-pointed)
    assert copied_exactly()
    c.set_(torch.tensor(9, dtype=torch.int64).untyped_storage(), 0, (), ())  # other memory
    assert copied_exactly()
    state["b"] = torch.arange(18.0, dtype=torch.float64).view(3, 6)[:, ::2]  # not contiguous
    assert copied_exactly()
    state["b"] = state["b"].contiguous()
    assert copied_exactly()


def test_the_checksums_refuse_data_that_is_not_whole_words() -> None:
    from shardkit.core.snapshots.checksum import checksums_of

    with pytest.raises(ValueError, match="8-byte words"):
        checksums_of(torch.zeros(12, dtype=torch.uint8))


@pytest.mark.parametrize(
    ("cores", "allowed", "per_node", "threads"),
    [(16, 16, 8, 2), (16, 4, 8, 4), (64, 64, 1, 8), (2, 2, 2, 1), (2, 1, 1, 1)],
)
def test_the_summing_threads_are_this_ranks_share_of_its_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, allowed: int, per_node: int, threads: int
) -> None:
    """The node's cores over its ranks; a process bound to fewer cores has those; at most 8."""
    import os

    from shardkit.core.snapshots import writer
    from shardkit.core.snapshots.slots import Topology

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(allowed)))
    assert writer._cores_per_rank(Topology(RUN, 0, 16, per_node)) == threads
