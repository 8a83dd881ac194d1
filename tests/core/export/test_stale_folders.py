"""Folders of files a killed receiver left are removed by the next one made beside them.

``export/stale_folders.py``: a ``MirrorFiles`` folder holds its owner (host, process id, start
time); a process killed with SIGKILL runs no cleanup, so the next ``MirrorFiles`` under the
same parent removes the folders whose owners on this host no longer run, and leaves a running
owner's, another host's, one whose owner file is missing, and anything that is not a folder.
A process that ends with ``os._exit`` (as vLLM scripts do) runs no cleanup either.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardkit.core.export.mirror_files import MirrorFiles
from shardkit.core.export.stale_folders import OWNER_FILE, process_start, remove_stale

ROOT = Path(__file__).resolve().parents[3]

_ENDED = """
import os, signal, sys, torch
from shardkit.core.export.mirror_files import MirrorFiles
files = MirrorFiles(sys.argv[1])
files["w"] = torch.ones(1000)
print(files.folder, flush=True)
if sys.argv[2] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(0)  # as vLLM scripts end: no finalizer runs
"""


def _folder_of(parent: Path, owner: dict[str, object] | None) -> Path:
    folder = parent / f"shardkit-mirror-{len(list(parent.iterdir()))}"
    folder.mkdir()
    (folder / "0.bin").write_bytes(b"\0" * 16)
    if owner is not None:
        (folder / OWNER_FILE).write_text(json.dumps(owner))
    return folder


@pytest.mark.parametrize("end", ["killed", "os-exit"])
def test_a_killed_receivers_folder_is_removed_by_the_next_one(tmp_path: Path, end: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _ENDED, str(tmp_path), end],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == (-signal.SIGKILL if end == "killed" else 0), done.stderr[-2000:]
    left = Path(done.stdout.strip())
    assert left.is_dir() and (left / "0.bin").stat().st_size == 4000  # no cleanup ran

    files = MirrorFiles(tmp_path)

    assert not left.exists()
    assert [p for p in tmp_path.iterdir()] == [files.folder]
    files["w"] = torch.zeros(3)  # the new one works as before
    assert torch.equal(files["w"], torch.zeros(3))


def test_only_folders_of_this_hosts_processes_that_stopped_are_removed(tmp_path: Path) -> None:
    host = socket.gethostname()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = _folder_of(
            tmp_path, {"host": host, "pid": sleeper.pid, "start": process_start(sleeper.pid)}
        )
        reused = _folder_of(tmp_path, {"host": host, "pid": sleeper.pid, "start": "1"})
        other_host = _folder_of(tmp_path, {"host": host + "-other", "pid": 2**22 + 7})
        no_owner = _folder_of(tmp_path, None)
        garbled = _folder_of(tmp_path, None)
        (garbled / OWNER_FILE).write_text("{not json")
        mine = _folder_of(tmp_path, {"host": host, "pid": os.getpid(), "start": None})
        not_ours = tmp_path / "checkpoint-7"
        not_ours.mkdir()
        link = tmp_path / "shardkit-link"
        link.symlink_to(reused)

        removed = remove_stale(tmp_path)

        assert removed == [reused]  # its id runs, but a process started at another time
        for kept in (running, other_host, no_owner, garbled, mine, not_ours):
            assert kept.is_dir(), kept
        assert link.is_symlink()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert remove_stale(tmp_path) == [running]  # its owner ended since
