"""``shardkit-profile``: run a training command with a profiler in every rank, then report.

    shardkit-profile --out prof -- torchrun --nproc-per-node 2 train.py --steps 10

The command runs unchanged, with two additions to its environment: ``SHARDKIT_PROFILE_*``
variables saying where and what to record, and the ``_autoprofile`` folder first on
``PYTHONPATH``. Python imports that folder's ``sitecustomize`` at start-up in every process of
the command; in each training process it starts a :class:`~shardkit.tools.track.profiler.Profiler`
once torch is imported and writes ``rank-<RANK>.json`` at exit (see its docstring for which
processes it leaves alone). When the command is over, this merges the rank files and writes
the report folder (``shardkit.tools.report.folder.write_report``), prints the summary, and exits
with the command's own exit status.

Limitations: Python started with ``-S``, ``-E`` or ``-I`` skips ``sitecustomize`` or ignores
``PYTHONPATH``, so it records nothing; a rank killed by a signal writes no file (the report
covers the ranks that did). A ``sitecustomize`` of the user's own further down the path still
runs: ours runs it first.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shardkit.tools.report.folder import REPORT_FILES, skipped_plots, write_report
from shardkit.tools.report.json_io import load_rank_reports
from shardkit.tools.report.text import summarize

__all__ = [
    "AUTOPROFILE_DIR",
    "ENV_COMM",
    "ENV_DIR",
    "ENV_MEMORY",
    "ProfileOptions",
    "main",
    "profile_env",
    "run_profiled",
]

logger = logging.getLogger("shardkit-profile")

ENV_DIR = "SHARDKIT_PROFILE_DIR"
"""Where each rank writes its report; the ``sitecustomize`` does nothing unless it is set."""
ENV_MEMORY = "SHARDKIT_PROFILE_MEMORY"
"""'1' to track memory, '0' not to."""
ENV_COMM = "SHARDKIT_PROFILE_COMM"
"""'1' to track communication, '0' not to."""
AUTOPROFILE_DIR = Path(__file__).resolve().with_name("_autoprofile")
"""The folder put first on the command's ``PYTHONPATH``: it holds only ``sitecustomize.py``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOptions:
    """What ``shardkit-profile`` was asked to do."""

    command: tuple[str, ...]
    """The command to profile, as for ``subprocess`` (no shell)."""
    out: Path
    """The report folder."""
    memory: bool = True
    """Track memory by category, module and phase."""
    comm: bool = True
    """Track collectives and their overlap with compute."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no command to profile: put it after '--'")
        if not (self.memory or self.comm):
            raise ValueError("--no-memory and --no-comm together leave nothing to record")


def profile_env(options: ProfileOptions, base: Mapping[str, str]) -> dict[str, str]:
    """The command's environment: ``base`` plus the profiling variables and ``PYTHONPATH``."""
    env = dict(base)
    env[ENV_DIR] = str(options.out.resolve())
    env[ENV_MEMORY] = "1" if options.memory else "0"
    env[ENV_COMM] = "1" if options.comm else "0"
    paths = [str(AUTOPROFILE_DIR), *filter(None, base.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_profiled(options: ProfileOptions) -> int:
    """Runs the command under the profiler, writes the report folder, prints the summary.

    Returns:
        The command's exit status (128 + N if a signal N ended it), or 1 if it succeeded but
        nothing was recorded.
    """
    options.out.mkdir(parents=True, exist_ok=True)
    _clear_previous_run(options.out)
    logger.info("profiling into %s: %s", options.out, " ".join(options.command))
    status = _run(options.command, profile_env(options, os.environ))
    if status != 0:
        logger.warning("the command exited with status %d; reporting what was recorded", status)
    reports = load_rank_reports(options.out)
    if not reports:
        sys.stderr.write(
            f"shardkit-profile: nothing was recorded in {options.out}. The command must run "
            "Python processes that import torch, from an environment with shardkit-tools "
            "installed, and without python -S, -E or -I (they skip the start-up hook).\n"
        )
        return status or 1
    written = write_report(options.out, reports)
    sys.stdout.write(summarize(reports))
    sys.stdout.write(f"\nreport folder: {options.out}\n")
    for key, path in written.items():
        sys.stdout.write(f"  {path.name:<14} {_DESCRIPTIONS.get(key, '')}\n")
    for key, reason in skipped_plots(reports).items():
        sys.stdout.write(f"  {REPORT_FILES[key]:<14} skipped: {reason}\n")
    sys.stdout.flush()
    return status


_DESCRIPTIONS = {
    "summary": "this summary",
    "json": "every rank's records (shardkit.tools.report.json_io.load_merged_report)",
    "trace": "open in https://ui.perfetto.dev or chrome://tracing",
    "memory_plot": "memory over time by category, per rank",
    "timeline_plot": "compute vs communication per rank, exposed waits in red",
}


def _clear_previous_run(out: Path) -> None:
    """Removes an earlier run's files, so that no stale rank is merged into this report."""
    stale = [p for p in out.glob("rank-*.json") if p.is_file()]
    stale += [out / name for name in REPORT_FILES.values() if (out / name).is_file()]
    for path in stale:
        path.unlink()
    if stale:
        logger.info("removed %d files of an earlier run from %s", len(stale), out)


def _run(command: Sequence[str], env: Mapping[str, str]) -> int:
    try:
        process = subprocess.Popen(list(command), env=dict(env))
    except OSError as err:  # not found, not executable
        logger.error("cannot run %r: %s", command[0], err)
        return 127
    try:
        status = process.wait()
    except KeyboardInterrupt:
        # The command got the same Ctrl-C (one process group): let its ranks write their
        # reports and exit, then report on what they recorded.
        logger.warning("interrupted; waiting for the command to exit")
        status = process.wait()
    return 128 + -status if status < 0 else status


def _parse_args(argv: Sequence[str] | None) -> ProfileOptions:
    parser = argparse.ArgumentParser(
        prog="shardkit-profile",
        description="Run a training command with shardkit's memory and communication "
        "profiler in every rank, then write a report folder and print a summary.",
        epilog="example: shardkit-profile --out prof -- torchrun --nproc-per-node 2 train.py",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("shardkit-profile"),
        help="the report folder (default: ./shardkit-profile); an earlier run's files go",
    )
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip memory")
    parser.add_argument("--no-comm", dest="comm", action="store_false", help="skip collectives")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:  # argparse keeps the separator in a REMAINDER
        command = command[1:]
    try:
        return ProfileOptions(
            command=tuple(command), out=args.out, memory=args.memory, comm=args.comm
        )
    except ValueError as err:
        parser.error(str(err))


def main(argv: Sequence[str] | None = None) -> int:
    """The ``shardkit-profile`` console script; returns the exit status."""
    options = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="shardkit-profile: %(message)s")
    return run_profiled(options)


if __name__ == "__main__":
    sys.exit(main())
