"""The verdict on a run of torch's FSDP2 test files on both engines: what makes it fail.

A test that passes on torch's ``fully_shard`` (the baseline) and does not pass on shardkit's
fails the run, unless the list of documented differences
(``scripts/torch_fsdp2_differences.toml``) names it with the reason; so does a file whose run
timed out or crashed on either engine (no baseline, or no answer), and a run that trained on the
other engine (a leak of one engine into the other's run tests nothing). A listed difference that
passes on shardkit now is reported, to be removed from the list; on its own it does not fail the
run. The run itself is :mod:`scripts.torch_fsdp2_suite`'s; the runner is
:mod:`scripts.torch_fsdp2_tests`. Here: the list, the verdict, and the table and JSON written
from a run.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.torch_fsdp2_tests import Run, run_payload

# file::Class::test (or file::test for a module-level test function)
_TEST_ID = re.compile(r"^test_[\w]+\.py(::\w+){1,2}$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Difference:
    """A test torch passes and shardkit fails on purpose."""

    test: str
    """``file::Class::test``, as :func:`full_test_id` names the tests of a run."""
    reason: str
    """Why shardkit differs (a sentence or two)."""
    covered_by: str
    """The project's test of the behaviour instead (a path from the repository's root)."""

    def __post_init__(self) -> None:
        if not _TEST_ID.match(self.test):
            raise ValueError(f"difference {self.test!r}: not of the form file::Class::test")
        if not self.reason.strip() or not self.covered_by.strip():
            raise ValueError(f"difference {self.test!r}: needs a reason and covered_by")


def load_differences(path: Path) -> dict[str, Difference]:
    """The documented differences of a TOML file of ``[[difference]]`` tables, by test id."""
    found: dict[str, Difference] = {}
    for entry in tomllib.loads(path.read_text()).get("difference", []):
        unknown = set(entry) - {"test", "reason", "covered_by"}
        if unknown:
            raise ValueError(f"{path}: difference {entry.get('test')!r}: unknown {unknown}")
        difference = Difference(
            test=entry.get("test", ""),
            reason=entry.get("reason", ""),
            covered_by=entry.get("covered_by", ""),
        )
        if difference.test in found:
            raise ValueError(f"{path}: {difference.test} is listed twice")
        found[difference.test] = difference
    return found


def full_test_id(file_name: str, key: str) -> str:
    """``file::Class::test`` for a run's outcome key (junit's ``classname::name``)."""
    classname, _, name = key.partition("::")
    module = Path(file_name).stem
    if classname == module:
        return f"{file_name}::{name}"
    return f"{file_name}::{classname.removeprefix(module + '.').rsplit('.', 1)[-1]}::{name}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Failure:
    """A test torch passes and shardkit does not, with shardkit's error."""

    test: str
    message: str


@dataclass(kw_only=True, slots=True)
class Verdict:
    """What a run found, against the list of documented differences."""

    new_failures: list[Failure] = field(default_factory=list)
    """Not listed: each fails the run."""
    broken: list[str] = field(default_factory=list)
    """``file (engine): why``: a run that timed out, crashed or leaked; each fails the run."""
    listed_failing: list[str] = field(default_factory=list)
    """Listed differences seen as listed (torch passes, shardkit does not)."""
    listed_but_passes: list[str] = field(default_factory=list)
    """Listed differences that pass on shardkit now: remove them from the list."""
    flaky: list[Failure] = field(default_factory=list)
    """Failed in the file's run and passed when run again alone: reported, not failing."""

    @property
    def ok(self) -> bool:
        return not self.new_failures and not self.broken


def _broken(name: str, runs: Mapping[str, Run]) -> list[str]:
    found = [
        f"{name} ({mode}): {run.note}"
        for mode, run in runs.items()
        if run.note and not run.outcomes
    ]
    if runs["torch"].classes.get("shardkit", 0) or runs["shardkit"].classes.get("torch", 0):
        found.append(f"{name}: engine leak (FSDP classes of the other engine were made)")
    return found


def judge(
    results: Mapping[str, Mapping[str, Run]], differences: Mapping[str, Difference]
) -> Verdict:
    """The verdict on ``results`` (file name -> engine -> Run) given the listed differences."""
    verdict = Verdict()
    for name, runs in results.items():
        verdict.broken += _broken(name, runs)
        ours = runs["shardkit"]
        for key, outcome in runs["torch"].outcomes.items():
            test = full_test_id(name, key)
            if outcome != "passed":
                continue
            if ours.outcomes.get(key) == "passed":
                if test in differences:
                    verdict.listed_but_passes.append(test)
            elif test in differences:
                verdict.listed_failing.append(test)
            elif not (ours.note and not ours.outcomes):  # a broken run is reported as such
                message = ours.messages.get(key) or ours.note or "not run"
                verdict.new_failures.append(Failure(test=test, message=message))
    return verdict


def report(verdict: Verdict) -> list[str]:
    """The verdict as lines to print, failures first."""
    lines: list[str] = []
    if verdict.broken:
        lines += ["RUNS THAT DID NOT FINISH (each fails the run):"]
        lines += [f"  {b}" for b in verdict.broken]
    if verdict.new_failures:
        lines += ["NEW FAILURES (pass on torch, not on shardkit, not listed as a difference):"]
        for failure in verdict.new_failures:
            lines += [f"  {failure.test}", f"      {failure.message[:200]}"]
    if verdict.flaky:
        lines += ["failed in the file's run, passed run again alone (look at them):"]
        for failure in verdict.flaky:
            lines += [f"  {failure.test}", f"      {failure.message[:200]}"]
    if verdict.listed_but_passes:
        lines += ["listed but passes (remove it from the differences):"]
        lines += [f"  {t}" for t in verdict.listed_but_passes]
    if verdict.listed_failing:
        lines += [f"documented differences seen: {len(verdict.listed_failing)}"]
        lines += [f"  {t}" for t in verdict.listed_failing]
    lines.append("verdict: " + ("pass" if verdict.ok else "FAIL"))
    return lines


@dataclass(frozen=True, kw_only=True, slots=True)
class FileInfo:
    """Where a file of the run came from and how it ran (a row's first columns)."""

    commit: str
    flags: tuple[str, ...]


def _counts(run: Run) -> str:
    if run.note and not run.outcomes:
        return run.note
    return f"{run.count('passed')} / {run.count('failed')} / {run.count('skipped')}"


def table(results: Mapping[str, Mapping[str, Run]], info: Mapping[str, FileInfo]) -> str:
    """docs/torch-releases.md's table: passed / failed / skipped per engine, a row a file."""
    rows = [
        "| file | pytorch commit | flags | tests | torch | shardkit |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        file_info = info.get(name, FileInfo(commit="?", flags=()))
        flags = f"`{' '.join(file_info.flags)}`" if file_info.flags else ""
        tests = max(len(runs["torch"].outcomes), len(runs["shardkit"].outcomes))
        rows.append(
            f"| {name} | {file_info.commit[:7]} | {flags} | {tests} | "
            f"{_counts(runs['torch'])} | {_counts(runs['shardkit'])} |"
        )
    return "\n".join(rows) + "\n"


def payload(
    results: Mapping[str, Mapping[str, Run]], info: Mapping[str, FileInfo], verdict: Verdict
) -> dict[str, Any]:
    """Every outcome of the run, where each file came from, and the verdict (for ``--json``)."""
    return {
        "files": {
            name: {
                "commit": info[name].commit if name in info else None,
                "flags": list(info[name].flags) if name in info else [],
                **{mode: run_payload(run) for mode, run in runs.items()},
            }
            for name, runs in results.items()
        },
        "verdict": {
            "ok": verdict.ok,
            "new_failures": [{"test": f.test, "message": f.message} for f in verdict.new_failures],
            "broken": verdict.broken,
            "listed_failing": verdict.listed_failing,
            "listed_but_passes": verdict.listed_but_passes,
        },
    }


def write_outputs(
    results: Mapping[str, Mapping[str, Run]],
    info: Mapping[str, FileInfo],
    verdict: Verdict,
    *,
    json_path: Path | None,
    table_path: Path | None,
) -> None:
    """Write the JSON of every outcome and the Markdown table where asked."""
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        data = payload(results, info, verdict)
        json_path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    if table_path:
        table_path.parent.mkdir(parents=True, exist_ok=True)
        table_path.write_text(table(results, info))
