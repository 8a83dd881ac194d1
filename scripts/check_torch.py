"""The test suite on other torch releases: `make check-torch TORCH=2.15.0`, `make check-torch-all`.

For each release given, in a virtual environment of its own (VENVS/<release>, kept between runs):

1. torch==<release> from the package index. Except this machine's CPU wheel of 2.13.0, that is
   PyPI's Linux wheel, which brings the CUDA libraries (about 3 GB) and runs on a CPU.
2. The test dependencies `make` installs, under constraints.txt with torch pinned to the release.
3. The four packages as a user installs them (`pip install packages/core ...`: dependencies
   resolved, no constraints). pip must keep the installed torch; if it replaces it (a declared
   torch range that leaves the release out), the check fails there.
4. The packages again, editable, so that the suite runs on the working tree; then the suite.

Each release's outcome (passed, skipped with the reasons, failed) is printed and written to
VENVS/<release>/summary.json; with several releases, a table of them comes last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["packages/core", "packages/tp_adapter", "packages/legacy_fsdp_compat", "packages/tools"]
_USAGE = "check_torch.py RELEASE [RELEASE ...] --deps '...' [--no-deps '...'] [-- PYTEST_ARGS]"
_TORCH_OF = "import torch, sys; sys.stdout.write(torch.__version__)"


def _run(args: list[str], env: dict[str, str] | None = None) -> int:
    print("+", " ".join(args), flush=True)
    return subprocess.run(args, env=env).returncode


def _must(args: list[str]) -> None:
    code = _run(args)
    if code != 0:
        sys.exit(f"failed ({code}): {' '.join(args)}")


def _torch_version(python: Path) -> str:
    done = subprocess.run([str(python), "-c", _TORCH_OF], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else ""


def _constraints(release: str, venv: Path) -> Path:
    """constraints.txt with torch pinned to ``release`` in place of the default 2.13.0."""
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pinned = [f"torch=={release}" if line.startswith("torch==") else line for line in lines]
    path = venv / "constraints.txt"
    path.write_text("\n".join(pinned) + "\n")
    return path


def build(release: str, venv: Path, deps: list[str], no_deps: list[str]) -> str:
    """The release's environment, ready for the suite; returns the torch version it holds."""
    python = venv / "bin" / "python"
    if not python.exists():
        _must([sys.executable, "-m", "venv", str(venv)])
    pip = [str(python), "-m", "pip", "install", "-q"]
    if not _torch_version(python).startswith(release):
        _must([*pip, f"torch=={release}"])
    torch = _torch_version(python)
    constraints = _constraints(release, venv)
    _must([*pip, "-c", str(constraints), *deps])
    _must([*pip, "-c", str(constraints), "--no-deps", *no_deps])
    # As a user installs them: no constraints and no --no-deps, so pip resolves the packages'
    # torch requirement against the torch that is installed.
    _must([*pip, "--no-build-isolation", *(str(ROOT / p) for p in PACKAGES)])
    after = _torch_version(python)
    if after != torch:
        sys.exit(f"installing the packages replaced torch {torch} with {after}")
    editable = [arg for p in PACKAGES for arg in ("-e", str(ROOT / p))]
    _must([*pip, "--no-build-isolation", "--no-deps", *editable])
    return torch


def _outcomes(junit: Path) -> dict[str, object]:
    """Counts from pytest's JUnit XML, with each skip reason and the failed tests' ids."""
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    failed: list[str] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        skipped = case.find("skipped")
        if skipped is not None:
            counts["skipped"] += 1
            reasons[skipped.get("message", "")] += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failed.append(name)
        else:
            counts["passed"] += 1
    return {**counts, "skip_reasons": dict(reasons), "failed_tests": failed}


def check(release: str, venvs: Path, args: argparse.Namespace) -> dict[str, object]:
    """Build the release's environment and run the suite there; the outcome, also saved."""
    venv = (venvs / release).resolve()
    venv.mkdir(parents=True, exist_ok=True)
    torch = build(release, venv, args.deps.split(), args.no_deps.split())
    junit = venv / "junit.xml"
    started = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pytest = [str(venv / "bin/python"), "-m", "pytest", "-q", f"--junitxml={junit}"]
    code = _run([*pytest, *args.pytest_args], env=env)
    summary: dict[str, object] = {
        "release": release,
        "torch": torch,
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.monotonic() - started),
        "exit_code": code,
        **(_outcomes(junit) if junit.exists() else {}),
    }
    (venv / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1), flush=True)
    return summary


def _table(summaries: list[dict[str, object]]) -> str:
    rows = ["| torch | passed | skipped | failed | minutes |", "|---|---|---|---|---|"]
    for s in summaries:
        minutes = int(str(s["seconds"])) / 60
        rows.append(
            f"| {s['torch']} | {s.get('passed', 0)} | {s.get('skipped', 0)} "
            f"| {s.get('failed', 0)} | {minutes:.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    """Check each release named; exits non-zero when any release's suite failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage=_USAGE)
    parser.add_argument("releases", nargs="+", help="torch releases, e.g. 2.11.0 2.15.0")
    parser.add_argument("--venvs", type=Path, default=ROOT / ".torch-venvs")
    parser.add_argument("--deps", required=True, help="test dependencies, as make installs them")
    parser.add_argument("--no-deps", default="", help="those make installs with --no-deps")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # what follows goes to pytest
    args = parser.parse_args(argv[:split])
    args.pytest_args = argv[split + 1 :]
    summaries = [check(release, args.venvs, args) for release in args.releases]
    if len(summaries) > 1:
        print(_table(summaries))
    sys.exit(max(int(str(s["exit_code"])) for s in summaries))


if __name__ == "__main__":
    main()
