"""How a ``make check-gpu`` chunk runs its commands (``Runner``) and what it reports (``Row``).

Its own module so that scripts/gpu_chunks.py and the chunks kept apart from it
(scripts/gpu_snapshot_chunk.py, scripts/gpu_planner_chunk.py) build on it without importing
each other.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "Row", "Runner", "row_dict"]

ROOT = Path(__file__).resolve().parents[1]  # commands run in the repository root

# A crash signal in an error: torchrun's report of a process ("exitcode  : -11"), or a
# command's own negative exit status ("exit -6").
_CRASH = re.compile(r"exitcode\s*:\s*-\d+|^exit -\d+", re.MULTILINE)


@dataclass(kw_only=True, slots=True)
class Row:
    """One line of the table."""

    chunk: str
    check: str
    status: str  # pass, fail (a check failed), miss (a target missed), error, skip
    figures: str = ""
    seconds: float = 0.0
    detail: str = ""  # why it failed: an error's tail, the problems found


@dataclass(kw_only=True, slots=True)
class Runner:
    """Runs one invocation's commands inside its time budget."""

    env: dict[str, str]
    deadline: float  # time.monotonic() by which everything must have finished
    gpus: int
    device: str = "cuda"
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    crashes_retried: list[str] = field(default_factory=list)
    """Each command that a crash signal killed, then ran once more (as the test harness does:
    a rare crash in torch's gloo threads must not hide the rest of the run), with its error."""

    def left(self) -> float:
        """Seconds left of the budget."""
        return self.deadline - time.monotonic()

    def run(self, label: str, cmd: list[str], timeout: float) -> tuple[list[dict[str, Any]], str]:
        """The JSON lines ``cmd`` printed, and an error ('' if none): a failure, a timeout.

        A command killed by a crash signal (a process of torchrun's, or the command itself)
        runs once more; the first run's records are dropped and its error is kept.
        """
        kept = len(self.records.get(label, []))
        records, error = self._run_once(label, cmd, timeout)
        if error and _CRASH.search(error):
            self.crashes_retried.append(f"{label}: {error[-1500:]}")
            del self.records.setdefault(label, [])[kept:]
            records, error = self._run_once(label, cmd, timeout)
        return records, error

    def _run_once(
        self, label: str, cmd: list[str], timeout: float
    ) -> tuple[list[dict[str, Any]], str]:
        limit = min(timeout, self.left())
        if limit < 10:
            return [], "not run: the time budget is spent"
        try:
            done = subprocess.run(
                cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=limit
            )
        except subprocess.TimeoutExpired as expired:
            # What it printed before the limit still counts (parity prints case by case).
            records = self._keep(label, _text(expired.stdout))
            return records, f"timed out after {limit:.0f} s\n{_text(expired.stderr)[-1500:]}"
        records = self._keep(label, done.stdout)
        if done.returncode != 0:
            return records, f"exit {done.returncode}\n{done.stderr[-3000:]}"
        return records, ""

    def _keep(self, label: str, stdout: str) -> list[dict[str, Any]]:
        records = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
        self.records.setdefault(label, []).extend(records)
        return records

    def torchrun(self, nproc: int, script: str, *args: str) -> list[str]:
        """A torchrun command line for ``nproc`` processes on this machine."""
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        return [*head, f"--nproc-per-node={nproc}", script, *args]


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def row_dict(row: Row) -> dict[str, Any]:
    """A row as JSON."""
    return asdict(row)
