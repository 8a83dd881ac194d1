"""DCP save and load of model + AdamW state at W=2: shardkit vs torch's fully_shard, one run.

Each round saves (or loads) the sharded state dict of the 8M GPT through
torch.distributed.checkpoint on a persistent 2-rank pool; the ratio to torch's is recorded.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from tests.harness.pool import run_on_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from benchmarks import gpt

_STATE: dict[str, Any] = {}
_RESULTS: dict[str, float] = {}


def _setup(rank: int, world_size: int, impl: str) -> None:
    _STATE.clear()
    model, opt = gpt.build(impl, "small", world_size)
    gpt.train_step(model, opt, gpt.batch("small", 0, rank, world_size))  # optimizer state
    _STATE.update(model=model, opt=opt)


def _save(rank: int, world_size: int, path: str) -> float:
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    started = time.perf_counter()
    model_sd, optim_sd = get_state_dict(_STATE["model"], _STATE["opt"])
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return time.perf_counter() - started


def _load(rank: int, world_size: int, path: str) -> float:
    dist.barrier()
    started = time.perf_counter()
    model_sd, optim_sd = get_state_dict(_STATE["model"], _STATE["opt"])
    dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(
        _STATE["model"], _STATE["opt"], model_state_dict=model_sd, optim_state_dict=optim_sd
    )
    return time.perf_counter() - started


@pytest.mark.parametrize("op", ["save", "load"])
@pytest.mark.parametrize("impl", ["torch", "shardkit"])
def test_dcp(benchmark: Any, impl: str, op: str, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, _setup, impl=impl)
    if op == "load":
        run_on_ranks(2, _save, path=path)
    times: list[float] = []

    def once() -> None:
        times.append(max(run_on_ranks(2, _save if op == "save" else _load, path=path)))

    benchmark.pedantic(once, rounds=5, iterations=1, warmup_rounds=1)
    _RESULTS[f"{impl}-{op}"] = statistics.median(times)
    benchmark.extra_info["median_s"] = _RESULTS[f"{impl}-{op}"]
    if impl != "torch" and f"torch-{op}" in _RESULTS:
        benchmark.extra_info["ratio_vs_peer"] = _RESULTS[f"{impl}-{op}"] / _RESULTS[f"torch-{op}"]
