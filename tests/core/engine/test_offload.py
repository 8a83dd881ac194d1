"""CPUOffloadPolicy: trains like torch's, and pin_memory=True works on a CPU-only build.

On CUDA, gradients come back to pinned memory without blocking; the host must wait for them
before it reads them. ``tests/core/host_copies.py`` makes such copies land only when waited for,
so a missing wait shows on a CPU, every time (tests/core/interop/test_cuda.py runs the real thing).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy

from harness.pool import run_on_ranks
from shardkit.core import CPUOffloadPolicy, fully_shard
from shardkit.core.runtime.device import HostCopies
from tests.core import host_copies
from tests.core.fake_group import fake_mesh
from tests.core.parity import Run, assert_parity, parity_body


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cpu_offload_matches_single_process(world_size: int) -> None:
    # torch's own CPUOffloadPolicy(pin_memory=True) fails on a CPU-only build; ours does not,
    # so the oracle here is single-process training (and torch with pin_memory=False).
    run = Run(shard_kwargs={"offload_policy": CPUOffloadPolicy()}, impls=("shardkit", "local"))
    assert_parity(run_on_ranks(world_size, parity_body, run=run))


@pytest.mark.parametrize("world_size", [2])
def test_cpu_offload_unpinned_matches_torch(world_size: int) -> None:
    run = Run(
        shard_kwargs={"offload_policy": CPUOffloadPolicy(pin_memory=False)},
        impls=("shardkit", "torch"),
    )
    assert_parity(run_on_ranks(world_size, parity_body, run=run), rtol=0, atol=0)


def _late_copies_body(rank: int, world_size: int, run: Run) -> dict[str, Any]:
    traces = parity_body(rank, world_size, run)
    return {"traces": traces, "log": list(host_copies.LOG)}


@pytest.mark.parametrize(
    ("loop", "policy"),
    [("plain", "shardkit's"), ("last_backward", "shardkit's"), ("plain", "torch's")],
)
def test_offloaded_grads_land_before_the_host_reads_them(loop: str, policy: str) -> None:
    # torch's own policy class, as code that swapped only fully_shard's import passes it:
    # shardkit ignored it until 2026-11-27 (no offload at all, and no error).
    offload = (CPUOffloadPolicy if policy == "shardkit's" else TorchCPUOffloadPolicy)(True)
    run = Run(
        shard_kwargs={"offload_policy": offload},
        impls=("shardkit", "local"),
        setup="late_host_copies",
        loop=loop,
        steps=3,
    )
    results = run_on_ranks(2, _late_copies_body, run=run)
    # A gradient read before its copy landed is NaN: parity says the optimizer read none.
    assert_parity([r["traces"] for r in results])
    log = results[0]["log"]
    groups = 4  # the MLP's three blocks and its root
    if loop == "plain":
        # Every copy overlaps; the host waits once per step, at the end of backward.
        assert log == (["overlapped"] * groups + ["wait"]) * run.steps
    else:
        # Two backwards a step, the first not the last: the second's gradients are added to
        # the first's on the host, so they come back blocking (after the first's landed).
        assert "overlapped" in log and "blocking" in log
        assert log.count("overlapped") == log.count("blocking") == groups * run.steps


def test_an_offload_policy_of_neither_library_is_refused() -> None:
    with fake_mesh(2) as mesh, pytest.raises(TypeError, match="offload_policy must be an Off"):
        fully_shard(nn.Linear(2, 2), mesh=mesh, offload_policy=True)  # type: ignore[call-overload]


def test_host_copies_on_cpu_are_free() -> None:
    copies = HostCopies()
    t = torch.ones(3)
    assert copies.to_host(t, non_blocking=True) is t
    copies.record(torch.device("cpu"))
    assert not copies.pending
    copies.wait()
