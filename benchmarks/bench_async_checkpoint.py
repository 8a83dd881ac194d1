"""Asynchronous checkpoints at W=2, 35M GPT + AdamW: the training stall, and steps meanwhile.

Each round, for shardkit (``CheckpointManager.save(..., async_save=True)``) writing in a
thread of the training process (``writer="thread"``, "shardkit") and in a writer process per
rank (``writer="process"``, "process"), and for torch
(``torch.distributed.checkpoint.async_save`` on torch's ``fully_shard`` model, on a gloo
group of its own as torch requires for a background thread), in turn (the order rotates):

1. two training steps with no write in flight (the baseline step);
2. a synchronous save of the same state (shardkit: the manager's atomic save; torch:
   ``dcp.save``);
3. an asynchronous save, then training steps until every rank's write has finished and the
   save is published (shardkit: ``poll()`` after each step, as the demo does; torch: the same
   agreement on the default group, then ``future.result()``).

The stall is the time the training thread spends in the save call plus in publishing; a
step "during" is a step taken while the write was in flight (with the per-step poll). Ratios
are medians of per-round ratios.
"""

from __future__ import annotations

import shutil
import statistics
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from benchmarks import gpt
from harness.pool import run_on_ranks

IMPLS = ("torch", "shardkit", "process")
_MODEL_OF = {"torch": "torch", "shardkit": "shardkit", "process": "shardkit"}
_WRITER_OF: dict[str, Literal["thread", "process"]] = {"shardkit": "thread", "process": "process"}
SIZE = "medium"  # 33.7M parameters
_STATE: dict[str, Any] = {}


def _setup(rank: int, world_size: int, root: str) -> None:
    from shardkit.core import CheckpointManager

    _STATE.clear()
    for impl in IMPLS:
        model, opt = gpt.build(_MODEL_OF[impl], SIZE, world_size)
        gpt.train_step(model, opt, gpt.batch(SIZE, 0, rank, world_size))  # optimizer state
        _STATE[impl] = (model, opt)
    for impl, writer in _WRITER_OF.items():
        # Its own model and root: each writer's steps and saves are measured on their own.
        _STATE[f"manager-{impl}"] = CheckpointManager(f"{root}/{impl}", keep=1, writer=writer)
    _STATE["torch_group"] = dist.new_group(backend="gloo")
    _STATE["step"] = 1


def _step(impl: str, rank: int, world_size: int) -> float:
    model, opt = _STATE[impl]
    _STATE["step"] += 1
    return gpt.train_step(model, opt, gpt.batch(SIZE, _STATE["step"], rank, world_size))["seconds"]


def _everyone_done(future: Future[Any]) -> bool:
    flag = torch.tensor([0 if future.done() else 1])
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def _shardkit_round(impl: str, rank: int, world_size: int, step: int) -> dict[str, Any]:
    manager = _STATE[f"manager-{impl}"]
    dist.barrier()
    started = time.perf_counter()
    manager.save(step, _state_dict(impl))
    sync_s = time.perf_counter() - started
    dist.barrier()
    started = time.perf_counter()
    manager.save(step + 1, _state_dict(impl), async_save=True)
    stall = time.perf_counter() - started
    during = []
    while manager.pending is not None:
        seconds = _step(impl, rank, world_size)
        started = time.perf_counter()
        published = manager.poll()
        if published is None:
            during.append(seconds + time.perf_counter() - started)
        else:
            during.append(seconds)
            stall += time.perf_counter() - started
    return {"sync": sync_s, "stall": stall, "during": during}


def _torch_round(rank: int, world_size: int, path: str) -> dict[str, Any]:
    dist.barrier()
    started = time.perf_counter()
    dcp_save(_state_dict("torch"), checkpoint_id=f"{path}/sync")
    sync_s = time.perf_counter() - started
    dist.barrier()
    started = time.perf_counter()
    future = async_save(
        _state_dict("torch"),
        checkpoint_id=f"{path}/async",
        process_group=_STATE["torch_group"],
    )
    assert isinstance(future, Future)
    stall = time.perf_counter() - started
    during = []
    done = False
    while not done:
        seconds = _step("torch", rank, world_size)
        started = time.perf_counter()
        done = _everyone_done(future)
        if done:
            future.result()
            during.append(seconds)
            stall += time.perf_counter() - started
        else:
            during.append(seconds + time.perf_counter() - started)
    return {"sync": sync_s, "stall": stall, "during": during}


def _state_dict(impl: str) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(*_STATE[impl])
    return {"model": model_sd, "optim": optim_sd}


def _measure(rank: int, world_size: int, impl: str, root: str, round_: int) -> dict[str, Any]:
    baseline = [_step(impl, rank, world_size) for _ in range(2)]
    if impl in _WRITER_OF:
        result = _shardkit_round(impl, rank, world_size, 2 * round_ + 10)
    else:
        path = f"{root}/torch/{round_}"
        result = _torch_round(rank, world_size, path)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    return {**result, "baseline": statistics.median(baseline)}


def _teardown(rank: int, world_size: int) -> None:
    for impl in _WRITER_OF:
        _STATE[f"manager-{impl}"].close()
    dist.destroy_process_group(_STATE["torch_group"])
    _STATE.clear()


def _slowest(results: list[dict[str, Any]]) -> dict[str, float]:
    """The job's figures: the slower rank's stall and save, the median step of each rank."""
    return {
        "sync": max(r["sync"] for r in results),
        "stall": max(r["stall"] for r in results),
        "during": max(statistics.median(r["during"]) for r in results),
        "baseline": max(r["baseline"] for r in results),
        "steps_during": min(len(r["during"]) for r in results),
    }


def test_async_checkpoint(benchmark: Any, tmp_path: Path) -> None:
    root = str(tmp_path)
    run_on_ranks(2, _setup, root=root)
    rounds: dict[str, list[dict[str, float]]] = {i: [] for i in IMPLS}
    order = list(IMPLS)

    def one_round() -> None:
        order.append(order.pop(0))  # rotate which implementation goes first
        index = len(rounds["torch"])
        for name in order:
            measured = run_on_ranks(2, _measure, impl=name, root=root, round_=index)
            rounds[name].append(_slowest(measured))

    benchmark.pedantic(one_round, rounds=4, iterations=1, warmup_rounds=1)
    run_on_ranks(2, _teardown)
    rounds = {name: measured[1:] for name, measured in rounds.items()}  # not the warm-up

    def median(name: str, of: Any) -> float:
        return float(statistics.median(of(r) for r in rounds[name]))

    stall = {n: median(n, lambda r: r["stall"] / r["sync"]) for n in IMPLS}
    slowdown = {n: median(n, lambda r: r["during"] / r["baseline"]) for n in IMPLS}
    paired = [
        s["stall"] / t["stall"] for s, t in zip(rounds["shardkit"], rounds["torch"], strict=True)
    ]
    process_over_thread = [
        p["stall"] / t["stall"] for p, t in zip(rounds["process"], rounds["shardkit"], strict=True)
    ]
    benchmark.extra_info.update(
        subject="shardkit",
        method="paired",
        stall_over_sync_save=stall["shardkit"],
        peer_stall_over_sync_save=stall["torch"],
        step_during_write_over_step=slowdown["shardkit"],
        peer_step_during_write_over_step=slowdown["torch"],
        ratio_vs_peer=statistics.median(paired),  # shardkit's stall over torch's
        stall_s=median("shardkit", lambda r: r["stall"]),
        peer_stall_s=median("torch", lambda r: r["stall"]),
        sync_save_s=median("shardkit", lambda r: r["sync"]),
        peer_sync_save_s=median("torch", lambda r: r["sync"]),
        step_s=median("shardkit", lambda r: r["baseline"]),
        steps_during_write=median("shardkit", lambda r: r["steps_during"]),
        peer_steps_during_write=median("torch", lambda r: r["steps_during"]),
        process_stall_over_sync_save=stall["process"],
        process_step_during_write_over_step=slowdown["process"],
        process_stall_over_thread_stall=statistics.median(process_over_thread),
        process_stall_s=median("process", lambda r: r["stall"]),
        process_steps_during_write=median("process", lambda r: r["steps_during"]),
    )
    print(f"\nasync checkpoint, {SIZE} GPT W=2 (per round):")
    for name in IMPLS:
        for r in rounds[name]:
            print(f"  {name:8s} " + " ".join(f"{k}={v:.3f}" for k, v in r.items()))
    print("  " + " ".join(f"{k}={v}" for k, v in benchmark.extra_info.items()))
