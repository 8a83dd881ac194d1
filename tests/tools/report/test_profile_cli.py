"""``shardkit-profile``: arguments, the environment it gives the command, the start-up hook,
exit statuses, and whole runs: one process, and torchrun with 2 ranks.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

import shardkit.tools.track.profiler  # noqa: F401  # the runs below start one in each process
from shardkit.tools.report import cli as profile_cli
from shardkit.tools.report.cli import AUTOPROFILE_DIR, ProfileOptions, main, profile_env
from shardkit.tools.report.folder import REPORT_FILES
from shardkit.tools.report.json_io import load_merged_report, load_rank_reports, rank_report_path
from tests.tools.report.reports import make_report


def _hook() -> ModuleType:
    """The start-up hook as a module of shardkit.tools (so importing it starts nothing)."""
    return importlib.import_module("shardkit.tools.report._autoprofile.sitecustomize")


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", code]
    return subprocess.run(command, env=env, capture_output=True, text=True, check=False)


# ---------------------------------------------------------------------------------------------
# Arguments and environment


def test_arguments() -> None:
    options = profile_cli._parse_args(["--out", "p", "--no-memory", "--", "torchrun", "-x", "t.py"])
    assert options == ProfileOptions(
        command=("torchrun", "-x", "t.py"), out=Path("p"), memory=False, comm=True
    )
    # Without "--", the command starts at the first word that is not an option of ours.
    options = profile_cli._parse_args(["python", "train.py", "--out", "theirs"])
    assert options.command == ("python", "train.py", "--out", "theirs")
    assert options.out == Path("shardkit-profile")


@pytest.mark.parametrize("argv", [[], ["--"], ["--no-memory", "--no-comm", "--", "python"]])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        profile_cli._parse_args(argv)
    assert exit_.value.code == 2
    assert "shardkit-profile: error:" in capsys.readouterr().err


def test_environment(tmp_path: Path) -> None:
    options = ProfileOptions(command=("python",), out=tmp_path / "p", comm=False)
    env = profile_env(options, {"PYTHONPATH": "/theirs", "KEEP": "1"})
    assert env["PYTHONPATH"] == os.pathsep.join([str(AUTOPROFILE_DIR), "/theirs"])
    assert env["KEEP"] == "1"
    hook = _hook()
    assert env[hook.ENV_DIR] == str(tmp_path / "p")
    assert (env[hook.ENV_MEMORY], env[hook.ENV_COMM]) == ("1", "0")
    assert profile_env(options, {})["PYTHONPATH"] == str(AUTOPROFILE_DIR)


def test_the_hook_and_the_cli_agree() -> None:
    hook = _hook()
    assert hook.__file__ == str(AUTOPROFILE_DIR / "sitecustomize.py")
    names = ("ENV_DIR", "ENV_MEMORY", "ENV_COMM")
    assert [getattr(hook, n) for n in names] == [getattr(profile_cli, n) for n in names]


# ---------------------------------------------------------------------------------------------
# The start-up hook


@pytest.mark.parametrize(
    ("argv", "orig_argv", "launcher"),
    [
        (["/venv/bin/torchrun"], ["/venv/bin/python", "/venv/bin/torchrun", "t.py"], True),
        (["-m"], ["python", "-m", "torch.distributed.run", "t.py"], True),
        (["-m"], ["python", "-um", "torch.distributed.run", "t.py"], True),
        (["-m"], ["python", "-X", "dev", "-W", "error", "-mtorch.distributed.run"], True),
        (["-m"], ["python", "-Xdev", "-m", "torch.distributed.launch", "t.py"], True),
        (["/x/torch/distributed/run.py"], ["python", "/x/torch/distributed/run.py"], True),
        (["t.py"], ["python", "-u", "t.py", "-m", "torch.distributed.run"], False),  # t.py's args
        (["-c"], ["python", "-c", "-m torch.distributed.run"], False),
        (["-m"], ["python", "-m", "my.trainer", "-m", "torch.distributed.run"], False),
        (["train.py"], ["python", "-u", "train.py"], False),  # a rank torchrun started
        ([], [], False),
    ],
)
def test_is_launcher(argv: list[str], orig_argv: list[str], launcher: bool) -> None:
    hook = _hook()
    assert hook.is_launcher(argv, orig_argv) is launcher
    env = {hook.ENV_DIR: "/p"}
    assert hook.should_profile(env, argv, orig_argv) is not launcher
    assert not hook.should_profile({}, argv, orig_argv)


def test_the_hook_imports_nothing_at_start_up(tmp_path: Path) -> None:
    env = profile_env(ProfileOptions(command=("x",), out=tmp_path), os.environ)
    code = (
        "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        + repr(("torch", "shardkit", "typing", "logging", "sitecustomize"))
        + "))"
    )
    result = _python(code, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['sitecustomize']"
    assert result.stderr == ""


def test_the_hook_runs_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    marker = tmp_path / "marker"
    (theirs / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    base = {**os.environ, "PYTHONPATH": str(theirs)}
    env = profile_env(ProfileOptions(command=("x",), out=tmp_path / "p"), base)
    assert _python("pass", env).returncode == 0
    assert marker.read_text() == "ran"
    (theirs / "sitecustomize.py").write_text("raise RuntimeError('their bug')\n")
    result = _python("print('still runs')", env)
    assert result.stdout == "still runs\n"
    assert "their bug" in result.stderr


def test_the_fuller_report_of_a_rank_wins(tmp_path: Path) -> None:
    hook = _hook()
    small = dataclasses.replace(make_report(0), spans=[], collectives=[])
    hook._write(str(tmp_path), small)
    hook._write(str(tmp_path), make_report(0))  # more records: replaces
    assert load_rank_reports(tmp_path) == [make_report(0)]
    hook._write(str(tmp_path), small)  # fewer: kept out
    assert load_rank_reports(tmp_path) == [make_report(0)]


def test_torchruns_rank_outlives_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    hook = _hook()
    late = dataclasses.replace(make_report(0), world_size=1)  # as seen after destroy
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    fixed = hook._with_launcher_rank(late)
    assert (fixed.rank, fixed.world_size) == (3, 4)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert hook._with_launcher_rank(late) is late


# ---------------------------------------------------------------------------------------------
# Exit statuses and an empty run


def test_nothing_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p"
    assert main(["--out", str(out), "--", sys.executable, "-c", "pass"]) == 1
    assert f"nothing was recorded in {out}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("import sys; sys.exit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", 143),
    ],
)
def test_the_commands_exit_status(tmp_path: Path, code: str, status: int) -> None:
    assert main(["--out", str(tmp_path), "--", sys.executable, "-c", code]) == status


def test_a_missing_command_is_127(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path), "--", str(tmp_path / "no-such-program")]) == 127


def test_an_earlier_runs_files_go(tmp_path: Path) -> None:
    (tmp_path / "rank-5.json").write_text("{}")
    (tmp_path / "summary.txt").write_text("old")
    (tmp_path / "notes.txt").write_text("the user's")
    main(["--out", str(tmp_path), "--", sys.executable, "-c", "pass"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------------------------------------
# Whole runs

SINGLE = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""

DISTRIBUTED = """
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
fully_shard(model[0], mesh=mesh)
fully_shard(model[2], mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.barrier()
dist.destroy_process_group()
"""


def test_a_process_that_runs_no_module_writes_nothing(tmp_path: Path) -> None:
    """Like a data-loader worker: imports torch (the profiler starts), but trains nothing."""
    env = profile_env(ProfileOptions(command=("x",), out=tmp_path), os.environ)
    code = "import torch; print(type(torch.__loader__).__name__); torch.ones(1000).sum()"
    result = _python(code, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "SourceFileLoader\n"  # torch keeps its own loader
    assert result.stderr == ""
    assert list(tmp_path.iterdir()) == []


def test_one_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the report is written here, plotless
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SINGLE))
    out = tmp_path / "prof"
    assert main(["--out", str(out), "--", sys.executable, str(script)]) == 0
    (report,) = load_merged_report(out / "report.json")
    assert (report.rank, report.world_size) == (0, 1)
    assert {s.module for s in report.spans} >= {"0", "1", "2"}
    assert report.memory is not None and report.memory.timeline
    printed = capsys.readouterr().out
    assert f"report folder: {out}" in printed
    # The folder's listing says which plots are missing, and what installs them.
    for name in ("memory.png", "timeline.png"):
        assert f"  {name:<14} skipped: matplotlib is not installed" in printed
    assert printed.rstrip().endswith('pip install "shardkit-tools[plots]"')


def test_torchrun_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(DISTRIBUTED))
    out = tmp_path / "prof"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command = [sys.executable, "-m", "shardkit.tools.report.cli", "--out", str(out), "--"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*command, *torchrun, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*REPORT_FILES.values(), "rank-0.json", "rank-1.json"]
    )
    assert "communication per step" in result.stdout
    assert f"report folder: {out}" in result.stdout
    reports = load_merged_report(out / "report.json")
    assert [(r.rank, r.world_size) for r in reports] == [(0, 2), (1, 2)]
    for report in reports:
        kinds = {c.kind for c in report.collectives}
        assert {"all_gather", "reduce_scatter"} <= kinds, kinds
        assert report.comm is not None and report.comm.steps
        # Written at exit, after destroy_process_group: the reduce-scatters of torch's
        # fully_shard still name the groups they serve, and the minimum is computed.
        reduced = [c.serves for c in report.collectives if c.kind == "reduce_scatter"]
        assert reduced == ["2", "0"] * 2, reduced
        assert report.comm.minimum_computed and report.comm.theoretical_min_bytes
        # The mesh's axis names outlive its process groups too.
        assert {c.axis for c in report.collectives if c.kind != "barrier"} == {"dp"}
    assert rank_report_path(out, 1).is_file()
    trace = json.loads((out / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
