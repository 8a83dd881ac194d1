"""FSDP1's SHARDED_STATE_DICT saved by ``shardkit.core.save_dcp``: planned on each rank alone.

FSDP1 users save ``model.state_dict()`` under SHARDED_STATE_DICT with ``dcp.save``, which
exchanges plans through rank 0 at every save. ``save_dcp`` writes the same checkpoint with no
collective before the files are written. For torch's FSDP1 and ``shardkit.legacy``'s, in both
forms FSDP1 gives (ShardedTensors; DTensors with ``_use_dtensor``), the same state is saved
both ways and compared in this process: the ``.metadata`` in content, every tensor through
DCP's own ``dcp_to_torch_save``. torch's FSDP1 then loads shardkit's checkpoint with
``dcp.load`` into a model of other weights and must give back the saved shards.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from harness.pool import run_on_ranks
from tests.core.checkpoint.dcp_checks import (
    CollectivesBeforeWrite,
    assert_same,
    metadata_content,
    read_metadata,
)
from tests.legacy.ckpt_support import fresh, load_into, state_dict_of
from tests.legacy.legacy_parity import LegacyRun, wrap_model

RUN = LegacyRun(model="mlp")  # a 3-row head: uneven shards at W=2 and W=4


def _config(impl: str, dtensor: bool) -> Any:
    if not dtensor:
        return None
    if impl == "shardkit":
        from shardkit.legacy import ShardedStateDictConfig

        return ShardedStateDictConfig(_use_dtensor=True)
    from torch.distributed.fsdp import ShardedStateDictConfig as TorchsConfig

    return TorchsConfig(_use_dtensor=True)


def _local(value: Any) -> torch.Tensor:
    if hasattr(value, "local_shards"):
        shards = value.local_shards()
        return shards[0].tensor if shards else torch.empty(0)
    local: torch.Tensor = value.to_local() if hasattr(value, "to_local") else value
    return local


def _save_both(rank: int, world_size: int, root: str, impl: str, dtensor: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from shardkit.core import LayoutCache, save_dcp

    model = wrap_model(impl, RUN)
    state = {"model": state_dict_of(impl, model, "SHARDED_STATE_DICT", _config(impl, dtensor))}
    kinds = sorted({type(v).__name__ for v in state["model"].values()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with CollectivesBeforeWrite() as torchs:
            dcp_save(state, checkpoint_id=f"{root}/torch")
        layout = LayoutCache()
        with CollectivesBeforeWrite() as ours:
            save_dcp(state, f"{root}/local", layout=layout)
        save_dcp(state, f"{root}/again", layout=layout)
        # torch's FSDP1 reads shardkit's checkpoint back, into other weights.
        other = fresh("torch", RUN)
        loaded = {"model": state_dict_of("torch", other, "SHARDED_STATE_DICT")}
        dcp_load(loaded, checkpoint_id=f"{root}/local")
        load_into("torch", other, "SHARDED_STATE_DICT", loaded["model"])
        back = state_dict_of("torch", other, "SHARDED_STATE_DICT")
    same = all(torch.equal(_local(back[k]), _local(v)) for k, v in state["model"].items())
    return {
        "kinds": kinds,
        "before_write": (ours.before_write, torchs.before_write),
        "fallback": layout.dcp_reason,
        "torch_loads_it": same,
    }


@pytest.mark.parametrize(
    ("world", "impl", "dtensor"),
    [(2, "shardkit", False), (2, "torch", False), (2, "shardkit", True), (4, "torch", False)],
)
def test_fsdp1_sharded_state_dicts_save_as_dcp_does_without_a_plan_exchange(
    world: int, impl: str, dtensor: bool, tmp_path: Path
) -> None:
    results = run_on_ranks(world, _save_both, root=str(tmp_path), impl=impl, dtensor=dtensor)
    expected = "DTensor" if dtensor else "ShardedTensor"
    assert all(expected in r["kinds"] for r in results), results
    assert not any(r["fallback"] for r in results), results
    assert all(r["before_write"][0] == 0 < r["before_write"][1] for r in results), results
    assert all(r["torch_loads_it"] for r in results), results
    theirs = metadata_content(read_metadata(tmp_path / "torch"))
    assert metadata_content(read_metadata(tmp_path / "local")) == theirs
    assert metadata_content(read_metadata(tmp_path / "again")) == theirs
    for name in ("torch", "local"):
        dcp_to_torch_save(tmp_path / name, tmp_path / f"{name}.pt")
    assert_same(
        torch.load(tmp_path / "local.pt", weights_only=True),
        torch.load(tmp_path / "torch.pt", weights_only=True),
        "",
    )
