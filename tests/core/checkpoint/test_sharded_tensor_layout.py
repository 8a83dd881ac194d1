"""ShardedTensors whose shards are not FSDP1's one-per-rank-in-order, through ``save_dcp``.

FSDP1 places shard ``i`` on rank ``i``; a ShardedTensor may place them otherwise. Two cases
at W=2, each saved by ``save_dcp`` and by torch's ``dcp.save`` and compared (``.metadata``
in content, every tensor through ``dcp_to_torch_save``):

- shards placed in reverse (shard 0 on rank 1): still planned locally, each shard written by
  the rank it is placed on;
- two shards on rank 0: not placed with certainty here, so the save goes through DCP's
  planning (the same reason on every rank) and still writes what DCP writes.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from harness.pool import run_on_ranks
from tests.core.checkpoint.dcp_checks import assert_same, metadata_content, read_metadata

ROWS, COLUMNS = 6, 3


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLUMNS, dtype=torch.float32).reshape(ROWS, COLUMNS)


def _sharded(rank: int, shard_ranks: list[int]) -> Any:
    """The full tensor cut into equal row blocks, block ``i`` held by ``shard_ranks[i]``."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed._shard.sharded_tensor.shard import Shard

    rows = ROWS // len(shard_ranks)
    shards_metadata = [
        ShardMetadata([i * rows, 0], [rows, COLUMNS], f"rank:{owner}/cpu")
        for i, owner in enumerate(shard_ranks)
    ]
    full = _full()
    local = [
        Shard(full[m.shard_offsets[0] : m.shard_offsets[0] + rows].clone(), m)
        for m, owner in zip(shards_metadata, shard_ranks, strict=True)
        if owner == rank
    ]
    global_metadata = ShardedTensorMetadata(
        shards_metadata, torch.Size([ROWS, COLUMNS]), TensorProperties(dtype=torch.float32)
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, global_metadata)


def _save_both(rank: int, world_size: int, root: str, shard_ranks: list[int]) -> str:
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from shardkit.core import LayoutCache, save_dcp

    state = {"weight": _sharded(rank, shard_ranks), "bias": torch.ones(COLUMNS)}
    layout = LayoutCache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_save(state, checkpoint_id=f"{root}/torch")
        save_dcp(state, f"{root}/local", layout=layout)
    return layout.dcp_reason


@pytest.mark.parametrize(
    ("shard_ranks", "planned_locally"),
    [([1, 0], True), ([0, 0, 1], False)],
    ids=["reversed placement", "two shards on one rank"],
)
def test_shards_placed_otherwise_save_what_dcp_saves(
    shard_ranks: list[int], planned_locally: bool, tmp_path: Path
) -> None:
    reasons = run_on_ranks(2, _save_both, root=str(tmp_path), shard_ranks=shard_ranks)
    assert len(set(reasons)) == 1, reasons  # every rank took the same path
    if planned_locally:
        assert reasons[0] == ""
    else:
        assert "several shards" in reasons[0], reasons
    assert metadata_content(read_metadata(tmp_path / "local")) == metadata_content(
        read_metadata(tmp_path / "torch")
    )
    for name in ("torch", "local"):
        dcp_to_torch_save(tmp_path / name, tmp_path / f"{name}.pt")
    ours = torch.load(tmp_path / "local.pt", weights_only=True)
    assert_same(ours, torch.load(tmp_path / "torch.pt", weights_only=True), "")
    assert torch.equal(ours["weight"], _full())
