"""The CPU time memory snapshots take: their part of the training thread, and their threads.

Both snapshot benchmarks (``bench_memory_snapshots.py`` on this machine's pool,
``cuda_memory_snapshots.py`` on a GPU node) report it beside the step ratio. A process's CPU
time mixes a snapshot's work with the step's own, which moves from block to block by more than
a snapshot costs; this counts only the snapshots': the training thread's CPU in
``MemorySnapshots.snapshot()`` and in the gradient log's optimizer hook, and the CPU of the
threads at ``SNAPSHOT_NICENESS``, which are theirs alone (the writer, its summing threads, the
snapshot group's gloo threads), read per thread from ``/proc/self/task/*/schedstat`` (Linux;
elsewhere the threads count 0).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shardkit.core import MemorySnapshots
from shardkit.core.runtime.groups import SNAPSHOT_NICENESS

__all__ = ["SnapshotCPU", "snapshot_threads_cpu"]


def snapshot_threads_cpu() -> float:
    """CPU seconds so far of this process's threads at the snapshots' niceness."""
    total = 0
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:  # not Linux
        return 0.0
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
            nice = int(stat[stat.rindex(")") + 2 :].split()[16])  # field 19 of proc(5)
            if nice == SNAPSHOT_NICENESS:
                total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total / 1e9


class SnapshotCPU:
    """Counts the CPU ``snapshots`` take, from its making on.

    Take snapshots through ``snapshot`` (it times the call on the training thread); the
    gradient log's hook, where there is one, is timed in place (it is registered again,
    wrapped: the benchmarks reach into the log for that).
    """

    def __init__(self, snapshots: MemorySnapshots, optimizer: torch.optim.Optimizer) -> None:
        self.snapshots = snapshots
        self.training = 0.0  # seconds of the training thread's CPU
        log = snapshots._log
        if log is not None:
            capture = log._capture

            def timed(*args: Any) -> None:
                started = time.thread_time()
                capture(*args)
                self.training += time.thread_time() - started

            log._handle.remove()
            log._handle = optimizer.register_step_pre_hook(timed)

    def snapshot(self, step: int, state: Mapping[str, Any]) -> None:
        """``snapshots.snapshot(step, state)``, its CPU on this thread counted."""
        started = time.thread_time()
        self.snapshots.snapshot(step, state)
        self.training += time.thread_time() - started

    def total(self) -> float:
        """CPU seconds the snapshots took so far: on the training thread, and their threads'."""
        return self.training + snapshot_threads_cpu()
