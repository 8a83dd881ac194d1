"""Memory snapshots on a GPU node: the step with a snapshot every step over the step without.

Issue 40's figure where its limit was meant to hold, on a GPU: there the snapshot's copy is a
device-to-host copy, and the host's cores that run the checksums and the exchange are not the
ones training. ``torchrun --nproc-per-node N`` (NCCL on CUDA, one rank per GPU; gloo with
``--device cpu``, the smoke run): benchmarks/gpt.py's GPT sharded by shardkit, AdamW, and
``MemorySnapshots`` with each rank its own "node" (``ranks_per_node=1``), so at W >= 2 every
snapshot is also exchanged with another rank over the snapshot group (gloo), as between two
nodes; at W=1 there is no peer, and the copy and the checksums are what is timed. Each round
trains a block of steps without snapshots and a block with one every step, alternating which
goes first; a block's figure is its mean step on the slower rank. Prints one JSON line:
the medians and each round's ratio. ``make check-gpu`` runs it (chunk ``memory-snapshots``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, run as a script

from benchmarks.gpt import batch, build, train_step
from benchmarks.snapshot_cpu import SnapshotCPU
from shardkit.core import MemorySnapshots, StateDictCache
from shardkit.core.snapshots import device_staging

SHM_NEEDED = 16 * 2**30  # the slots of the 217M GPT at W=1 and more: /dev/shm, when it has this


class _State:
    """The model and optimizer as one ``Stateful``, as a training loop snapshots them."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.state_dicts = StateDictCache(model, optimizer, keep_vars=True)
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = self.state_dicts()
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError("the benchmark never restores")


def _block(run: dict[str, Any], snapshot: bool) -> float:
    """``steps`` training steps (with a snapshot after each, or not); the mean on this rank."""
    model, optimizer, state = run["model"], run["optimizer"], run["state"]
    snapshots: MemorySnapshots = run["snapshots"]
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    seconds, own = [], run["cpu"].total()
    for _ in range(run["steps"]):
        data = batch(run["size"], state.step, rank, world).to(run["device"])
        started = time.perf_counter()
        log = snapshots._log  # the gradient log's capture, off in the blocks without snapshots
        with log.replaying() if log is not None and not snapshot else contextlib.nullcontext():
            train_step(model, optimizer, data)  # ends in loss.item(): the device is synchronized
        state.step += 1
        if snapshot:
            # Where the time goes: waiting for the previous snapshot's background work
            # (checksums, exchange), then this one's part on the training thread (copy).
            trained = time.perf_counter()
            snapshots.wait()
            waited = time.perf_counter()
            run["cpu"].snapshot(state.step, {"train": state})
            run["parts"].append((waited - trained, time.perf_counter() - waited))
        seconds.append(time.perf_counter() - started)
    snapshots.wait()  # the last one's background work stays out of the next block
    if snapshot:  # the snapshots' own CPU a step (on the training thread, and their threads')
        run["own_cpu"].append((run["cpu"].total() - own) / run["steps"])
    return statistics.mean(seconds)


def _training_thread_parts(run: dict[str, Any]) -> dict[str, float]:
    """The training thread's part of a snapshot, piece by piece (medians of 10 on this rank).

    The state's ``state_dict()`` and the walk over its leaves, the check against the first
    snapshot's layout, and the copy: the staging copy's launch (not the device's work, which
    the training thread does not wait for), or on the host the copy into a slot. Read through
    the writer's own pieces, after the rounds (the slot written last holds garbage after it).
    """
    from shardkit.core.snapshots.contents import leaves_of

    snapshots: MemorySnapshots = run["snapshots"]
    snapshots.wait()
    writer = snapshots._writer
    assert writer is not None
    times: dict[str, list[float]] = {"state_dict_and_walk_s": [], "check_s": [], "copy_s": []}
    for _ in range(10):
        started = time.perf_counter()
        leaves = leaves_of({"train": run["state"]})
        walked = time.perf_counter()
        writer._fits(leaves)
        checked = time.perf_counter()
        if writer._staging is not None:
            writer._staging.stage(leaves)
        else:
            writer._copier.copy(writer._own[0].data(), writer._views[0], leaves)
        times["state_dict_and_walk_s"].append(walked - started)
        times["check_s"].append(checked - walked)
        times["copy_s"].append(time.perf_counter() - checked)
    if run["device"] == "cuda":
        torch.cuda.synchronize()  # the launched copies done before anything else runs
    return {name: statistics.median(values) for name, values in times.items()}


def _slowest(value: float, device: str) -> float:
    """The largest ``value`` over the ranks."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _memory() -> Path:
    """Where the slots go: the node's shared memory, as in training, when it has room.

    A container's /dev/shm may be 64 MB, too small for the 217M GPT's 5 GB of slots; the temp
    directory then stands in (a file system's page cache: its writeback is extra work).
    """
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free >= SHM_NEEDED:
        return shm
    return Path(tempfile.gettempdir())


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size", default="217m", help="a model of benchmarks/gpt.py")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--chunk-mib",
        type=int,
        default=0,
        help="the staged copy's chunk (device_staging.CHUNK_BYTES; 0: its default)",
    )
    parser.add_argument(
        "--gradient-log",
        action="store_true",
        help="every 4th snapshot replicated whole, the gradient log between (optimizer=)",
    )
    args = parser.parse_args(argv)
    if args.chunk_mib:  # fewer, larger chunks: fewer handovers of the GIL, more pinned memory
        device_staging.CHUNK_BYTES = args.chunk_mib * 2**20
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build("shardkit", args.size, world, device=args.device)
    root = _memory() / f"shardkit-cuda-snapshots-{os.environ['MASTER_PORT']}"
    snapshots = MemorySnapshots(
        "cuda-snapshots",
        directory=root / f"node{rank}",
        ranks_per_node=1,
        replicate_every=4 if args.gradient_log else None,
        optimizer=optimizer if args.gradient_log else None,
    )
    run = {"model": model, "optimizer": optimizer, "state": _State(model, optimizer)}
    run |= {"snapshots": snapshots, "steps": args.steps, "size": args.size, "device": args.device}
    run |= {"parts": [], "own_cpu": [], "cpu": SnapshotCPU(snapshots, optimizer)}
    try:
        _block(run | {"steps": 2}, snapshot=True)  # warm-up: lazy init, optimizer state, slots
        run["parts"].clear()
        run["own_cpu"].clear()
        rounds = []
        for index in range(args.rounds):
            order = [False, True] if index % 2 == 0 else [True, False]
            found = {snap: _slowest(_block(run, snap), args.device) for snap in order}
            rounds.append(found)
        shared = snapshots.nbytes
        parts = _training_thread_parts(run)
        # Whether the copy was staged on the device: the writer's own state, read here only
        # to say which path the figures are of.
        staging = getattr(getattr(snapshots, "_writer", None), "_staging", None)
        path = {"staged": staging is not None, "chunk_mib": device_staging.CHUNK_BYTES // 2**20}
    finally:
        # Each rank removes its own node's folder only: a rank that removed the whole root
        # could pull a slower peer's files from under its close.
        snapshots.close()
        shutil.rmtree(root / f"node{rank}", ignore_errors=True)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    ratios = [r[True] / r[False] for r in rounds]
    if rank == 0:
        record = {
            "device": args.device,
            "size": args.size,
            "world": world,
            "gradient_log": args.gradient_log,
            "step_s": statistics.median(r[False] for r in rounds),
            "with_s": statistics.median(r[True] for r in rounds),
            "ratio": statistics.median(ratios),
            "ratios": [round(r, 4) for r in ratios],
            "shared_memory_mib_per_rank": shared / 2**20,
            "directory": str(root.parent),
            **path,
            # Rank 0's medians: the wait for the previous snapshot, the training thread's part.
            "wait_s": statistics.median(w for w, _ in run["parts"]),
            "copy_s": statistics.median(c for _, c in run["parts"]),
            # And that part piece by piece (rank 0's): where the training thread's time goes.
            "parts": parts,
            # The snapshots' own CPU a step, rank 0's median over the blocks with them: the
            # training thread's part and their threads' (the checksums, the exchange).
            "snapshot_cpu_s": statistics.median(run["own_cpu"]),
        }
        print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
