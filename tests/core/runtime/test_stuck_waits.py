"""Stuck waits: ranks that wait in engine collectives that cannot pair raise within seconds.

A tower sharded on its own, not marked conditional, that rank 1 skips: rank 0 waits in the
tower's all-gather, rank 1 in its next collective. Without the stuck check both wait until
the process group's timeout and fail with gloo's "Timed out waiting ... for recv". With it,
every rank raises the same ``StuckCollectiveError`` naming what each waits on, a few seconds
after the bound (``SHARDKIT_COLLECTIVE_BOUND``, 5 s by default). A rank that is only slow
(it sleeps past the bound before it joins) is not accused: the step completes.

Each task shards on a gloo group of its own: the error closes its connections, and the
pool's default group must stay usable for the next task.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from harness.pool import run_on_ranks

BOUND_S = 5.0  # the default bound (SHARDKIT_COLLECTIVE_BOUND)


class _Multimodal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))  # images
        self.embed = nn.Linear(8, 8)  # text
        self.head = nn.Linear(8, 2)

    def forward(self, text: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        h = self.embed(text)
        if image is not None:  # a text-only batch skips the tower
            h = h + self.tower(image)
        out: torch.Tensor = self.head(h)
        return out


def _tower_body(rank: int, world_size: int, skip: bool, bound_s: float, sleep_s: float) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from shardkit.core import StuckCollectiveError, fully_shard, set_collective_bound
    from shardkit.core.runtime.watch.progress import SETTINGS

    group = dist.new_group(backend="gloo")  # closed by the error: never the pool's own
    mesh = DeviceMesh.from_group(group, "cpu")
    model = _Multimodal()
    fully_shard(model.tower, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the tower is not marked set_conditional(True)
    before = SETTINGS.collective_bound_s
    set_collective_bound(bound_s)
    dist.barrier(group=group)  # both clocks start together: sharding took longer on one rank
    start = time.monotonic()
    try:
        image = None if skip and rank == 1 else torch.randn(4, 8)
        if rank == 1:
            time.sleep(sleep_s)  # slow, not stuck: it joins the collective afterwards
        model(torch.randn(4, 8), image).pow(2).mean().backward()
        outcome = "trained"
    except StuckCollectiveError as error:
        outcome = str(error)
    finally:
        set_collective_bound(before)
    return {"outcome": outcome, "elapsed": time.monotonic() - start, "default": before}


def test_a_module_one_rank_skips_unmarked_is_named_on_every_rank_within_seconds() -> None:
    results = run_on_ranks(2, _tower_body, skip=True, bound_s=BOUND_S, sleep_s=0.0, timeout_s=90)
    assert results[0]["default"] == BOUND_S, "the default bound is 5 s"
    first = results[0]["outcome"]
    assert first == results[1]["outcome"], "every rank raises the same error"
    assert "wait in collectives that cannot pair" in first, first
    assert "rank 0: all-gather of tower in forward" in first, first
    assert "rank 1: " in first and "set_conditional(True)" in first and "Join(" in first, first
    # Where the ranks went apart, not only where each waits: the root, then the tower.
    assert "went apart at the 2nd sharded module: rank 0 ran `tower`, rank 1 did not" in first
    elapsed = [r["elapsed"] for r in results]
    assert all(BOUND_S <= e < 10.0 for e in elapsed), elapsed


def test_a_rank_slower_than_the_bound_is_not_accused() -> None:
    # The bound at 1 s and rank 1 asleep for 3 s before its forward: rank 0 waits 3 s in the
    # root's all-gather while rank 1 waits in nothing, so the step goes on.
    results = run_on_ranks(2, _tower_body, skip=False, bound_s=1.0, sleep_s=3.0, timeout_s=90)
    assert [r["outcome"] for r in results] == ["trained", "trained"], results
    # Rank 0 waited past the bound for rank 1's sleep (less the moments between the two
    # ranks leaving the barrier) and was not accused.
    assert results[0]["elapsed"] >= 2.5, results


def _info(seq: int, kind: str, label: str, phase: str) -> Any:
    from shardkit.core.runtime.watch.progress import CollectiveInfo

    return CollectiveInfo(seq, kind, label, 64, "uint8", phase, 1)


def test_waits_that_cannot_pair_are_told_from_a_slow_transfer() -> None:
    from shardkit.core.runtime.watch.stuck import _unpaired

    gather, reduce = _info(2, "all_gather", "tower", "forward"), _info(2, "reduce_scatter", "", "x")
    # The same turn, other collectives: they never pair.
    assert _unpaired([gather, reduce], [gather, reduce])
    # Rank 1 waits on #3, which rank 0 (waiting on #2, last issued #2) never issued.
    later = _info(3, "all_gather", "blocks.1", "forward")
    assert _unpaired([gather, later], [gather, later])
    # Rank 0 still receives #2 while rank 1, past it, waits on #3 that both issued: slow.
    assert not _unpaired([gather, later], [later, later])
    # Every rank on one collective: slow, not stuck.
    assert not _unpaired([gather, gather], [gather, gather])


def test_the_message_is_built_from_the_waits_alone() -> None:
    from shardkit.core.runtime.watch.stuck import _message

    gather, reduce = _info(2, "all_gather", "tower", "forward"), _info(2, "reduce_scatter", "", "x")
    text = _message([gather, reduce, reduce])
    assert text == _message([gather, reduce, reduce])
    assert "rank 0: all-gather of tower in forward" in text, text
    assert "ranks 1, 2: reduce-scatter of <root> in x" in text, text


def test_the_bound_is_read_from_the_environment_and_checked(monkeypatch: Any) -> None:
    import pytest

    from shardkit.core import set_collective_bound
    from shardkit.core.runtime.watch import progress

    monkeypatch.setenv("SHARDKIT_COLLECTIVE_BOUND", "2.5")
    assert progress._from_environment().collective_bound_s == 2.5
    monkeypatch.setenv("SHARDKIT_COLLECTIVE_BOUND", "soon")
    assert progress._from_environment().collective_bound_s == BOUND_S
    monkeypatch.delenv("SHARDKIT_COLLECTIVE_BOUND")
    assert progress._from_environment().collective_bound_s == BOUND_S
    with pytest.raises(ValueError, match="set_collective_bound"):
        set_collective_bound(-1)


def test_the_message_names_where_the_forwards_went_apart() -> None:
    from shardkit.core.runtime.watch.stuck import _message

    gather, reduce = _info(2, "all_gather", "tower", "forward"), _info(2, "reduce_scatter", "", "x")
    waits = [gather, reduce, reduce]
    skipped = _message(waits, [["<root>", "tower"], ["<root>"], ["<root>"]])
    assert "went apart at the 2nd sharded module: rank 0 ran `tower`, ranks 1, 2 did not" in skipped
    swapped = _message(waits, [["<root>", "a", "b"], ["<root>", "b", "a"], ["<root>", "a"]])
    assert "at the 2nd sharded module: ranks 0, 2 ran `a`, rank 1 ran `b`" in swapped, swapped
    # Forwards alike (or unknown): nothing said about them.
    assert "went apart" not in _message(waits, [["<root>"], ["<root>"], ["<root>"]])
    assert "went apart" not in _message(waits)
