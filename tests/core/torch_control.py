"""torch's ``fully_shard`` as the control on programs it cannot train: run apart, bounded.

On such programs torch's gloo collectives can abort the process (a receive paired with a longer
message), which would take a worker of the shared pool with it. So the control runs in its own
two processes (``torchrun``), with a short process-group timeout and a bound on the whole run,
and reports what happened to each rank: ``trained``, the exception it raised, or that the
launch crashed or hung.

Run as ``python -m tests.core.torch_control MODULE:FUNCTION``; ``FUNCTION(rank, world_size)``
returns the rank's outcome as a string.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

__all__ = ["ControlOutcome", "run_control"]

_ROOT = Path(__file__).resolve().parents[2]


class ControlOutcome:
    """What torch did: the launch's exit code and each rank's reported outcome."""

    def __init__(self, returncode: int | None, outcomes: dict[int, str], output: str) -> None:
        self.returncode = returncode  # None: killed at the bound (a hang)
        self.outcomes = outcomes
        self.output = output

    @property
    def trained(self) -> bool:
        """Whether every rank finished training with no error."""
        return self.returncode == 0 and all(o == "trained" for o in self.outcomes.values())

    def __repr__(self) -> str:
        tail = self.output[-400:]
        return f"ControlOutcome(rc={self.returncode}, outcomes={self.outcomes}, tail={tail!r})"


def run_control(target: str, *, world_size: int = 2, bound_s: float = 60.0) -> ControlOutcome:
    """Launch ``target`` (``module:function``) on ``world_size`` gloo ranks under torchrun."""
    folder = tempfile.mkdtemp(prefix="torch-control-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDKIT_HANG_TIMEOUT": "0", _DIR: folder}
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world_size}",
        "--standalone", "-m", "tests.core.torch_control", target,
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=bound_s
        )
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout or b""
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        return ControlOutcome(None, _outcomes(folder), text)
    return ControlOutcome(done.returncode, _outcomes(folder), done.stdout + done.stderr)


_DIR = "SHARDKIT_CONTROL_DIR"


def _outcomes(folder: str) -> dict[int, str]:
    found = {int(p.stem.removeprefix("rank")): p.read_text() for p in Path(folder).glob("rank*")}
    shutil.rmtree(folder, ignore_errors=True)
    return found


def _main(target: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=15))
    module, _, name = target.partition(":")
    function = getattr(importlib.import_module(module), name)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        outcome = str(function(rank, world))
    except Exception as error:  # the control reports whatever torch raises
        outcome = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    (Path(os.environ[_DIR]) / f"rank{rank}").write_text(outcome)
    os._exit(0)  # no teardown: a group left mid-collective would hang it


if __name__ == "__main__":
    _main(sys.argv[1])
