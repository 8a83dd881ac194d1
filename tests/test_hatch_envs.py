"""hatch's environments install what `make` installs: the pins of constraints.txt, CPU torch.

The checks read hatch's own view of the configuration (``hatch env show --json``), after it has
merged its defaults for the environments it owns (hatch-test, hatch-static-analysis, ...) with
ours: a key we do not set there keeps hatch's value (uv as installer, its own ruff and rules).
``make check-hatch`` builds the wheels and an environment for real; see scripts/check_hatch.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
# The environments `hatch run`, `hatch test` and `hatch fmt` / `hatch check` use.
MEMBER_ENVS = ["default", "hatch-test.py3.11"]
RUFF_ENVS = ["hatch-static-analysis", "hatch-check-code", "hatch-check-fmt"]


@pytest.fixture(scope="module")
def envs() -> dict[str, dict[str, Any]]:
    shown = subprocess.run(
        [sys.executable, "-m", "hatch", "env", "show", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    parsed: dict[str, dict[str, Any]] = json.loads(shown.stdout)
    return parsed


def _pins() -> dict[str, str]:
    lines = CONSTRAINTS.read_text().splitlines()
    pairs = [line.split("==") for line in lines if "==" in line and not line.startswith("#")]
    return {name.strip(): version.strip() for name, version in pairs}


def _assert_pip_under_constraints(name: str, env: dict[str, Any]) -> None:
    assert env.get("installer") == "pip", f"{name}: installer {env.get('installer')!r}"
    constraint = env.get("env-vars", {}).get("PIP_CONSTRAINT")
    assert constraint == str(CONSTRAINTS), f"{name}: PIP_CONSTRAINT is {constraint!r}"


def test_environments_that_install_torch_use_pip_under_constraints(
    envs: dict[str, dict[str, Any]],
) -> None:
    # The workspace members depend on torch>=2.10: only pip with constraints.txt (2.13.0) and
    # the machine's find-links picks the CPU wheel. Any other installer would pull CUDA wheels.
    with_members = sorted(name for name, env in envs.items() if env.get("workspace"))
    assert with_members == sorted(MEMBER_ENVS)
    for name in with_members:
        _assert_pip_under_constraints(name, envs[name])
        assert envs[name]["workspace"]["members"] == ["packages/*"], name
        # The root is not a project: installing it would run setuptools' discovery and fail.
        assert envs[name].get("skip-install") is True, name


def test_hatch_test_runs_the_suite_as_make_test_does(envs: dict[str, dict[str, Any]]) -> None:
    test_envs = [name for name in envs if name.startswith("hatch-test")]
    assert test_envs == ["hatch-test.py3.11"]  # the one Python the torch wheel is built for
    env = envs["hatch-test.py3.11"]
    assert env["env-vars"]["OMP_NUM_THREADS"] == "1"
    assert env["default-args"] == ["tests"]
    # hatch's own defaults (coverage, xdist, pytest-randomly) are replaced, not extended.
    names = {dep.split("[")[0] for dep in env["dependencies"]}
    assert not {"pytest-xdist", "pytest-randomly"} & names
    # What the suite imports beyond the packages, each pinned as make's setup installs it.
    suite_deps = {"safetensors", "pytest", "pytest-benchmark", "hypothesis"}
    assert suite_deps <= names, suite_deps - names
    assert suite_deps <= set(_pins()), suite_deps - set(_pins())


@pytest.mark.parametrize("name", RUFF_ENVS)
def test_hatch_fmt_uses_our_ruff_and_rules(envs: dict[str, dict[str, Any]], name: str) -> None:
    env = envs[name]
    _assert_pip_under_constraints(name, env)
    # Unversioned here, so constraints.txt alone decides which ruff runs.
    assert env["dependencies"] == ["ruff"]
    # "none": no config file written or extended by hatch; ruff reads pyproject.toml.
    assert env["config-path"] == "none"
    assert "ruff" in _pins()


def test_the_installed_hatch_is_the_pinned_one() -> None:
    assert importlib.metadata.version("hatch") == _pins()["hatch"]


def test_docs_env_builds_the_site_as_make_docs_does(envs: dict[str, dict[str, Any]]) -> None:
    env = envs["docs"]
    _assert_pip_under_constraints("docs", env)
    # Strict, as `make docs` and CI build it; griffe reads the sources, so no torch here.
    assert env["scripts"]["build"] == ["mkdocs build --strict -d site"]
    assert "workspace" not in env
    names = set(env["dependencies"])
    assert names <= set(_pins()), names - set(_pins())
