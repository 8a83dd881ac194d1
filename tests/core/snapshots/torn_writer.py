"""A memory snapshot's writer killed in the middle of its copy: what a torn snapshot is.

Run by tests/core/snapshots/test_memory_snapshots.py in a process of its own:

    python -m tests.core.snapshots.torn_writer LEAVES ROOT RUN_ID

LEAVES holds rank 0's state at step 6 as its writer copies it (tensors, plain values, layout,
the slot's header capacity). The real writer (``SnapshotWriter``) copies it into rank 0's next
slot under ROOT/node0; one tensor in the middle of the layout SIGKILLs the process when it is
copied, as a lost machine dies: no cleanup, no exit handlers.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from shardkit.core.snapshots.contents import Layout, Leaves
from shardkit.core.snapshots.slots import SnapshotDirectory, Topology
from shardkit.core.snapshots.writer import SnapshotWriter
from shardkit.core.snapshots.writer_plan import WriterPlan


class KillOnCopy(torch.Tensor):
    """A tensor whose copy into the snapshot kills this process, the tensors before it copied.

    The writer copies every tensor in one call (a concatenation of their bytes into the slot,
    or a foreach copy): this one copies what comes before it in that call, then dies, so the
    slot is left half written.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.cat and kwargs and "out" in kwargs:
            written = 0
            for piece in args[0]:
                if isinstance(piece, KillOnCopy):
                    break
                kwargs["out"][written : written + piece.numel()].copy_(piece)
                written += piece.numel()
            os.kill(os.getpid(), signal.SIGKILL)
        if func is torch._foreach_copy_:
            destinations, sources = args[0], args[1]
            for destination, source in zip(destinations, sources, strict=True):
                if isinstance(source, KillOnCopy):
                    break
                destination.copy_(source)
            os.kill(os.getpid(), signal.SIGKILL)
        if func is torch.Tensor.copy_:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]


def main(leaves_file: str, root: str, run_id: str) -> None:
    saved = torch.load(leaves_file, weights_only=True)
    tensors: dict[str, torch.Tensor] = saved["tensors"]
    middle = sorted(tensors)[len(tensors) // 2]
    tensors[middle] = tensors[middle].as_subclass(KillOnCopy)
    shapes = {key: tuple(shape) for key, shape in saved["global_shapes"].items()}
    leaves = Leaves(tensors, shapes, saved["values"])
    plan = WriterPlan(
        topology=Topology(run_id, rank=0, world_size=2, ranks_per_node=1),
        layout=Layout.from_json(saved["layout"]),
        capacity=saved["capacity"],
        slots=2,
    )
    writer = SnapshotWriter(plan, SnapshotDirectory(Path(root) / "node0", 0))
    writer.write(6, leaves)
    raise AssertionError("unreachable: the copy kills the process")


if __name__ == "__main__":
    main(*sys.argv[1:4])
