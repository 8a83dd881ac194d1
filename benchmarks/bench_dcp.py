"""DCP save and load of model + AdamW state at W=2: shardkit vs torch's fully_shard, paired.

Both models live on the same persistent 2-rank pool. Every round saves (or loads) the sharded
state dict of the 8M GPT through torch.distributed.checkpoint once for each implementation,
alternating which goes first, so disk and page-cache noise hits both alike. pytest-benchmark
times shardkit's half; the ratio recorded is the median of the per-round ratios to torch.

Both save the same items with the same calls (profiled: the planner's write items per
DTensor, the metadata, the bytes), except for one copy. shardkit's parameter shards view their
group's flat sharded buffer (that is what lets the all-gather read them with no copy-in), and
DCP's file writer clones every tensor whose storage is larger than itself before torch.save,
which would otherwise write the whole storage. ``dcp_copies`` records, deterministically, how
many tensors and bytes that is per rank for each engine: for the 8M GPT at W=2, shardkit's
101 parameter shards (16.1 MiB per rank, a few ms of memcpy: about 1% of a save) and none of
torch's, whose shards have their own storage when the dims divide evenly.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from benchmarks import gpt
from harness.pool import run_on_ranks

IMPLS = ("torch", "shardkit")
_STATE: dict[str, Any] = {}


def _setup(rank: int, world_size: int) -> None:
    _STATE.clear()
    for impl in IMPLS:
        model, opt = gpt.build(impl, "small", world_size)
        gpt.train_step(model, opt, gpt.batch("small", 0, rank, world_size))  # optimizer state
        _STATE[impl] = (model, opt)


def _save(rank: int, world_size: int, impl: str, path: str) -> float:
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    started = time.perf_counter()
    model_sd, optim_sd = get_state_dict(*_STATE[impl])
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return time.perf_counter() - started


def _load(rank: int, world_size: int, impl: str, path: str) -> float:
    dist.barrier()
    started = time.perf_counter()
    model, opt = _STATE[impl]
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return time.perf_counter() - started


def _dcp_copies(rank: int, world_size: int, impl: str) -> tuple[int, int]:
    """Tensors (and their bytes) that DCP's writer must clone: storage larger than the tensor."""
    model, opt = _STATE[impl]  # the state dicts hold these very tensors
    tensors = [*model.parameters()]
    tensors += [v for state in opt.state.values() for v in state.values()]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    copied = [t for t in local if t.untyped_storage().nbytes() != t.nbytes]
    return len(copied), sum(t.nbytes for t in copied)


def _teardown(rank: int, world_size: int) -> None:
    _STATE.clear()


@pytest.mark.parametrize("op", ["save", "load"])
def test_dcp(benchmark: Any, op: str, tmp_path: Path) -> None:
    paths = {impl: str(tmp_path / impl) for impl in IMPLS}
    run_on_ranks(2, _setup)
    task = _save if op == "save" else _load
    if op == "load":
        for impl in IMPLS:
            run_on_ranks(2, _save, impl=impl, path=paths[impl])
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    order = list(IMPLS)

    def timed(impl: str) -> None:
        times[impl].append(max(run_on_ranks(2, task, impl=impl, path=paths[impl])))

    def one_round() -> None:
        order.reverse()  # alternate which implementation goes first
        if order[0] == "torch":
            timed("torch")
            timed("shardkit")
        else:
            timed("shardkit")
            timed("torch")

    benchmark.pedantic(one_round, rounds=11, iterations=1, warmup_rounds=1)
    copies = {impl: run_on_ranks(2, _dcp_copies, impl=impl)[0] for impl in IMPLS}
    run_on_ranks(2, _teardown)
    ratios = [s / t for s, t in zip(times["shardkit"], times["torch"], strict=True)]
    benchmark.extra_info.update(
        subject="shardkit",
        method="paired",
        median_s=statistics.median(times["shardkit"]),
        peer_median_s=statistics.median(times["torch"]),
        ratio_vs_peer=statistics.median(ratios),
        dcp_copies={impl: {"tensors": n, "bytes": b} for impl, (n, b) in copies.items()},
    )
