"""Check the hatch workflow end to end, as on a fresh machine: `make check-hatch`.

1. `hatch build --all -t wheel` builds exactly the four packages' wheels.
2. The environment `hatch test` uses gets torch 2.13.0, the CPU wheel, and no CUDA libraries.

hatch keeps its environments in a temporary folder of its own here (HATCH_DATA_DIR and
HATCH_CACHE_DIR), so nothing from an earlier run, nor the user's own environments, can hide a
problem; that is also why this takes about a minute. tests/test_hatch_envs.py checks the
configuration itself in the default test run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["shardkit_core", "shardkit_legacy", "shardkit_tools", "shardkit_tp"]
TEST_ENV = "hatch-test.py3.11"
# Printed by the environment's Python: torch's version, then any CUDA distribution found.
_PROBE = (
    "import importlib.metadata as md, torch; print(torch.__version__); "
    "print(sorted(d.metadata['Name'] for d in md.distributions() "
    "if d.metadata['Name'].lower().startswith('nvidia')))"
)


def _hatch(args: list[str], env: dict[str, str]) -> str:
    label = "hatch " + " ".join(args[:4])  # short: the probe's code is long
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "hatch", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    print(f"{label}: {time.monotonic() - started:.1f} s")
    if done.returncode != 0:
        sys.exit(f"{label} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout


def _version() -> str:
    about = ROOT / "packages/core/src/shardkit/core/__about__.py"
    found = re.search(r'__version__ = "(.+)"', about.read_text())
    assert found is not None, about
    return found.group(1)


def check_wheels(dist: Path, env: dict[str, str]) -> None:
    """The workspace build gives one wheel per package, at the lockstep version."""
    _hatch(["build", "--all", "-t", "wheel", str(dist)], env)
    version = _version()
    expected = sorted(f"{name}-{version}-py3-none-any.whl" for name in PACKAGES)
    built = sorted(path.name for path in dist.iterdir())
    if built != expected:
        sys.exit(f"hatch build --all: expected {expected}, got {built}")


def check_cpu_torch(env: dict[str, str]) -> None:
    """The test environment, built from nothing, holds the CPU torch of constraints.txt."""
    _hatch(["env", "create", TEST_ENV], env)
    lines = _hatch(["env", "run", "-e", TEST_ENV, "--", "python", "-c", _PROBE], env)
    version, cuda = lines.strip().splitlines()[-2:]
    if version != "2.13.0+cpu" or cuda != "[]":
        sys.exit(f"{TEST_ENV}: torch {version}, CUDA distributions {cuda}")


def main() -> None:
    """Runs both checks in a scratch hatch data folder; exits non-zero on the first failure."""
    with tempfile.TemporaryDirectory(prefix="shardkit-hatch-") as scratch:
        env = {
            **os.environ,
            "HATCH_DATA_DIR": f"{scratch}/data",
            "HATCH_CACHE_DIR": f"{scratch}/cache",
        }
        check_wheels(Path(scratch) / "dist", env)
        check_cpu_torch(env)
    print("hatch: four wheels built; torch 2.13.0+cpu in a fresh test environment")


if __name__ == "__main__":
    main()
