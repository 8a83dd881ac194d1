"""Profiler: CommTracker and MemoryTracker together, sharing one view of modules and phases."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.tools.records import RankReport
from shardkit.tools.track.comm import CommTracker, rank_and_world
from shardkit.tools.track.memory import MemoryTracker
from shardkit.tools.track.scope import ModuleScope
from shardkit.tools.track.tracking import Tracker

__all__ = ["Profiler"]


class Profiler(Tracker):
    """Tracks communication and memory of this rank; ``rank_report()`` feeds the reports.

    Args:
        modules: the models (found on their first forward otherwise).
        optimizers: optimizers whose state to count (found on their first step otherwise).
        comm: track collectives.
        memory: track memory.
        theoretical_min_bytes: bytes a rank must send per step, for the comparison.
        meshes: DeviceMeshes whose axes name the collectives (see :class:`CommTracker`).
    """

    def __init__(
        self,
        *modules: nn.Module,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        comm: bool = True,
        memory: bool = True,
        theoretical_min_bytes: int | None = None,
        meshes: Iterable[DeviceMesh] = (),
    ) -> None:
        self.scope = ModuleScope()
        self.comm = (
            CommTracker(
                theoretical_min_bytes=theoretical_min_bytes, scope=self.scope, meshes=meshes
            )
            if comm
            else None
        )
        self.memory = (
            MemoryTracker(*modules, optimizers=optimizers, scope=self.scope) if memory else None
        )
        self._running = False

    def start(self) -> Profiler:
        """Start both trackers (what ``with`` does)."""
        if self._running:
            raise RuntimeError("Profiler is already running")
        self.scope.start()
        if self.comm is not None:
            self.comm.start()
        if self.memory is not None:
            self.memory.start()
        self._running = True
        return self

    def stop(self) -> None:
        """Stop both trackers; what they recorded stays available."""
        if not self._running:
            return
        if self.memory is not None:
            self.memory.stop()
        if self.comm is not None:
            self.comm.stop()
        self.scope.stop()
        self._running = False

    def rank_report(self) -> RankReport:
        """Everything recorded on this rank."""
        memory = self.memory.report() if self.memory is not None else None
        if self.comm is not None:  # it shares our scope: its spans and origin are ours
            return dataclasses.replace(self.comm.rank_report(), memory=memory)
        rank, world = rank_and_world()
        return RankReport(
            rank=rank,
            world_size=world,
            clock_origin_unix_s=self.scope.t0_unix,
            spans=list(self.scope.spans),
            memory=memory,
        )
