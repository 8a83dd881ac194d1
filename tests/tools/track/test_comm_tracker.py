"""CommTracker on every engine at W=2 and W=4: kinds, exact bytes, phases, modules and waits."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.pool import run_on_ranks
from shardkit.tools.records import CollectiveRecord, Phase, RankReport
from shardkit.tools.track.comm import CommTracker
from tests.core import models
from tests.tools import workloads
from tests.tools.track.hooks import installed_hooks


def _tracked_steps(
    rank: int, world_size: int, engine: str, steps: int, minimum: int | None = None
) -> dict[str, Any]:
    model, opt = workloads.build(engine, world_size)
    workloads.train_step(model, opt, 0, rank, world_size)  # lazy init outside the tracker
    original_wait = dist.Work.wait
    with CommTracker(theoretical_min_bytes=minimum) as comm:
        assert dist.Work.wait is not original_wait, "Work.wait is not observed"
        for step in range(steps):
            workloads.train_step(model, opt, 1 + step, rank, world_size)
    assert dist.Work.wait is original_wait, "Work.wait was not restored"
    return comm.rank_report().to_dict()


def _group_shard_bytes(world_size: int, align: int) -> dict[str, int]:
    """Padded shard bytes of each fully_shard group of the MLP test model (fp32)."""
    model = models.build("mlp")
    groups: dict[str, int] = {}
    for name, param in model.named_parameters():
        group = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else ""
        chunk = math.ceil(param.shape[0] / world_size) * math.prod(param.shape[1:]) * 4
        groups[group] = groups.get(group, 0) + math.ceil(chunk / align) * align
    return groups


def _step_check_bytes(world_size: int) -> int:
    """What shardkit's step check sends at the end of a backward, at W ranks on gloo: its
    header and one byte per trainable parameter, to each peer (``runtime/watch/step_check.py``)."""
    from shardkit.core.layout import STEP_CHECK_HEADER_BYTES

    flags = sum(1 for _ in models.build("mlp").parameters())
    return (STEP_CHECK_HEADER_BYTES + flags) * (world_size - 1)


def _minimum_of_schedule(world_size: int) -> int:
    """Ψ·4·(W-1)/W per fp32 gather and reduction of each group of the MLP (the root, kept
    unsharded between forward and backward, gathered once)."""
    numels: dict[str, int] = {}
    for name, param in models.build("mlp").named_parameters():
        group = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else ""
        numels[group] = numels.get(group, 0) + param.numel()
    total = 0
    for group, numel in numels.items():
        one = numel * 4 * (world_size - 1) // world_size
        total += (2 if group else 1) * one + one
    return total


def _per_step(report: RankReport, step: int) -> list[CollectiveRecord]:
    return [c for c in report.collectives if c.step == step]


@pytest.mark.parametrize(("engine", "align"), [("shardkit", 16), ("torch", 1)])
@pytest.mark.parametrize("world_size", [2, 4])
def test_fully_shard_engines_bytes_phases_and_modules(
    engine: str, align: int, world_size: int
) -> None:
    reports = [
        RankReport.from_dict(r)
        for r in run_on_ranks(world_size, _tracked_steps, engine=engine, steps=2)
    ]
    shards = _group_shard_bytes(world_size, align)
    # Forward gathers every group; backward re-gathers the blocks (the root stays unsharded
    # between forward and backward); every group's gradients are reduce-scattered once.
    # shardkit aligns each parameter's shard to 16 bytes in the gathered buffer only.
    expected_gather = (2 * sum(shards.values()) - shards[""]) * (world_size - 1)
    expected_reduce = sum(_group_shard_bytes(world_size, 1).values()) * (world_size - 1)
    # shardkit's step check: a few dozen bytes to each peer where a backward ends.
    check = {"send": _step_check_bytes(world_size), "recv": 0} if engine == "shardkit" else {}
    for report in reports:
        assert report.world_size == world_size
        assert report.comm is not None and len(report.comm.steps) == 2
        for step in report.comm.steps:
            assert step.sent_bytes_by_kind == {
                "all_gather": expected_gather,
                "reduce_scatter": expected_reduce,
                **check,
            }
            assert step.sent_bytes == expected_gather + expected_reduce + sum(check.values())
            assert 0 <= step.exposed_s <= step.step_s and 0 < step.comm_s <= step.step_s
        # No minimum given: computed from the model's groups, the same for both engines:
        # each group's parameters gathered as often as the engine did, reduced once, unpadded.
        assert report.comm.minimum_computed
        assert report.comm.theoretical_min_bytes == _minimum_of_schedule(world_size)
        rows = [c for c in _per_step(report, 1) if c.kind not in check]
        by_phase = Counter((c.kind, c.phase) for c in rows)
        assert by_phase == {
            ("all_gather", Phase.FORWARD): 4,
            ("all_gather", Phase.BACKWARD): 3,
            ("reduce_scatter", Phase.BACKWARD): 4,
        }
        if engine == "shardkit":  # gloo's point-to-point messages fold into logical records
            assert {c.op for c in rows} == {"shardkit.all_gather", "shardkit.reduce_scatter"}
        # Which group each collective is for: shardkit's engine says; torch's is worked out
        # from the groups' shard sizes and forward order. Every group is gathered in forward
        # and reduced once; blocks are gathered again in backward.
        groups = ["", "blocks.0", "blocks.1", "blocks.2"]
        served = Counter((c.kind, c.phase, c.serves) for c in rows)
        assert served == {
            **{("all_gather", Phase.FORWARD, g): 1 for g in groups},
            **{("all_gather", Phase.BACKWARD, g): 1 for g in groups[1:]},
            **{("reduce_scatter", Phase.BACKWARD, g): 1 for g in groups},
        }
        # Reduced in the reverse of forward order, whatever module was running.
        reduced = [c.serves for c in rows if c.kind == "reduce_scatter"]
        assert reduced == ["blocks.2", "blocks.1", "blocks.0", ""]
        # On the wire: gloo's own reduce-scatter (torch) sends twice its payload; shardkit's
        # messages send the payload; all-gathers send it on both.
        for c in rows:
            twice = engine == "torch" and c.kind == "reduce_scatter"
            assert c.wire_bytes == (2 if twice else 1) * c.sent_bytes, c
        # torch gathers each block from the block's own pre-forward; shardkit prefetches the
        # next block's gather from the running one (the root's under the root, named "").
        forward = [c.module for c in rows if c.phase is Phase.FORWARD]
        if engine == "torch":
            assert forward == ["", "blocks.0", "blocks.1", "blocks.2"]
        else:
            assert forward == ["", "", "blocks.0", "blocks.1"]
        for c in rows:
            assert c.group_size == world_size and c.group
            assert c.wait_s >= 0 and c.start_s <= c.end_s


def test_ddp_all_reduce_in_backward() -> None:
    reports = run_on_ranks(2, _tracked_steps, engine="ddp", steps=2, minimum=1000)
    report = RankReport.from_dict(reports[0])
    assert report.comm is not None and not report.comm.minimum_computed
    mean = sum(s.sent_bytes for s in report.comm.steps) / len(report.comm.steps)
    assert report.comm.sent_over_min == pytest.approx(mean / 1000)
    rows = [c for c in _per_step(report, 1) if c.kind == "all_reduce"]
    grad_bytes = 4 * workloads.param_count()
    assert [c.phase for c in rows] == [Phase.BACKWARD] * len(rows)
    assert sum(c.input_bytes for c in rows) == grad_bytes
    assert sum(c.sent_bytes for c in rows) == grad_bytes  # 2 n (W-1)/W at W=2
    assert all(c.op == "c10d.allreduce_" for c in rows)


def test_fsdp1_gathers_and_reduces() -> None:
    reports = run_on_ranks(2, _tracked_steps, engine="fsdp1", steps=1)
    report = RankReport.from_dict(reports[1])
    kinds = Counter(c.kind for c in _per_step(report, 0))
    assert kinds == {"all_gather": 7, "reduce_scatter": 4}
    assert all(c.wait_s > 0 for c in report.collectives)  # FSDP1 on gloo waits for each


def test_local_training_records_nothing() -> None:
    model, opt = workloads.build("local", 1)
    with CommTracker() as comm:
        workloads.train_step(model, opt, 0, 0, 1)
    assert comm.records == [] and comm.summary().steps == []
    assert comm.rank_report().rank == 0
    assert torch.is_grad_enabled()


def test_nothing_stays_installed_when_not_tracking() -> None:
    before = installed_hooks()
    assert before[0] is False  # no kernel of ours (nor anyone's) at those keys
    with CommTracker():
        during = installed_hooks()
    assert during[0] is True and during[1] == before[1] + 1 and during[2] == before[2] + 1
    assert installed_hooks() == before


def test_tracker_refuses_to_start_twice() -> None:
    tracker = CommTracker().start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            tracker.start()
    finally:
        tracker.stop()


def test_an_exception_inside_leaves_nothing_installed() -> None:
    before = installed_hooks()
    original_wait = dist.Work.wait
    with pytest.raises(ZeroDivisionError), CommTracker():
        _ = 1 / 0
    assert installed_hooks() == before and dist.Work.wait is original_wait


def test_nested_trackers_share_one_installation() -> None:
    before = installed_hooks()
    with CommTracker():
        with CommTracker():
            assert installed_hooks()[0] is True
        assert installed_hooks()[0] is True  # the outer one still needs the kernels
    assert installed_hooks() == before
