"""Ranks as threads of one process (torch's ``FSDPTestMultiThread``) train as torch's do.

Torch's own FSDP2 tests and users' tests run ranks as threads on torch's multi-threaded
process group. The step check keeps its windows per process, so there it is skipped: with it,
each thread's check took the others' groups for its own and backward never returned (torch's
``test_custom_hook_custom_stream`` hung). Each thread here trains the same model with torch's
``fully_shard`` and with shardkit's, on the world and on a group of two of the four threads;
losses and gradients are equal bit for bit, and the test ends.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.distributed.multi_threaded_pg import (
    _install_threaded_pg,
    _uninstall_threaded_pg,
)

import shardkit.core
from shardkit.core.runtime.watch.step_check import step_checks_on

WORLD = 4
HANG_GUARD_S = 600  # far past the test's own time: only a hang gets there


def _run_as_threads(body: Callable[[int], Any]) -> list[Any]:
    """``body(rank)`` on WORLD threads, each a rank of torch's threaded process group."""
    isolation: Any = torch._C._distributed_c10d
    isolation._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store = HashStore()
    results: queue.Queue[tuple[int, Any]] = queue.Queue()

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
        try:
            results.put((rank, body(rank)))
        except BaseException as error:  # reported by the test, on the main thread
            results.put((rank, error))
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(WORLD)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG_GUARD_S)
    finally:
        _uninstall_threaded_pg()
        isolation._set_thread_isolation_mode(False)
    assert not any(t.is_alive() for t in threads), "a rank never finished: a hang"
    out = dict(results.get() for _ in range(results.qsize()))
    for value in out.values():
        if isinstance(value, BaseException):
            raise value
    return [out[r] for r in range(WORLD)]


def _train(fs: Any, model: Any, mesh: DeviceMesh, rank: int) -> list[torch.Tensor]:
    for block in (model[0], model[2]):
        fs(block, mesh=mesh)
    fs(model, mesh=mesh)
    out: list[torch.Tensor] = []
    for step in range(2):
        # The threads share torch's global generator: each draws from its own.
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 10 * rank))
        loss = model(x).sum()
        loss.backward()
        out.append(loss.detach())
        out.extend(p.grad.full_tensor() for p in model.parameters())
        model.zero_grad()
    return out


def _body(rank: int) -> bool:
    pair, _ = dist.new_subgroups(2)  # ranks {0, 1} and {2, 3}, made by every rank
    meshes = [
        init_device_mesh("cpu", (WORLD,)),
        DeviceMesh.from_group(pair, "cpu", mesh_dim_names=("shard",)),
    ]
    for mesh in meshes:
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        init = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, generator=init))
        ours = _train(shardkit.core.fully_shard, copy.deepcopy(model), mesh, rank)
        theirs = _train(torch_fully_shard, model, mesh, rank)
        assert len(ours) == len(theirs) == 10
        for mine, torchs in zip(ours, theirs, strict=True):
            assert mine.equal(torchs)
    return True


def test_training_matches_torch_with_threads_as_ranks() -> None:
    assert step_checks_on()  # on, as by default: skipped for this process group only
    assert _run_as_threads(_body) == [True] * WORLD
