"""FSDP1's ShardedTensors' shards read once per layout, not at every save (issue 85).

A rank reads each ShardedTensor's W shards in Python to plan a save (20 to 45 ms a tensor at
8,192 shards), and FSDP1 builds new ShardedTensors at every ``state_dict()``. Saved three
times at W=2 by ``save_dcp`` with one ``LayoutCache`` (each save from a fresh
SHARDED_STATE_DICT of ``shardkit.legacy``), the shards are read at the first save only; every
checkpoint holds the same tensors, read back whole by torch's ``dcp_to_torch_save``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from harness.pool import run_on_ranks
from tests.legacy.ckpt_support import state_dict_of
from tests.legacy.legacy_parity import LegacyRun, wrap_model

RUN = LegacyRun(model="mlp")


def _save_three_times(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from shardkit.core import LayoutCache, save_dcp
    from shardkit.core.checkpoint.local_plan import sharded_tensor_chunks

    read = sharded_tensor_chunks.sharded_tensor_parts
    reads: list[int] = []

    def counted(fqn: str, value: Any) -> Any:
        reads[-1] += 1
        return read(fqn, value)

    model = wrap_model("shardkit", RUN)
    layout = LayoutCache()
    sharded_tensor_chunks.sharded_tensor_parts = counted
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for save in range(3):
                state = {"model": state_dict_of("shardkit", model, "SHARDED_STATE_DICT")}
                reads.append(0)
                save_dcp(state, f"{root}/{save}", layout=layout)
    finally:
        sharded_tensor_chunks.sharded_tensor_parts = read
    kinds = {type(v).__name__ for v in state["model"].values()}
    return {
        "reads": reads,
        "tensors": len(state["model"]),
        "kinds": kinds,
        "dcp": layout.dcp_reason,
    }


def test_shards_are_read_at_the_first_save_of_a_layout_only(tmp_path: Path) -> None:
    results = run_on_ranks(2, _save_three_times, root=str(tmp_path))
    for result in results:
        assert result["kinds"] == {"ShardedTensor"} and not result["dcp"], result
        assert result["reads"] == [result["tensors"], 0, 0], result
    saved = []
    for save in range(3):
        dcp_to_torch_save(tmp_path / str(save), tmp_path / f"{save}.pt")
        saved.append(torch.load(tmp_path / f"{save}.pt", weights_only=True)["model"])
    for later in saved[1:]:
        assert later.keys() == saved[0].keys()
        assert all(torch.equal(later[k], saved[0][k]) for k in later)
