"""torch's ``CommDebugMode`` counts shardkit's collectives on gloo as it counts torch's.

On gloo shardkit all-gathers and reduce-scatters by point-to-point exchanges, which the mode
does not count: it saw none where torch's ``fully_shard`` shows one per group and pass (found
by torch's ``test_gradient_accumulation``, which counts them). While a mode is active each
exchange is also issued on meta tensors, which the mode counts and which send nothing. Each
case runs the same program on both engines at W=2 (HSDP: W=4) and compares the counts, in
total and per pass, and the losses and parameters bit for bit.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import shardkit.core as shardkit_core
from harness.pool import run_on_ranks
from shardkit.core import ReducePrecision

_DIM, _MLPS, _MICROBATCHES = 16, 3, 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    mlps = [nn.Sequential(nn.Linear(_DIM, _DIM), nn.ReLU()) for _ in range(_MLPS)]
    return nn.Sequential(nn.Linear(_DIM, _DIM), *mlps)


def _counted(mode: CommDebugMode) -> dict[str, int]:
    """Every collective the mode counted, forward and backward apart (its "Global" module)."""
    found: dict[str, int] = {}
    for phase, counts in mode.comm_module_counts.get("Global", {}).items():
        found |= {f"{phase} {op}": n for op, n in counts.items() if n}
    return found


def _flags(model: Any, case: dict[str, Any], last: bool) -> None:
    """Gradient accumulation as torch's test drives it: which groups sync, and reshard."""
    chosen = {
        "all": [(model, True)],
        "root_only": [(model, False)],
        "some_mlps": [(mlp, True) for mlp in list(model)[1:3]],
    }[case["sync"]]
    for module, recurse in chosen:
        if case.get("reduce_scatter_only"):
            module.set_requires_all_reduce(last, recurse=recurse)
        else:
            module.set_requires_gradient_sync(last, recurse=recurse)
        if not case["reshard_after_backward"]:
            module.set_reshard_after_backward(last, recurse=recurse)


def _train(engine: str, case: dict[str, Any], rank: int) -> dict[str, Any]:
    fully_shard = torch_fsdp.fully_shard if engine == "torch" else shardkit_core.fully_shard
    world = dist.get_world_size()
    shape = case.get("mesh", (world,))
    names = ("replicate", "shard") if len(shape) == 2 else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model: Any = _model()  # the Sequential, then its sharded self
    kwargs = {"mesh": mesh, "reshard_after_forward": case["reshard_after_forward"]}
    for mlp in list(model)[1:]:
        fully_shard(mlp, **kwargs)
    fully_shard(model, **kwargs)
    if case.get("reduce_precision"):
        model.set_reduce_precision(ReducePrecision(wire_dtype=torch.bfloat16))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(rank + 1)
    counted: dict[str, int] = defaultdict(int)
    losses = []
    for step in range(2):
        for micro in range(_MICROBATCHES):
            last = micro == _MICROBATCHES - 1
            _flags(model, case, last)
            counting = case.get("counting_ranks", "all") == "all" or rank == 0
            mode = CommDebugMode()
            if counting:
                mode.__enter__()
            try:
                loss = model(torch.randn(4, _DIM)).sum()
                loss.backward()
            finally:
                if counting:
                    mode.__exit__(None, None, None)
            for key, n in _counted(mode).items():
                counted[key] += n
            losses.append(loss.detach())
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
    params = {
        name: p.full_tensor() if isinstance(p, DTensor) else p
        for name, p in model.named_parameters()
    }
    return {"counted": dict(counted), "losses": losses, "params": params}


def _both_engines(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[Any]:
    return [[_train(engine, case, rank) for engine in ("torch", "shardkit")] for case in cases]


def _assert_same(case: dict[str, Any], torch_run: dict[str, Any], ours: dict[str, Any]) -> None:
    assert ours["counted"] == torch_run["counted"], case
    pairs = zip(ours["losses"], torch_run["losses"], strict=True)
    assert all(torch.equal(a, b) for a, b in pairs), case
    for name, value in torch_run["params"].items():
        assert torch.equal(ours["params"][name], value), (case, name)


_ACCUMULATION = [
    {"sync": sync, "reshard_after_forward": forward, "reshard_after_backward": backward}
    for sync in ("all", "root_only", "some_mlps")
    for forward in (True, False)
    for backward in (True, False)
]


def test_gradient_accumulation_counts_as_torch_does() -> None:
    """torch's test_gradient_accumulation's cases at W=2: every sync choice and reshard flag."""
    (per_rank, _) = run_on_ranks(2, _both_engines, cases=_ACCUMULATION)
    for case, (torch_run, ours) in zip(_ACCUMULATION, per_rank, strict=True):
        assert torch_run["counted"], case  # the mode counted torch's collectives at all
        _assert_same(case, torch_run, ours)


_W4 = [
    {"mesh": (2, 2), "sync": "all", "reshard_after_forward": True, "reshard_after_backward": True,
     "reduce_scatter_only": only}
    for only in (False, True)
] + [
    # Resharded after forward to groups of 2 of the 4 ranks: the backward's all-gathers run
    # on those smaller groups (torch's test_fully_shard_communication_count counts them).
    {"sync": "all", "reshard_after_forward": 2, "reshard_after_backward": backward}
    for backward in (True, False)
]  # fmt: skip


def test_hsdp_and_smaller_reshard_groups_count_as_torch_does() -> None:
    """W=4: HSDP (2 x 2), with and without the all-reduce; resharding to 2 ranks after forward."""
    results = run_on_ranks(4, _both_engines, cases=_W4)
    for per_rank in results:
        for case, (torch_run, ours) in zip(_W4, per_rank, strict=True):
            hsdp = "mesh" in case
            assert hsdp == any("allreduce_" in key for key in torch_run["counted"]), case
            _assert_same(case, torch_run, ours)


def test_a_mode_on_one_rank_only_counts_there_and_changes_nothing() -> None:
    """No collective is switched, so the rank counting nothing is not left waiting.

    Without resharding after forward: backward gathers nothing, so the module hooks the mode
    adds on rank 0 alone (which change the order backward reaches the groups there) cannot
    put the ranks' collectives out of step (see the next test).
    """
    case = {"sync": "all", "reshard_after_forward": False, "reshard_after_backward": True}
    one = dict(case, counting_ranks="rank0")
    (rank0, rank1) = run_on_ranks(2, _both_engines, cases=[case, one])
    assert rank0[1][1]["counted"] == rank0[0][0]["counted"]  # as where every rank counts
    assert rank1[1][0]["counted"] == rank1[1][1]["counted"] == {}
    for per_rank in (rank0, rank1):
        _assert_same(one, per_rank[1][0], per_rank[1][1])


def _mode_on_rank0_regathering(rank: int, world_size: int) -> str:
    case = {"sync": "all", "reshard_after_forward": True, "reshard_after_backward": True}
    try:
        _train("shardkit", dict(case, counting_ranks="rank0"), rank)
    except shardkit_core.DesyncError as error:
        return str(error)
    return "trained"


def test_a_mode_on_one_rank_that_reorders_backward_gathers_is_named() -> None:
    """The mode's module hooks on rank 0 alone make it gather the root before block 3 in
    backward, where rank 1 gathers block 3 first: two all-gathers of the same size that pair
    with each other's module. torch's engine and shardkit's (before its step check) trained on
    with the other module's parameters; the step check raises on both ranks."""
    for message in run_on_ranks(2, _mode_on_rank0_regathering):
        assert "rank 0: all-gather of <root> in backward" in message, message
        assert "rank 1: all-gather of 3 in backward" in message, message


def _compressed(rank: int, world_size: int) -> dict[str, int]:
    case = {"sync": "all", "reshard_after_forward": True, "reshard_after_backward": True}
    counted: dict[str, int] = _train("shardkit", dict(case, reduce_precision=True), rank)["counted"]
    return counted


def test_a_compressed_reduction_counts_as_the_all_to_all_it_is_elsewhere() -> None:
    """shardkit's own precision-aware reduction: one all-to-all per group and synced backward."""
    (counted, _) = run_on_ranks(2, _compressed)
    synced_backwards = 2  # the last microbatch of each of the two steps
    assert counted.get("backward c10d.alltoall_base_") == (_MLPS + 1) * synced_backwards, counted
    assert not any("reduce_scatter" in key for key in counted), counted
