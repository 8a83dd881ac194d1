"""The work of a step does not grow with the world size: operators counted on the fake group.

One process stands for rank 0 of W ranks (torch's fake process group) and counts the
operators a training step dispatches (see ``benchmarks/op_count_workload.py``). On a GPU each
one that launches a kernel costs a few microseconds of CPU time, so a count that grows with W
is a step that becomes launch-bound at scale: shardkit's once grew from 1,371 at W=8 to 4,227
at W=64 (one copy per gathered row). Counts, never times: exact on any machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from benchmarks.op_count_workload import CASES, count_step


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("case", CASES)
def test_a_step_dispatches_as_much_at_w64_as_at_w8(case: str, uneven: bool) -> None:
    small = count_step("shardkit", case, 8, uneven=uneven)
    large = count_step("shardkit", case, 64, uneven=uneven)
    assert large.launches == small.launches, _diff(small.by_op, large.by_op)
    # Views too: making W views a step is host time as well.
    assert _but_allocations(large.by_op) == _but_allocations(small.by_op), _diff(
        small.by_op, large.by_op
    )


def _but_allocations(by_op: dict[str, int]) -> int:
    # How many allocations a step makes depends on which buffer sizes coincide between groups
    # (the pool reuses those), which the world size changes; they launch no kernel.
    return sum(n for name, n in by_op.items() if name != "aten.empty")


@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
@pytest.mark.parametrize("case", CASES)
def test_a_step_launches_no_more_than_torchs_on_an_accelerator(case: str, uneven: bool) -> None:
    # As on a GPU: one _chunk_cat per group packs the gradients (torch's way).
    ours = count_step("shardkit", case, 64, uneven=uneven, fused_packing=True)
    torch_ops = count_step("torch", case, 64, uneven=uneven)
    assert ours.launches <= torch_ops.launches, _diff(torch_ops.by_op, ours.by_op)
    assert ours.total <= torch_ops.total, _diff(torch_ops.by_op, ours.by_op)


@pytest.mark.parametrize("case", CASES)
def test_gradients_are_divided_inside_the_collectives_as_torchs(case: str) -> None:
    # fp32 and bf16 gradients are averaged by the reduce-scatter (and the replicas' all-reduce)
    # themselves: no division of a group's own. Every scaling op in the step is the optimizer's,
    # as in torch's step (shardkit once divided each group's reduced shard: 9 more per step).
    ours = count_step("shardkit", case, 64, fused_packing=True)
    torch_ops = count_step("torch", case, 64)

    def scaling(by_op: dict[str, int]) -> dict[str, int]:
        return {n: k for n, k in by_op.items() if "div" in n or "mul" in n}

    assert scaling(ours.by_op) == scaling(torch_ops.by_op)


@pytest.mark.parametrize("case", CASES)
def test_a_step_on_cpu_dispatches_no_more_than_torchs(case: str) -> None:
    # On CPU gradients are packed by cat or foreach copies (faster there than _chunk_cat).
    ours = count_step("shardkit", case, 8)
    torch_ops = count_step("torch", case, 8)
    assert ours.launches <= torch_ops.launches, _diff(torch_ops.by_op, ours.by_op)
    assert ours.total <= torch_ops.total, _diff(torch_ops.by_op, ours.by_op)


def _diff(before: dict[str, int], after: dict[str, int]) -> str:
    """The operators whose counts differ, for the failure message."""
    names = sorted(set(before) | set(after))
    return "; ".join(
        f"{n}: {before.get(n, 0)} -> {after.get(n, 0)}"
        for n in names
        if before.get(n, 0) != after.get(n, 0)
    )


@pytest.mark.parametrize(
    "fields",
    [{"wire_dtype": torch.bfloat16}, {"wire_dtype": torch.int8, "error_feedback": True}],
    ids=["bf16-wire", "int8-ef"],
)
@pytest.mark.parametrize("case", ["plain", "hsdp"])
def test_a_compressed_reduction_dispatches_as_much_at_w64_as_at_w8(
    case: str, fields: dict[str, Any]
) -> None:
    from shardkit.core import ReducePrecision

    policy = ReducePrecision(**fields)
    small = count_step("shardkit", case, 8, reduce_precision=policy)
    large = count_step("shardkit", case, 64, reduce_precision=policy)
    assert large.launches == small.launches, _diff(small.by_op, large.by_op)
    assert _but_allocations(large.by_op) == _but_allocations(small.by_op), _diff(
        small.by_op, large.by_op
    )
