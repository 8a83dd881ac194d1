"""The ``shardkit-convert`` console script: its help, its progress lines, ``--quiet``, its exits."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from shardkit.legacy.convert.cli import main
from tests.legacy.convert_support import (
    SETTINGS,
    Fsdp1Run,
    Setting,
    assert_same_tensors,
    read_output,
)

Checkpoints = Callable[[Setting], Fsdp1Run]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "shardkit-convert"


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, run from the repository root (so tests.* imports)."""
    return subprocess.run(
        [str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_help_explains_each_mode() -> None:
    done = _script("--help")
    assert done.returncode == 0, done.stderr
    for text in ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT", "--world-size"):
        assert text in done.stdout, text
    local = _script("local", "--help")
    for option in ("--model", "--world-size", "--wrap", "--wrap-policy", "--use-orig-params",
                   "--param-dtype", "--output", "--quiet"):  # fmt: skip
        assert option in local.stdout, option


def test_the_console_script_converts_with_progress(
    fsdp1_checkpoints: Checkpoints, tmp_path: Path
) -> None:
    run = fsdp1_checkpoints(SETTINGS["W2-orig-bf16"])
    out = tmp_path / "model.safetensors"
    done = _script("local", *run.local_files, "-o", str(out), *run.setting.local_args())
    assert done.returncode == 0, done.stderr
    assert_same_tensors(read_output(out), run.full)
    lines = [line for line in done.stderr.splitlines() if "] " in line]
    units = ["blocks.0", "blocks.1", "blocks.2", "(root)", "buffers"]
    assert [line.split("] ")[1].split(":")[0] for line in lines] == units, done.stderr
    assert lines[0].startswith("shardkit-convert: [1/5] blocks.0: 12 tensor(s)"), lines[0]


def test_quiet_says_nothing(
    fsdp1_checkpoints: Checkpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = fsdp1_checkpoints(SETTINGS["W2-flat"])
    full = str(run.folder / "full.pt")
    assert main(["full", full, "-o", str(tmp_path / "a"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["full", full, "-o", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "[2/8] tok: 1 tensor(s), 888 B" in err and "wrote " in err, err


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["local", "x.pt", "-o", str(tmp_path / "o"), "--world-size", "2"]
    with pytest.raises(SystemExit) as exited:
        main([*args, "--model", "no_such_module:build"])
    assert exited.value.code == 2
    assert "--model 'no_such_module:build'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(args)  # local mode needs the model
    assert exited.value.code == 2
    assert list(tmp_path.iterdir()) == []
