"""torch's own FSDP2 test files as a guard: the files of a manifest, run on both engines, judged.

    python scripts/torch_fsdp2_suite.py check [--manifest M] [--tests DIR]
    python scripts/torch_fsdp2_suite.py run [--manifest M] [--tests DIR] [--site DIR]
        [--differences FILE] [--json PATH] [--table PATH] [--timeout S] [-k EXPR] [FILE ...]

The manifest (``scripts/torch_fsdp2_suite.toml``) names each file of torch's
``test/distributed/_composable/fsdp/``, the pytorch commit it comes from, its sha256, and the
flags of :mod:`scripts.torch_fsdp2_tests` it runs with. The files are not in this repository
(torch's code is not ours to carry): ``check`` says which are missing or differ from the
manifest's, and how to get each from a pytorch checkout. ``run`` checks them, runs each named
file (default: all) on torch's ``fully_shard`` and on shardkit's with its flags, prints the
counts per file, then the verdict of :mod:`scripts.torch_fsdp2_guard` against the list of
documented differences, writes every outcome (``--json``) and docs/torch-releases.md's table
(``--table``), and exits 1 where the verdict fails. ``make torch-suite`` runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.torch_fsdp2_guard import (  # noqa: E402  (after the path)
    Difference,
    Failure,
    FileInfo,
    Verdict,
    full_test_id,
    judge,
    load_differences,
    report,
    write_outputs,
)
from scripts.torch_fsdp2_tests import MODES, Run, run_file, summary  # noqa: E402

MANIFEST = ROOT / "scripts" / "torch_fsdp2_suite.toml"
TESTS = ROOT / ".torch-tests" / "files"
SOURCE_FOLDER = "test/distributed/_composable/fsdp"
FLAGS = ("--cpu-processes", "--all-on-cpu")
_HEX = re.compile(r"^[0-9a-f]+$")


@dataclass(frozen=True, kw_only=True, slots=True)
class SuiteFile:
    """One file of torch's FSDP2 tests, as the manifest names it."""

    name: str
    """Its name in the pytorch repository's ``test/distributed/_composable/fsdp/``."""
    commit: str
    """The pytorch commit it is taken from (40 hex digits)."""
    sha256: str
    """Of its bytes at that commit."""
    flags: tuple[str, ...] = ()
    """Flags of scripts/torch_fsdp2_tests.py it runs with (``--cpu-processes``, ...)."""
    run: bool = True
    """False for a support module the test files import (``_test_fully_shard_common.py``)."""

    def __post_init__(self) -> None:
        if "/" in self.name or not self.name.endswith(".py"):
            raise ValueError(f"manifest: {self.name!r} is not a file name")
        if len(self.commit) != 40 or not _HEX.match(self.commit):
            raise ValueError(f"manifest: {self.name}: commit {self.commit!r} is not 40 hex")
        if len(self.sha256) != 64 or not _HEX.match(self.sha256):
            raise ValueError(f"manifest: {self.name}: sha256 {self.sha256!r} is not 64 hex")
        unknown = set(self.flags) - set(FLAGS)
        if unknown:
            raise ValueError(f"manifest: {self.name}: unknown flags {sorted(unknown)}")

    @property
    def source_path(self) -> str:
        return f"{SOURCE_FOLDER}/{self.name}"

    @property
    def info(self) -> FileInfo:
        return FileInfo(commit=self.commit, flags=self.flags)


def load_manifest(path: Path) -> list[SuiteFile]:
    """The files a TOML manifest of ``[[file]]`` tables names, in its order."""
    files: list[SuiteFile] = []
    for entry in tomllib.loads(path.read_text()).get("file", []):
        unknown = set(entry) - {"name", "commit", "sha256", "flags", "run"}
        if unknown:
            raise ValueError(f"{path}: {entry.get('name')!r}: unknown keys {sorted(unknown)}")
        files.append(
            SuiteFile(
                name=entry["name"],
                commit=entry["commit"],
                sha256=entry["sha256"],
                flags=tuple(entry.get("flags", ())),
                run=entry.get("run", True),
            )
        )
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a file is named twice")
    return files


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_files(files: list[SuiteFile], folder: Path) -> list[str]:
    """``name: missing`` or ``name: differs from the manifest's`` for each file not as named."""
    problems: list[str] = []
    for suite_file in files:
        path = folder / suite_file.name
        if not path.is_file():
            problems.append(f"{suite_file.name}: missing")
        elif sha256_of(path) != suite_file.sha256:
            problems.append(f"{suite_file.name}: differs from the manifest's (sha256)")
    return problems


def how_to_get(files: list[SuiteFile], folder: Path) -> list[str]:
    """The commands that copy ``files`` out of a pytorch checkout into ``folder``."""
    lines = [
        "Copy each from a pytorch checkout at its commit (git clone "
        "https://github.com/pytorch/pytorch; a commit no branch of yours holds: "
        "git -C pytorch fetch origin COMMIT):",
        f"  mkdir -p {folder}",
    ]
    lines += [
        f"  git -C pytorch show {f.commit}:{f.source_path} > {folder / f.name}" for f in files
    ]
    return lines


def _check(files: list[SuiteFile], folder: Path) -> bool:
    problems = check_files(files, folder)
    if not problems:
        print(f"{len(files)} files in {folder} match the manifest", flush=True)
        return True
    print(f"{len(problems)} of {len(files)} files in {folder} are not the manifest's:")
    print("\n".join(f"  {p}" for p in problems))
    wrong = {p.split(":", 1)[0] for p in problems}
    print("\n".join(how_to_get([f for f in files if f.name in wrong], folder)), flush=True)
    return False


def _selected(files: list[SuiteFile], names: list[str]) -> list[SuiteFile]:
    """The runnable files ``names`` names (all where none); KeyError for a name not among them."""
    runnable = {f.name: f for f in files if f.run}
    return [runnable[n] for n in names] if names else list(runnable.values())


def _run_all(files: list[SuiteFile], args: argparse.Namespace) -> dict[str, dict[str, Run]]:
    results: dict[str, dict[str, Run]] = {}
    print(f"{'file':44} {'tests':>5}  torch p/f/s   shardkit p/f/s   classes t|s", flush=True)
    for suite_file in files:
        runs = {
            mode: run_file(
                args.python,
                args.tests / suite_file.name,
                mode,
                args.site,
                args.timeout,
                cpu_processes="--cpu-processes" in suite_file.flags,
                all_on_cpu="--all-on-cpu" in suite_file.flags,
                select=args.select,
            )
            for mode in MODES
        }
        results[suite_file.name] = runs
        torch_run, ours = runs["torch"], runs["shardkit"]
        made = f"{torch_run.classes.get('torch', 0)}|{ours.classes.get('shardkit', 0)}"
        print(
            f"{suite_file.name:44} {len(torch_run.outcomes):>5}  {summary(torch_run):11}   "
            f"{summary(ours):14}   {made}",
            flush=True,
        )
    return results


def retry_alone(
    verdict: Verdict, files: list[SuiteFile], args: argparse.Namespace, runner: Any = None
) -> None:
    """Run each file's new failures once more on shardkit, alone (``-k``).

    A test that passes then failed in the file's run for a reason of the run's (torch's
    threaded test harness, for one, can let a failed test's exception reach the next test:
    "dictionary changed size during iteration" in its ``exception_handle``): it moves to
    ``verdict.flaky``, reported but not failing. The others stay new failures.
    """
    run = runner or run_file
    by_name = {f.name: f for f in files}
    by_file: dict[str, list[Failure]] = {}
    for failure in verdict.new_failures:
        by_file.setdefault(failure.test.split("::", 1)[0], []).append(failure)
    still: list[Failure] = []
    for name, failures in by_file.items():
        flags = by_name[name].flags
        select = " or ".join(f.test.rsplit("::", 1)[-1] for f in failures)
        again = run(
            args.python,
            args.tests / name,
            "shardkit",
            args.site,
            args.timeout,
            cpu_processes="--cpu-processes" in flags,
            all_on_cpu="--all-on-cpu" in flags,
            select=select,
        )
        passed = {full_test_id(name, k) for k, o in again.outcomes.items() if o == "passed"}
        for failure in failures:
            (verdict.flaky if failure.test in passed else still).append(failure)
    verdict.new_failures = still


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("check", "run"))
    parser.add_argument("files", nargs="*", help="test files of the manifest (default: all)")
    parser.add_argument("--manifest", type=Path, default=MANIFEST)
    parser.add_argument("--tests", type=Path, default=TESTS, help="folder of torch's files")
    parser.add_argument("--python", default=sys.executable, help="interpreter with torch")
    parser.add_argument("--site", type=Path, action="append", default=[], help="extra packages")
    parser.add_argument("--timeout", type=int, default=2400, help="seconds per file and engine")
    parser.add_argument("--differences", type=Path, help="the documented differences (TOML)")
    parser.add_argument("--json", type=Path, help="write every outcome and the verdict here")
    parser.add_argument("--table", type=Path, help="write the Markdown table of counts here")
    parser.add_argument("-k", dest="select", help="only the tests pytest's -k EXPR selects")
    # intermixed: the file names may follow the options (make's FILES after -k)
    args = parser.parse_intermixed_args(argv)
    args.tests = args.tests.resolve()
    args.site = [site.resolve() for site in args.site]

    files = load_manifest(args.manifest)
    if not _check(files, args.tests):
        return 2
    if args.command == "check":
        return 0
    differences: dict[str, Difference] = (
        load_differences(args.differences) if args.differences else {}
    )
    try:
        selected = _selected(files, args.files)
    except KeyError as exc:
        parser.error(f"not a test file of the manifest: {exc}")
    results = _run_all(selected, args)
    verdict = judge(results, differences)
    if verdict.new_failures:
        print(f"running {len(verdict.new_failures)} new failures again, alone", flush=True)
        retry_alone(verdict, selected, args)
    print("\n" + "\n".join(report(verdict)), flush=True)
    info = {f.name: f.info for f in files}
    write_outputs(results, info, verdict, json_path=args.json, table_path=args.table)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
