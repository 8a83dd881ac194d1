"""DCP checkpoints move between torch's fully_shard and shardkit's, both ways.

A model sharded by one implementation trains 2 AdamW steps and saves model and optimizer state
(``get_state_dict`` + ``dcp.save``); a model sharded by the other loads it and trains 3 more
steps, which must give the losses of the saving run going on without stopping. Both write the
same checkpoint layout: the same keys, global shapes, dtypes and chunks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from harness.pool import run_on_ranks
from tests.core.ckpt_helpers import load_body, save_body

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One checkpoint per implementation after the same 2 steps; rank 0's saving run each."""
    runs: dict[str, dict[str, Any]] = {}
    for impl in ("torch", "shardkit"):
        path = tmp_path_factory.mktemp(f"ckpt_{impl}")
        results = run_on_ranks(WORLD_SIZE, save_body, impl=impl, hsdp=None, path=str(path))
        runs[impl] = dict(results[0], path=str(path))
    return runs


@pytest.mark.parametrize(
    ("saver", "loader"),
    [
        pytest.param("torch", "shardkit", id="torch-to-shardkit"),
        pytest.param("shardkit", "torch", id="shardkit-to-torch"),
    ],
)
def test_load_the_other_implementations_checkpoint(
    checkpoints: dict[str, dict[str, Any]], saver: str, loader: str
) -> None:
    saved = checkpoints[saver]
    results = run_on_ranks(WORLD_SIZE, load_body, impl=loader, hsdp=None, path=saved["path"])
    for rank, result in enumerate(results):
        for part in ("model", "optim"):
            assert result[part].keys() == saved[part].keys(), (rank, part)
            differs = [n for n, v in saved[part].items() if not result[part][n].equal(v)]
            assert differs == [], (rank, part, differs)
        assert result["after"] == pytest.approx(saved["after"], rel=1e-5), rank


def test_both_train_alike(checkpoints: dict[str, dict[str, Any]]) -> None:
    """The premise of the cross checks: before and after the save, the two runs agree."""
    ours, theirs = checkpoints["shardkit"], checkpoints["torch"]
    assert ours["before"] + ours["after"] == pytest.approx(
        theirs["before"] + theirs["after"], rel=1e-5
    )


def _layout(path: str) -> dict[str, Any]:
    """What a checkpoint holds, per key: (global size, dtype, sorted chunks) or the kind."""
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    out: dict[str, Any] = {}
    for key, item in metadata.items():
        if isinstance(item, TensorStorageMetadata):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in item.chunks)
            out[key] = (tuple(item.size), item.properties.dtype, chunks)
        else:
            out[key] = type(item).__name__
    return out


def test_same_checkpoint_layout(checkpoints: dict[str, dict[str, Any]]) -> None:
    ours, theirs = _layout(checkpoints["shardkit"]["path"]), _layout(checkpoints["torch"]["path"])
    assert sorted(ours) == sorted(theirs)
    assert {k: (v, theirs[k]) for k, v in ours.items() if v != theirs[k]} == {}
    # Uneven dims are chunked as torch.chunk does; padding never reaches the file.
    assert ours["model.tok.weight"][2] == [((0, 0), (19, 16)), ((19, 0), (18, 16))]
    assert ours["optim.state.tok.weight.exp_avg"][2] == ours["model.tok.weight"][2]
    assert Path(checkpoints["shardkit"]["path"], ".metadata").is_file()
