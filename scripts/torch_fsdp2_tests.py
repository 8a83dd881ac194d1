"""Torch's own FSDP2 test files, run on torch's ``fully_shard`` and then on shardkit's.

    python scripts/torch_fsdp2_tests.py --tests .torch-tests/files [--python PY] [-k EXPR]
        [FILE ...]

torch's tests (``test/distributed/_composable/fsdp/test_fully_shard_*.py`` in the pytorch
repository) are not in the wheels, and this repository does not carry them: put copies in a
folder of your own (``.torch-tests/`` is ignored by git) and name it with ``--tests``.

Each file runs under pytest twice, in a fresh interpreter each time:

- ``torch``: torch's own ``fully_shard``. The baseline: what passes on this machine at all (most
  of these tests need CUDA and skip on a CPU).
- ``shardkit``: the same, after :func:`shardkit.core.patch_torch`, so that the tests'
  ``from torch.distributed.fsdp import fully_shard`` gets shardkit's.

The patch must come before the test module imports torch's names, and before those of the
worker processes torch's multi-process tests spawn (they import the test module afresh and never
see a pytest plugin). So the runner puts a generated ``sitecustomize.py`` on ``PYTHONPATH``,
which every interpreter of the run imports at start-up: it calls :func:`activate` here, which
patches in ``shardkit`` mode and, at exit, records how many FSDP classes each engine made (the
proof that the tests ran on the engine the mode names; shardkit's classes also subclass torch's
``FSDPModule``, so they are counted apart).

Per file it prints the tests collected and passed/failed/skipped on each engine, then every test
that passes on torch and fails on shardkit with the first line of its error. ``--json PATH``
writes all outcomes; ``-k EXPR`` runs only the tests pytest's ``-k`` selects (a fixed test
again, without the whole file). The python given with ``--python`` needs pytest and
expecttest (which ``torch.testing._internal`` imports); ``--site DIR`` adds a folder of such
packages. ``scripts/torch_fsdp2_suite.py`` (``make torch-suite``) runs the files of a manifest
with their own flags and fails on a difference not documented.
"""

from __future__ import annotations

import argparse
import atexit
import enum
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_SRC = [
    ROOT / "packages" / p / "src" for p in ("core", "tools", "tp_adapter", "legacy_fsdp_compat")
]
MODES = ("torch", "shardkit")
MODE_ENV = "SHARDKIT_TORCH_TESTS_MODE"
COUNT_ENV = "SHARDKIT_TORCH_TESTS_COUNTS"
CPU_PROCESSES_ENV = "SHARDKIT_TORCH_TESTS_CPU_PROCESSES"
ALL_ON_CPU_ENV = "SHARDKIT_TORCH_TESTS_ALL_ON_CPU"

# Imported by every interpreter of a run (pytest and the workers it spawns); kept to an import
# so that the logic stays here, typed and tested by use.
_SITECUSTOMIZE = """\
import sys
sys.path.insert(0, {scripts!r})
import torch_fsdp2_tests
torch_fsdp2_tests.activate()
"""


class _HardwareClassification(enum.Enum):
    """Stand-in for the marker newer ``torch.testing`` has: test files from torch's main use it
    as a class attribute, so without it they fail to import on older releases, on both engines.
    """

    GENERIC = "generic"
    ACCELERATOR = "accelerator"


def _add_missing_test_names() -> None:
    import torch.testing._internal.common_utils as common_utils

    if not hasattr(common_utils, "HardwareClassification"):
        common_utils.HardwareClassification = _HardwareClassification  # type: ignore[attr-defined]


def _run_process_tests_on_cpu() -> None:
    """Let torch's multi-process FSDP tests (``FSDPTest``) run on a machine without accelerators.

    Releases up to 2.15 spawn the ranks and then skip when there are fewer accelerators than
    ranks, even for tests marked ``allow_cpu=True``, which torch's main runs on gloo. Each rank
    here forms a gloo group instead and runs the test, as on main. Both engines get the same
    harness, so the torch run stays the baseline.
    """
    import torch
    import torch.distributed as dist
    from torch.testing._internal import common_fsdp
    from torch.testing._internal.common_utils import set_rng_seed

    if torch.accelerator.is_available():
        return

    # Named as the method it replaces: the spawned rank finds it on the class by that name.
    def _run(cls: Any, rank: int, test_name: str, file_name: str, pipe: Any, **_: Any) -> None:
        test = cls(test_name)
        test.rank, test.file_name = rank, file_name
        dist.init_process_group(
            init_method=test.init_method, backend="gloo", world_size=test.world_size, rank=rank
        )
        dist.barrier()
        set_rng_seed()
        test.run_test(test_name, pipe)
        dist.barrier()
        dist.destroy_process_group()

    common_fsdp.FSDPTest._run = classmethod(_run)  # type: ignore[method-assign,assignment,arg-type]


def _run_accelerator_tests_on_cpu() -> None:
    """Run the tests marked as needing accelerators on the CPU too (``allow_cpu`` everywhere).

    Many of them use only ``device_type``, which is the CPU here; those that need CUDA fail on
    both engines, and the torch run, the baseline, shows which.
    """
    from torch.testing._internal import common_distributed

    needs_accelerators = common_distributed.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = False) -> Any:
        return needs_accelerators(x, allow_cpu=True)  # type: ignore[no-untyped-call]

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu


def _defined_by_name(cls: type) -> bool:
    """Whether ``cls`` is an attribute of its module under its name (defined, not made)."""
    return getattr(sys.modules.get(cls.__module__), cls.__name__, None) is cls


def _fsdp_class_counts() -> dict[str, int]:
    """FSDP classes made so far: shardkit's, and torch's that are not shardkit's."""
    from torch.distributed.fsdp import _fully_shard as torch_fsdp

    def subclasses(cls: type) -> set[type]:
        out: set[type] = set()
        todo = [cls]
        while todo:
            sub: type
            for sub in todo.pop().__subclasses__():
                if sub not in out:
                    out.add(sub)
                    todo.append(sub)
        return out

    torch_classes = subclasses(torch_fsdp.FSDPModule)
    counts = {"torch": 0, "shardkit": 0}
    if "shardkit.core" in sys.modules:
        from shardkit.core import FSDPModule as ShardkitFSDPModule

        ours = subclasses(ShardkitFSDPModule)
        # Only the classes calls made (FSDP<Cls>, Replicate<Cls>): a class its module defines
        # by name (shardkit's ReplicateModule) is counted in every interpreter otherwise.
        counts["shardkit"] = sum(1 for c in ours if not _defined_by_name(c))
        torch_classes -= ours
    # fully_shard names its classes FSDP<module class>; other subclasses of torch's FSDPModule
    # (shardkit's TorchFacing, torch's replicate) are defined, not made by a call.
    counts["torch"] = sum(
        1
        for c in torch_classes
        if c.__name__.startswith("FSDP") and not c.__module__.startswith("shardkit")
    )
    return counts


def _write_counts(path: str) -> None:
    try:
        counts = _fsdp_class_counts()
    except Exception as exc:  # at exit, a failure to count must not mask the test's outcome
        counts = {"error": 1}
        print(f"torch_fsdp2_tests: counting FSDP classes failed: {exc!r}", file=sys.stderr)
    if counts.get("torch", 0) or counts.get("shardkit", 0) or "error" in counts:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), **counts}) + "\n")


def activate() -> None:
    """Set this interpreter up for the mode in ``$SHARDKIT_TORCH_TESTS_MODE`` (at start-up)."""
    mode = os.environ.get(MODE_ENV)
    if mode not in MODES:
        return
    _add_missing_test_names()
    if os.environ.get(CPU_PROCESSES_ENV) == "1":
        _run_process_tests_on_cpu()
    if os.environ.get(ALL_ON_CPU_ENV) == "1":
        _run_accelerator_tests_on_cpu()
    if mode == "shardkit":
        from shardkit.core import patch_torch

        patch_torch()
    counts_path = os.environ.get(COUNT_ENV)
    if counts_path:
        atexit.register(_write_counts, counts_path)


@dataclass
class Run:
    """One file on one engine."""

    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> passed/failed/skipped
    messages: dict[str, str] = field(default_factory=dict)  # test id -> first line of error
    classes: dict[str, int] = field(default_factory=dict)  # engine -> FSDP classes made
    note: str = ""  # why there are no outcomes (a timeout, a crash)

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)


_ERROR_LINE = re.compile(r"^E\s+([\w.]+(Error|Exception|Exit)\b.*)$")


def _error_line(text: str) -> str:
    """The error a failure reports. Multi-thread tests wrap each rank's error in a
    ``RuntimeError: Thread N exited with exception:``, which says nothing: the last other
    ``E   SomeError: ...`` line of pytest's report is the cause.
    """
    found = [
        m.group(1)
        for m in map(_ERROR_LINE.match, text.splitlines())
        if m and "exited with exception" not in m.group(1)
    ]
    if found:
        return found[-1]
    lines = text.strip().splitlines()
    return lines[0] if lines else "failed"


def read_junit(path: Path, run: Run) -> None:
    """Add the outcomes of pytest's junit XML at ``path`` to ``run``."""
    for case in ET.parse(path).iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = _error_line(child.text or child.get("message") or child.tag)
            elif child.tag == "skipped":
                outcome = "skipped"
                message = child.get("message", "")
        if test_id in run.outcomes and outcome == "passed":
            continue  # a teardown error is a second entry: keep the failure
        run.outcomes[test_id] = outcome
        if message:
            run.messages[test_id] = message


def run_file(
    python: str,
    test_file: Path,
    mode: str,
    site: list[Path],
    timeout: int,
    cpu_processes: bool = False,
    all_on_cpu: bool = False,
    select: str | None = None,
) -> Run:
    run = Run()
    with tempfile.TemporaryDirectory(prefix="torch-fsdp2-") as tmp:
        hook = Path(tmp) / "hook"
        hook.mkdir()
        scripts = str(Path(__file__).resolve().parent)
        (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(scripts=scripts))
        junit, counts = Path(tmp) / "junit.xml", Path(tmp) / "counts.jsonl"
        paths = [str(hook), *map(str, PACKAGE_SRC), *map(str, site)]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(paths),
            MODE_ENV: mode,
            COUNT_ENV: str(counts),
            CPU_PROCESSES_ENV: "1" if cpu_processes else "0",
            ALL_ON_CPU_ENV: "1" if all_on_cpu else "0",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        args = [
            python,
            "-m",
            "pytest",
            str(test_file),
            "-q",
            "-p",
            "no:cacheprovider",
            # the repository's pytest settings (markers, -m 'not slow') are not torch's
            "-c",
            os.devnull,
            "--rootdir",
            str(test_file.parent),
            f"--junitxml={junit}",
            *(["-k", select] if select else []),
        ]
        try:
            proc = subprocess.run(
                args, env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            run.note = f"timed out after {timeout} s"
        else:
            if not junit.exists():
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
                run.note = f"pytest exited {proc.returncode}: " + " | ".join(tail)
        if junit.exists():
            read_junit(junit, run)
        if counts.exists():
            for line in counts.read_text().splitlines():
                for engine, n in json.loads(line).items():
                    if engine != "pid":
                        run.classes[engine] = run.classes.get(engine, 0) + n
    return run


def run_payload(run: Run) -> dict[str, Any]:
    """``run`` as JSON: its outcomes, errors, FSDP classes made and note."""
    return {
        "outcomes": run.outcomes,
        "messages": run.messages,
        "classes": run.classes,
        "note": run.note,
    }


def summary(run: Run) -> str:
    """passed/failed/skipped, or why there are no outcomes."""
    if run.note and not run.outcomes:
        return run.note
    return f"{run.count('passed')}/{run.count('failed')}/{run.count('skipped')}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="test file names in --tests (default: all)")
    parser.add_argument("--tests", type=Path, required=True, help="folder of torch's test files")
    parser.add_argument("--python", default=sys.executable, help="interpreter with torch")
    parser.add_argument("--site", type=Path, action="append", default=[], help="extra packages")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per file and engine")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("-k", dest="select", help="only the tests pytest's -k EXPR selects")
    parser.add_argument(
        "--cpu-processes",
        action="store_true",
        help="run multi-process tests marked allow_cpu on gloo without accelerators, "
        "as torch's main does (releases up to 2.15 skip them)",
    )
    parser.add_argument(
        "--all-on-cpu",
        action="store_true",
        help="also run the tests marked as needing accelerators, on the CPU (with "
        "--cpu-processes); the torch run shows which of them a CPU can pass",
    )
    args = parser.parse_args(argv)

    names = args.files or sorted(p.name for p in args.tests.glob("test_fully_shard*.py"))
    results: dict[str, dict[str, Run]] = {}
    print(f"{'file':44} {'tests':>5}  torch p/f/s   shardkit p/f/s   classes t|s", flush=True)
    for name in names:
        results[name] = {
            m: run_file(
                args.python,
                args.tests / name,
                m,
                args.site,
                args.timeout,
                args.cpu_processes,
                args.all_on_cpu,
                args.select,
            )
            for m in MODES
        }
        torch_run, ours = results[name]["torch"], results[name]["shardkit"]
        made = f"{torch_run.classes.get('torch', 0)}|{ours.classes.get('shardkit', 0)}"
        if ours.classes.get("torch", 0) or torch_run.classes.get("shardkit", 0):
            made += " (engine leak!)"
        elif made == "0|0" and torch_run.count("passed") + ours.count("passed"):
            # Passes with no FSDP class made: multi-process classes that size their world by
            # torch.cuda.device_count() spawn no rank without CUDA, and torch's harness then
            # reports a pass. Nothing of either engine ran.
            made += " (no FSDP model built: passes are empty)"
        print(
            f"{name:44} {len(torch_run.outcomes):>5}  {summary(torch_run):11}   "
            f"{summary(ours):14}   {made}",
            flush=True,
        )
    print("\npass on torch, fail on shardkit:")
    for name, runs in results.items():
        for test_id, outcome in runs["torch"].outcomes.items():
            if outcome == "passed" and runs["shardkit"].outcomes.get(test_id) != "passed":
                message = runs["shardkit"].messages.get(test_id, runs["shardkit"].note)
                print(f"  {name}::{test_id.rsplit('.', 1)[-1]}\n      {message[:200]}")
    if args.json:
        payload = {
            name: {mode: run_payload(run) for mode, run in runs.items()}
            for name, runs in results.items()
        }
        args.json.write_text(json.dumps(payload, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
