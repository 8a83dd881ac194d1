"""The demo's test rig: demo/train_gpt.py's own training, with ranks killed at chosen points
or profiled.

Run from the repository root in place of the script, with the script's arguments after the
rig's own:

    torchrun --standalone --nproc-per-node 2 -m tests.demo.rig \
        --kill-at 1:15:async-save --kill-log kills.log --steps 25 --ckpt-dir ckpt ...

It calls the example's `main` with a `Hooks` subclass, so the model, the data, the loop and
the checkpoints are the example's, unchanged.

`--profile DIR` runs shardkit.tools' profiler over the training: every rank writes its records
to DIR (rank-N.json), then rank 0 writes the report (summary, JSON, trace, plots) and prints
the summary (run_demo.py --profile uses it).

A kill point RANK:STEP:PHASE SIGKILLs that rank as a lost machine dies (no cleanup, no exit
handlers) when step STEP reaches PHASE:

- forward, backward: inside the middle block's forward or backward of STEP;
- save: in the training thread, while the save of STEP stages the state;
- async-save: in DCP's writer thread, while it writes the save of STEP in the background;
- node: the node's memory is lost too: its memory snapshots (the demo's --snapshot-dir, the
  folder of this torchrun node) are removed, then the rank dies inside the middle block's
  forward of STEP, as a machine that fails takes its memory with it.

The kill log records each point before it fires: torchrun --max-restarts starts the workers
again with the same command line, and a point must fire once only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from demo.config import parse_args
from demo.train_gpt import Hooks, TrainState, main, node_memory
from torch import Tensor, nn

if TYPE_CHECKING:
    from shardkit.tools.track.profiler import Profiler

PHASES = ("forward", "backward", "save", "async-save", "node")


@dataclass(frozen=True, slots=True)
class KillPoint:
    rank: int
    step: int
    phase: str

    @classmethod
    def parse(cls, text: str) -> KillPoint:
        """'RANK:STEP:PHASE' as the soak test writes it."""
        parts = text.split(":")
        if len(parts) != 3 or parts[2] not in PHASES or not all(p.isdigit() for p in parts[:2]):
            raise ValueError(f"kill point {text!r} is not RANK:STEP:PHASE with PHASE in {PHASES}")
        return cls(int(parts[0]), int(parts[1]), parts[2])

    def __str__(self) -> str:
        return f"{self.rank}:{self.step}:{self.phase}"


class Killer:
    """The kill points of this rank that have not fired yet, armed on the example's loop."""

    def __init__(self, points: Sequence[KillPoint], log: Path | None, node_memory: Path) -> None:
        self.points, self.log, self.node_memory = list(points), log, node_memory
        self.rank = -1  # known once the process group is
        self.due: set[tuple[int, str]] = set()  # (step, phase) of this rank's unfired points

    def arm(self, state: TrainState) -> None:
        fired = set(self.log.read_text().split()) if self.log and self.log.exists() else set()
        mine = [p for p in self.points if p.rank == state.rank and str(p) not in fired]
        self.due = {(p.step, p.phase) for p in mine}
        self.rank = state.rank
        if any(phase in ("forward", "backward", "node") for _, phase in self.due):
            self._arm_middle_block(state)

    def _arm_middle_block(self, state: TrainState) -> None:
        blocks = state.model.blocks
        assert isinstance(blocks, nn.ModuleList)  # the example's GPT

        def in_forward(module: nn.Module, args: Any, output: Tensor) -> None:
            step = state.step + 1  # the step being computed
            self.maybe(step, "forward")
            self.maybe(step, "node")
            if (step, "backward") in self.due and output.requires_grad:
                output.register_hook(lambda grad: self.maybe(step, "backward"))

        blocks[len(blocks) // 2].register_forward_hook(in_forward)

    def extras(self, state: TrainState) -> dict[str, Any]:
        """A checkpoint entry that kills while the save of `state.step` runs, if one is due."""
        if (state.step, "save") in self.due:
            return {"kill": KillWhenStaged(self, state.step)}
        if (state.step, "async-save") in self.due:
            return {"kill": KillWhenWritten(self, state.step)}
        return {}

    def maybe(self, step: int, phase: str) -> None:
        if (step, phase) in self.due:
            self.kill(step, phase)

    def kill(self, step: int, phase: str) -> None:
        """Record the point, then die as a lost machine does: no cleanup, no exit handlers."""
        if phase == "node":
            shutil.rmtree(self.node_memory, ignore_errors=True)
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(f"{self.rank}:{step}:{phase}\n")
                f.flush()
                os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


class KillWhenStaged:
    """A checkpoint entry (a DCP `Stateful`) that kills its rank when the save asks for its
    state, in the training thread, while the state is staged for the background write."""

    def __init__(self, killer: Killer, step: int) -> None:
        self.killer, self.step = killer, step

    def state_dict(self) -> dict[str, Any]:
        self.killer.kill(self.step, "save")
        raise AssertionError("unreachable: the process was killed")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise AssertionError("never loaded: its save never completes")


class KillWhenWritten:
    """A checkpoint value that kills its rank when DCP's writer serializes it (mid-write)."""

    def __init__(self, killer: Killer, step: int) -> None:
        self.killer, self.step = killer, step

    def __deepcopy__(self, memo: dict[int, Any]) -> KillWhenWritten:
        return self  # staging copies the state: this value must reach the writer as itself

    def __reduce__(self) -> tuple[Any, ...]:
        self.killer.kill(self.step, "async-save")
        raise AssertionError("unreachable: the process was killed")


class Rig(Hooks):
    """The rig's hooks on the example's loop: the kill points, and the profiler if asked."""

    def __init__(self, killer: Killer, profile_dir: Path | None) -> None:
        self.killer, self.profile_dir = killer, profile_dir
        self.profiler: Profiler | None = None

    def started(self, state: TrainState) -> None:
        self.killer.arm(state)
        if self.profile_dir is not None:
            self.profiler = start_profiler(self.profile_dir)

    def checkpoint_extras(self, state: TrainState) -> dict[str, Any]:
        return self.killer.extras(state)

    def finished(self, state: TrainState) -> None:
        if self.profiler is not None and self.profile_dir is not None:
            write_profile(self.profiler, self.profile_dir)


def start_profiler(folder: Path) -> Profiler:
    """A started profiler, after rank 0 removed the files of ranks this run lacks (left in
    `folder` by a bigger earlier run: the report would merge them)."""
    from shardkit.tools.track.profiler import Profiler

    if dist.get_rank() == 0:
        for path in folder.glob("rank-*.json"):
            number = path.stem.removeprefix("rank-")
            if number.isdigit() and int(number) >= dist.get_world_size():
                path.unlink()
    profiler = Profiler(comm=True, memory=True)
    profiler.start()
    return profiler


def write_profile(profiler: Profiler, folder: Path) -> None:
    """Every rank writes its records; then rank 0 merges them into the report folder."""
    from shardkit.tools.report.folder import write_report
    from shardkit.tools.report.json_io import load_rank_reports, rank_report_path, write_rank_report
    from shardkit.tools.report.text import summarize

    profiler.stop()
    report = profiler.rank_report()
    write_rank_report(rank_report_path(folder, report.rank), report)
    dist.barrier()  # every rank's file is in place before rank 0 reads the folder
    if dist.get_rank() == 0:
        reports = load_rank_reports(folder)
        write_report(folder, reports)
        print(f"\n{summarize(reports)}\nprofile report (summary, JSON, trace, plots): {folder}")


def run(argv: Sequence[str] | None = None) -> None:
    """Parse the rig's options, hand the rest to the example's `main`."""
    parser = argparse.ArgumentParser(prog="python -m tests.demo.rig", add_help=False)
    parser.add_argument("--kill-at", default="", help="RANK:STEP:PHASE,... (see the docstring)")
    parser.add_argument("--kill-log", type=Path, default=None, help="where fired points go")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR")
    args, rest = parser.parse_known_args(argv)
    points = [KillPoint.parse(p) for p in args.kill_at.split(",") if p]
    memory = node_memory(parse_args(rest)[1])  # where a "node" kill point wipes
    main(rest, Rig(Killer(points, args.kill_log, memory), args.profile))


if __name__ == "__main__":
    run()
