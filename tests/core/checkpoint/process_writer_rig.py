"""One rank of a training loop that saves asynchronously with the writer process, to be killed.

Run by ``test_process_writer.py``'s kill test, two processes at a time (gloo over a file
store, no torchrun):

    python -m tests.core.checkpoint.process_writer_rig RANK STORE_FILE ROOT REPORT_DIR STEPS

At start it loads every complete checkpoint under ROOT and compares it with the state of its
step (the state is a function of the step, so the oracle is exact), and writes what it found
to REPORT_DIR/verify-<pid>-rank<R>.json. Then it trains (sleeps) and saves every step,
asynchronously, until STEPS, writing its writer process's id to REPORT_DIR/writer-rank<R>.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

_ROWS, _COLUMNS = 1024, 1024  # 4 MiB per rank: a save takes a while, so kills land in one


def state_of(step: int, rank: int, mesh: Any) -> dict[str, Any]:
    """The state at ``step``: every value a function of the step (and of the rank's shard)."""
    local = torch.arange(_ROWS * _COLUMNS, dtype=torch.float32).view(_ROWS, _COLUMNS)
    local.add_(step * 7 + rank * 1_000_003)
    sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return {"w": sharded, "bias": torch.full((64,), float(step)), "meta": {"step": step}}


def _equal(loaded: dict[str, Any], expected: dict[str, Any]) -> bool:
    w, want = loaded["w"].to_local(), expected["w"].to_local()
    return bool(
        w.equal(want)
        and loaded["bias"].equal(expected["bias"])
        and loaded["meta"] == expected["meta"]
    )


def main(rank: int, store_file: str, root: str, report: str, steps: int) -> None:
    from shardkit.core import CheckpointManager

    store = dist.FileStore(store_file, 2)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    manager = CheckpointManager(root, keep=3, writer="process")
    checked, false_complete = [], []
    for path in manager.complete():
        step = int(path.name.split("_")[1])
        into = state_of(-1, rank, mesh)
        try:
            manager.load(into, path)
            good = _equal(into, state_of(step, rank, mesh))
        except Exception as error:  # a complete checkpoint that fails to load is false
            print(f"rank {rank}: {path} does not load: {error}", file=sys.stderr)
            good = False
        checked.append(step)
        if not good:
            false_complete.append(step)
    latest = manager.latest()
    result = {"checked": checked, "false_complete": false_complete, "latest": str(latest)}
    Path(report, f"verify-{os.getpid()}-rank{rank}.json").write_text(json.dumps(result))
    first = int(latest.name.split("_")[1]) + 1 if latest is not None else 0
    for step in range(first, steps):
        time.sleep(0.01)  # the training step
        manager.save(step, state_of(step, rank, mesh), async_save=True)
        Path(report, f"writer-rank{rank}").write_text(str(manager.writer_pid))
    manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    rank_arg, store_arg, root_arg, report_arg, steps_arg = sys.argv[1:6]
    main(int(rank_arg), store_arg, root_arg, report_arg, int(steps_arg))
