"""A checkpoint directory the manager deletes stops being a checkpoint before its data goes.

``rmtree`` deletes in directory order, so a process killed while it ran could leave the
``COMPLETE`` marker (the manager's) or ``.metadata`` (torch's readers') beside missing data
files. The 20-kill test found the second: a step saved again, killed while the old directory
was being removed, left a directory that torch's ``dcp.load`` would take whole.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardkit.core.checkpoint import publish


def _checkpoint(path: Path) -> Path:
    path.mkdir()
    for name in ("COMPLETE", ".metadata", "__0_0.distcp", "__1_0.distcp", "layout.json"):
        (path / name).write_bytes(b"x")
    return path


def test_the_markers_go_before_any_data_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[set[str]] = []

    def killed_at_once(path: Path, ignore_errors: bool = False) -> None:
        seen.append({p.name for p in Path(path).iterdir()})
        raise KeyboardInterrupt  # the process dies here: nothing more is deleted

    monkeypatch.setattr(shutil, "rmtree", killed_at_once)
    checkpoint = _checkpoint(tmp_path / "step_00000036")
    with pytest.raises(KeyboardInterrupt):
        publish.remove(checkpoint)
    assert seen == [{"__0_0.distcp", "__1_0.distcp", "layout.json"}]  # no reader takes it


def test_a_partial_save_is_cleared_the_same_way(tmp_path: Path) -> None:
    partial = _checkpoint(tmp_path / ".step_00000036.partial")
    publish.remove(partial, ignore_errors=True)
    assert not partial.exists()
    publish.remove(partial, ignore_errors=True)  # nothing there: nothing to do
