"""FSDP x TP checkpoints loaded by each rank alone from the layout record (issue 85).

A 2x2 (dp, tp) checkpoint of the SP model with AdamW, saved by ``CheckpointManager`` (planned
on each rank alone, so with the layout record), is loaded into a fresh model of other weights
through ``CheckpointManager.load`` (planned from the record) and through DCP's own load, in
the same 2x2 layout, in plain FSDP over 4 ranks and over 2: the values must agree bit for
bit, and equal the saved ones. From the manager's call to its first read, the one collective
is the verdict's all-reduce of 24 bytes: no object collective, no plan exchanged, and no rank
opens ``.metadata``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks


def _save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardkit.core import CheckpointManager
    from tests.core.ckpt_helpers import model_values, optim_values
    from tests.tp.tp_ckpt import SAVE_AFTER, adamw, build, train

    model, *dp = build("shardkit", (2, 2))
    opt = adamw(model)
    train(model, opt, range(SAVE_AFTER), (dp[0], dp[1]))
    model_sd, optim_sd = get_state_dict(model, opt)
    path = CheckpointManager(root).save(SAVE_AFTER, {"model": model_sd, "optim": optim_sd})
    values = {"model": model_values(model), "optim": optim_values(model, opt)}
    return {"path": str(path), "values": values}


def _load(rank: int, world_size: int, path: str, layout: tuple[int, ...]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from shardkit.core import CheckpointManager
    from tests.core.checkpoint.load_counts import LoadCounter
    from tests.core.ckpt_helpers import dcp_load_all, model_values, optim_values
    from tests.tp.tp_ckpt import adamw, build

    model, *_ = build("shardkit", layout, seed=7)
    opt = adamw(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    with LoadCounter() as counted:
        CheckpointManager(Path(path).parent).load({"model": model_sd, "optim": optim_sd}, path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    ours = {"model": model_values(model), "optim": optim_values(model, opt)}
    other, *_ = build("shardkit", layout, seed=7)
    theirs = dcp_load_all(other, adamw(other), path)
    counts = (counted.before_reads, counted.exchanges, counted.metadata_opens)
    return {"ours": ours, "theirs": theirs, "counts": counts}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)


@pytest.mark.parametrize("layout", [(2, 2), (4,), (2,)], ids=["2x2", "fsdp4", "fsdp2"])
def test_an_fsdp_x_tp_checkpoint_loads_planned_from_its_record(
    layout: tuple[int, ...], tmp_path: Path
) -> None:
    saved = run_on_ranks(4, _save, root=str(tmp_path / "ckpt"))
    path = saved[0]["path"]
    assert (Path(path) / "layout.json").is_file()
    world = 1
    for size in layout:
        world *= size
    for result in run_on_ranks(world, _load, path=path, layout=layout):
        assert _equal(result["ours"], result["theirs"])
        assert _equal(result["ours"], saved[0]["values"])
        assert result["counts"] == ([("all_reduce", 24)], 0, 0), result["counts"]
