"""CommTracker on functional collectives (DTensor redistribution), named by their mesh axis.

At W=4 on a (dp 2, tp 2) mesh: each redistribution is one functional collective with its kind,
exact bytes, group and axis; c10d collectives on a group of no mesh have no axis; results are
unchanged by tracking; a redistribution DTensor decides on inside an operator is seen too;
after tracking nothing stays installed and nothing more is recorded.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from harness.pool import run_on_ranks
from shardkit.tools.records import CollectiveRecord, StepComm
from shardkit.tools.track.comm import CommTracker
from tests.tools.track.hooks import installed_hooks

_FUNCTIONAL = "_c10d_functional"


def _redistribute(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]

    def redistributions() -> list[float]:
        rows = DTensor.from_local(torch.ones(3, 4), tp, [Shard(0)])
        partial = DTensor.from_local(torch.full((6, 4), float(rank)), tp, [Partial()])
        gathered = rows.redistribute(placements=[Replicate()]).to_local()  # all-gather
        summed = partial.redistribute(placements=[Replicate()]).to_local()  # all-reduce
        scattered = partial.redistribute(placements=[Shard(0)]).to_local()  # reduce-scatter
        # One row cannot be sharded over 2 ranks: DTensor gathers it inside the matmul.
        row = torch.ones(1 - tp.get_local_rank(), 4)
        weight = DTensor.from_local(row, tp, [Shard(0)], shape=torch.Size([1, 4]), stride=(4, 1))
        x = DTensor.from_local(torch.ones(2, 4), tp, [Replicate()])
        product = F.linear(x, weight)
        assert isinstance(product, DTensor)
        projected = product.to_local()
        on_dp = DTensor.from_local(torch.ones(2), dp, [Shard(0)]).full_tensor()
        total = torch.ones(1)
        dist.all_reduce(total)  # c10d, on the default group: no mesh axis
        results = [gathered, summed, scattered, projected, on_dp, total]
        return [float(t.sum()) for t in results]  # using a result waits for it

    with CommTracker(meshes=[mesh]) as comm:
        tracked = redistributions()
    installed_after = installed_hooks()[0]
    recorded = len(comm.records)
    untracked = redistributions()
    return {
        "records": [_fields(r) for r in comm.records],
        "steps": comm.summary().steps,
        "tracked": tracked,
        "untracked": untracked,
        "installed_after": installed_after,
        "recorded_after": len(comm.records) - recorded,
    }


def _fields(record: CollectiveRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__slots__}


@functools.cache
def _results() -> list[dict[str, Any]]:
    return run_on_ranks(4, _redistribute)


def test_redistributions_are_recorded_with_their_axis() -> None:
    for rank, result in enumerate(_results()):
        rows = [
            (r["kind"], r["op"], r["axis"], r["group_size"], r["input_bytes"], r["sent_bytes"])
            for r in result["records"]
        ]
        assert rows == [
            # Shard(0) -> Replicate of a (3, 4) float32 shard: 48 bytes in, sent to 1 peer.
            ("all_gather", f"{_FUNCTIONAL}.all_gather_into_tensor", "tp", 2, 48, 48),
            # Partial -> Replicate of (6, 4): a ring all-reduce sends 2 n (W-1)/W.
            ("all_reduce", f"{_FUNCTIONAL}.all_reduce", "tp", 2, 96, 96),
            # Partial -> Shard(0): the whole (6, 4) in, half of it sent.
            ("reduce_scatter", f"{_FUNCTIONAL}.reduce_scatter_tensor", "tp", 2, 96, 48),
            # Inside F.linear: the (1, 4) weight's row, padded on the rank that has none.
            ("all_gather", f"{_FUNCTIONAL}.all_gather_into_tensor", "tp", 2, 16, 16),
            ("all_gather", f"{_FUNCTIONAL}.all_gather_into_tensor", "dp", 2, 8, 8),
            ("all_reduce", "c10d.allreduce_", None, 4, 4, 6),
        ], f"rank {rank}"
        for r in result["records"]:
            assert r["start_s"] <= r["end_s"] and r["wait_s"] >= 0
        # Functional collectives end when their result is waited for, and that wait is seen.
        assert all(r["wait_s"] > 0 for r in result["records"][:5])
        (step,) = result["steps"]
        assert isinstance(step, StepComm)
        by_axis = {(a.axis, a.collectives, a.sent_bytes) for a in step.by_axis}
        assert by_axis == {("dp", 1, 8), ("tp", 4, 208), (None, 1, 6)}
        assert [a.axis for a in step.by_axis] == ["dp", "tp", None]
        assert sum(a.exposed_s for a in step.by_axis) == step.exposed_s


def test_tracking_changes_no_result_and_leaves_nothing_installed() -> None:
    for rank, result in enumerate(_results()):
        tp_ranks = 4 * (rank // 2) + 1  # the sum of the ranks in this rank's tp group
        expected = [24.0, 24.0 * tp_ranks, 12.0 * tp_ranks, 8.0, 4.0, 4.0]
        assert result["tracked"] == expected == result["untracked"], f"rank {rank}"
        assert result["installed_after"] is False
        assert result["recorded_after"] == 0
