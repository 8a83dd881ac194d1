"""An FSDP1 checkpoint saved at W=2 loads into the core's ``fully_shard`` at W=4 (and 1).

``shardkit.legacy``'s SHARDED_STATE_DICT (ShardedTensors, one dim-0 shard per rank) is saved
at W=2 with ``shardkit.core.save_dcp``; at W=4, a ``fully_shard`` model of other initial
weights reads it with torch's own ``dcp.load`` and ``set_model_state_dict``. The saved model
is untrained, so the oracle is the seed-0 model itself: every full tensor must equal it. Saved
by ``CheckpointManager``, it loads through the manager planned from its layout record, bit for
bit torch's load, with the collectives before its first read counted.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from harness.pool import run_on_ranks
from tests.core import models
from tests.legacy.ckpt_support import state_dict_of
from tests.legacy.legacy_parity import LegacyRun, wrap_model

RUN = LegacyRun(model="mlp")  # a 3-row head: uneven at W=2, an empty shard at W=4


def _save_fsdp1(rank: int, world_size: int, root: str, manager: bool = False) -> list[str]:
    """Saved by ``save_dcp`` into ``root``, or by a ``CheckpointManager`` at ``root`` (step 1)."""
    from shardkit.core import CheckpointManager, LayoutCache, save_dcp

    model = wrap_model("shardkit", RUN)  # seed 0's weights
    state = {"model": state_dict_of("shardkit", model, "SHARDED_STATE_DICT")}
    layout = LayoutCache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if manager:
            CheckpointManager(root).save(1, state)
        else:
            save_dcp(state, root, layout=layout)
            assert not layout.dcp_reason, layout.dcp_reason  # planned on each rank alone
    return sorted({type(v).__name__ for v in state["model"].values()})


def _sharded_model(world_size: int) -> nn.Module:
    """The saved model's architecture, sharded by shardkit per block and at the root."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardkit.core import fully_shard

    model: nn.Module = models.build(RUN.model, seed=5)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.modules():
        if isinstance(block, models.Block):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _load_fully_shard(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.tensor import DTensor

    model = _sharded_model(world_size)
    loaded = {"model": get_model_state_dict(model)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(loaded, checkpoint_id=root)
    set_model_state_dict(model, loaded["model"])
    full: dict[str, torch.Tensor] = {}
    for name, value in get_model_state_dict(model).items():
        assert isinstance(value, DTensor), name
        full[name] = value.full_tensor()
    return full


def test_an_fsdp1_checkpoint_saved_locally_loads_into_fully_shard_at_another_world(
    tmp_path: Path,
) -> None:
    kinds = run_on_ranks(2, _save_fsdp1, root=str(tmp_path / "ckpt"))
    assert all(k == ["ShardedTensor"] for k in kinds), kinds
    loaded = run_on_ranks(4, _load_fully_shard, root=str(tmp_path / "ckpt"))
    expected = models.build(RUN.model).state_dict()
    other = models.build(RUN.model, seed=5).state_dict()
    # The loading model starts from other weights (LayerNorm's ones aside): a load that did
    # nothing would leave these, and fail below.
    assert any(not torch.equal(other[name], t) for name, t in expected.items())
    for full in loaded:
        assert full.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(full[name], tensor), name


Counts = tuple[list[tuple[str, int]], int, int]
"""What a load did before its first read: its collectives, plan exchanges, .metadata opens."""


def _load_by_record(
    rank: int, world_size: int, root: str
) -> tuple[dict[str, torch.Tensor], Counts]:
    """The same load, by ``CheckpointManager.load``: planned from the layout record."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import DTensor

    from shardkit.core import CheckpointManager
    from tests.core.checkpoint.load_counts import LoadCounter

    model = _sharded_model(world_size)
    loaded = {"model": get_model_state_dict(model)}
    with LoadCounter() as counted:
        CheckpointManager(root).load(loaded)
    set_model_state_dict(model, loaded["model"])
    full: dict[str, torch.Tensor] = {}
    for name, value in get_model_state_dict(model).items():
        assert isinstance(value, DTensor), name
        full[name] = value.full_tensor()
    return full, (counted.before_reads, counted.exchanges, counted.metadata_opens)


def _load_sharded_by_record(rank: int, world_size: int, root: str) -> tuple[bool, Counts]:
    """Into FSDP1's ShardedTensors again (zeroed first), by ``CheckpointManager.load``."""
    from shardkit.core import CheckpointManager
    from tests.core.checkpoint.load_counts import LoadCounter

    model = wrap_model("shardkit", RUN)  # seed 0's weights: the saved ones
    state = {"model": state_dict_of("shardkit", model, "SHARDED_STATE_DICT")}
    saved = {k: [s.tensor.clone() for s in v.local_shards()] for k, v in state["model"].items()}
    for value in state["model"].values():
        for shard in value.local_shards():
            shard.tensor.zero_()
    with LoadCounter() as counted:
        CheckpointManager(root).load(state)
    same = all(
        torch.equal(shard.tensor, before)
        for key, value in state["model"].items()
        for shard, before in zip(value.local_shards(), saved[key], strict=True)
    )
    return same, (counted.before_reads, counted.exchanges, counted.metadata_opens)


def test_an_fsdp1_checkpoint_loads_planned_from_its_layout_record(tmp_path: Path) -> None:
    """Saved and loaded by ``CheckpointManager``: into ``fully_shard`` at W=4 (bit for bit
    torch's load) and W=1, and into FSDP1's ShardedTensors at W=2; from the manager's call to
    its first read, one all-reduce of 24 bytes (none alone), no plan, no ``.metadata``."""
    root = str(tmp_path / "ckpt")
    run_on_ranks(2, _save_fsdp1, root=root, manager=True)
    path = str(tmp_path / "ckpt" / "step_00000001")
    assert (Path(path) / "layout.json").is_file()
    by_record = run_on_ranks(4, _load_by_record, root=root)
    by_torch = run_on_ranks(4, _load_fully_shard, root=path)
    agreement = ([("all_reduce", 24)], 0, 0)
    for (ours, counts), theirs in zip(by_record, by_torch, strict=True):
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
        assert counts == agreement, counts
    ((alone, counts),) = run_on_ranks(1, _load_by_record, root=root)
    assert counts == ([], 0, 0), counts
    assert all(torch.equal(alone[name], by_torch[0][name]) for name in by_torch[0])
    for same, counts in run_on_ranks(2, _load_sharded_by_record, root=root):
        assert same and counts == agreement, counts
