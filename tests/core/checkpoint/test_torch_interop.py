"""Checkpoints that torch's own readers and writers exchange with ``CheckpointManager``.

A checkpoint the manager saved (with its layout record; ``.metadata`` written last for
torch's readers) is read by torch's ``dcp.load`` into torch's own ``fully_shard`` model, at
the same W and another, and by ``format_utils.dcp_to_torch_save``: both give the state saved,
bit for bit. A checkpoint torch's ``dcp.save`` wrote (no marker, no record) loads through the
manager, planned by DCP from its ``.metadata`` (read without running pickled code), bit for
bit what torch's ``dcp.load`` gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from tests.core.checkpoint.checkpoint_app import build_app, same_state, state_of, train_app


def _save(rank: int, world_size: int, root: str, impl: str) -> dict[str, Any]:
    """Trained 2 steps and saved: by the manager (``impl="shardkit"``) or torch's dcp.save."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from shardkit.core import CheckpointManager

    app = build_app(world_size, impl=impl)
    train_app(app, 2, rank, world_size)
    if impl == "shardkit":
        path = CheckpointManager(root).save(2, {"app": app})
    else:
        path = Path(root) / "by_torch"
        dcp_save({"app": app}, checkpoint_id=path)
    return {"state": state_of(app), "path": str(path)}


def _load(rank: int, world_size: int, path: str, by: str) -> dict[str, Any]:
    """Loaded into torch's fully_shard by torch's dcp.load, or into shardkit's by the manager
    (and by torch's dcp.load, the oracle)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from shardkit.core import CheckpointManager

    if by == "torch":
        app = build_app(world_size, impl="torch", seed=7)
        dcp_load({"app": app}, checkpoint_id=path)
        return {"state": state_of(app), "step": app.step}
    app = build_app(world_size, seed=7)
    loaded = CheckpointManager(Path(path).parent).load({"app": app}, path)
    oracle = build_app(world_size, seed=7)
    dcp_load({"app": oracle}, checkpoint_id=path)
    return {
        "state": state_of(app),
        "step": app.step,
        "loaded": str(loaded),
        "same_as_torch": same_state(state_of(app), state_of(oracle)),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_torchs_readers_take_a_checkpoint_the_manager_saved(world: int, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = run_on_ranks(2, _save, root=str(tmp_path / "root"), impl="shardkit")
    path = saved[0]["path"]
    assert (Path(path) / "layout.json").is_file()
    for result in run_on_ranks(world, _load, path=path, by="torch"):
        assert result["step"] == 2 and same_state(result["state"], saved[0]["state"])
    if world == 2:  # the whole state in one torch.save file, read by torch's own planner
        dcp_to_torch_save(path, tmp_path / "full.pt")
        whole = torch.load(tmp_path / "full.pt", weights_only=True)["app"]
        assert int(whole["step"]) == 2
        model = {f"param.{k}": v for k, v in whole["model"].items()}
        assert model.keys() <= saved[0]["state"].keys()
        assert all(torch.equal(t, saved[0]["state"][k]) for k, t in model.items())


def test_a_checkpoint_torch_saved_loads_through_the_manager(tmp_path: Path) -> None:
    saved = run_on_ranks(2, _save, root=str(tmp_path), impl="torch")
    path = saved[0]["path"]
    assert not (Path(path) / "layout.json").exists() and not (Path(path) / "COMPLETE").exists()
    for world in (2, 3):
        for result in run_on_ranks(world, _load, path=path, by="manager"):
            assert result["loaded"] == path and result["step"] == 2
            assert result["same_as_torch"]
            assert same_state(result["state"], saved[0]["state"])
