"""A delta that does not pay steps aside: ``ExportOptions(plain_when_faster=True)``.

The times come from a clock the test drives (each comparison and each bucket moved whole
advance it by a set amount; nothing else does), so the choice is the same at every run: where
the comparisons cost more than the moves, every bucket goes plain, uncompared, for a run of
syncs, then is compared again; where they cost less, or the option is off, every sync compares.
Every sync equals ``full_tensor()`` in bf16 either way, and a sync whose buckets all go plain
skips the counts' all-gather; so does one whose buckets are all in a dense run, agreed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from shardkit.core.export import delta_pace
from tests.core.export.export_models import Decoder, full_state, perturb, sharded


class _Clock:
    """``time.perf_counter`` for the modules that time a delta: it moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@contextmanager
def _driven(compare_s: float, move_s: float, probe_share: float) -> Iterator[None]:
    """Each comparison costs ``compare_s``, each bucket moved whole ``move_s`` (the worker
    processes live on: everything is put back)."""
    from shardkit.core.export import delta_transfer
    from shardkit.core.export.transfer import BucketTransfer

    clock = _Clock()
    refresh, move = vars(delta_transfer)["refresh_part"], BucketTransfer.move

    def timed_refresh(pieces: Any, part: Any, dtype: Any, limit: int) -> Any:
        clock.now += compare_s if limit >= 0 else 0.0
        return refresh(pieces, part, dtype, limit)

    def timed_move(self: BucketTransfer, bucket: Any) -> Any:
        clock.now += move_s
        return move(self, bucket)

    timed = (delta_transfer, delta_pace)
    saved = [vars(m)["time"] for m in timed]
    share = delta_pace.PROBE_SHARE
    vars(delta_transfer)["refresh_part"] = timed_refresh
    BucketTransfer.move = timed_move  # type: ignore[method-assign]
    for module in timed:
        vars(module)["time"] = clock
    delta_pace.PROBE_SHARE = probe_share
    try:
        yield
    finally:
        vars(delta_transfer)["refresh_part"] = refresh
        BucketTransfer.move = move  # type: ignore[method-assign]
        for module, was in zip(timed, saved, strict=True):
            vars(module)["time"] = was
        delta_pace.PROBE_SHARE = share


def _syncs(rank: int, world_size: int, compare_s: float, on: bool, dense: bool = False) -> Any:
    """A full export, then 14 deltas after a step each (small, or moving every element where
    ``dense``): per sync, what it did."""
    from shardkit.core.export import ModuleReceiver
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    # A plain sync is one move a bucket (1 s); a compared one costs compare_s in its count.
    # PROBE_SHARE 1: a run as long as the comparison's excess over a plain sync, in syncs.
    with _driven(compare_s, move_s=1.0, probe_share=1.0):
        model = sharded("shardkit")
        options = ExportOptions(dtype=torch.bfloat16, bucket_bytes=3000, plain_when_faster=on)
        exporter = WeightExporter(model, options)
        target = Decoder().to(torch.bfloat16)
        receiver = ModuleReceiver(target) if exporter.receiving else None
        exporter.export(receiver, delta=True)
        rows = []
        for sync in range(14):
            perturb(model, sync)
            if dense:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.125)  # every bucket dense
            report = exporter.export(receiver, delta=True)
            oracle = full_state(model, torch.bfloat16)  # a collective: every rank
            held = target.state_dict()
            same = not exporter.receiving or all(torch.equal(held[n], t) for n, t in oracle.items())
            counts = report.counts
            rows.append(
                (
                    counts.compared_buckets,
                    counts.paced_buckets,
                    counts.plain_buckets,
                    counts.collectives,
                    same,
                    len(exporter.buckets),
                )
            )
        return rows


def test_a_delta_slower_than_the_plain_move_goes_plain_for_longer_runs() -> None:
    """Comparisons at 3 s a bucket against 1 s moves: each comparison costs 2 plain syncs more,
    so the runs last 2, then 4, then 8 syncs (at least twice the last): compared at syncs 1, 4,
    9; plain, uncompared, in between, with one all-gather less."""
    rows = run_on_ranks(2, _syncs, compare_s=3.0, on=True)
    for rank_rows in rows:
        assert all(row[4] for row in rank_rows)  # every sync equals full_tensor() in bf16
        buckets = rank_rows[0][5]
        compared = [i + 1 for i, row in enumerate(rank_rows) if row[0]]
        assert compared == [1, 4, 9]
        paced = [row for row in rank_rows if row[1]]
        assert len(paced) == 11
        assert all(row[1] == row[2] == buckets and row[0] == 0 for row in paced)
        # The agreement, a gather a bucket, the end: the counts' all-gather is skipped where
        # every bucket goes plain, agreed before the count.
        assert all(row[3] == buckets + 2 for row in paced)
        assert all(rank_rows[i - 1][3] == buckets + 3 for i in compared)


@pytest.mark.parametrize(("compare_s", "on"), [(0.5, True), (3.0, False)])
def test_a_delta_that_pays_or_an_exporter_that_does_not_ask_compares_every_sync(
    compare_s: float, on: bool
) -> None:
    rows = run_on_ranks(2, _syncs, compare_s=compare_s, on=on)
    for rank_rows in rows:
        assert all(row[4] for row in rank_rows)
        assert all(row[0] > 0 for row in rank_rows)  # none went plain for being slow
        if on:  # a bucket found dense goes plain on every rank alike: the others are compared
            assert all(row[0] + row[1] == row[5] for row in rank_rows)
        else:  # each rank runs its dense buckets on its own: none paced
            assert all(row[1] == 0 for row in rank_rows)


def test_a_dense_bucket_goes_plain_on_every_rank_alike_without_the_counts() -> None:
    """Comparisons that pay (0.5 s against 1 s moves), but every bucket dense: the runs of a
    dense bucket (1, 2, 4, 8 syncs: compared at 1, 3, 6, 11), agreed, so that the syncs between
    skip the counts' all-gather as paced ones do."""
    rows = run_on_ranks(2, _syncs, compare_s=0.5, on=True, dense=True)
    for rank_rows in rows:
        assert all(row[4] for row in rank_rows)
        buckets = rank_rows[0][5]
        assert [i + 1 for i, row in enumerate(rank_rows) if row[0]] == [1, 3, 6, 11]
        assert all(row[2] == buckets for row in rank_rows)  # plain throughout
        skipped = [row for row in rank_rows if not row[0]]
        assert all(row[1] == buckets and row[3] == buckets + 2 for row in skipped)


def test_the_run_follows_the_slowest_ranks_and_spreads_the_comparisons_cost() -> None:
    share = delta_pace.PROBE_SHARE
    # Paid, or not judged (no plain time where it was compared; nothing compared).
    assert delta_pace.slow_run([200, 250], [250, 300], run=8) == 0
    assert delta_pace.slow_run([400, 500], [300, 0], run=0) == 0
    assert delta_pace.slow_run([0, 0], [300, 300], run=0) == 0
    # The slowest delta against the slowest plain move: 300 > 250.
    assert delta_pace.slow_run([100, 300], [250, 200], run=0) == 4  # 0.2 / share, rounded up
    # Twice the plain move: one plain sync more a comparison, spread over 1 / share syncs;
    # twice the last run at least; SLOW_RUN at most.
    assert delta_pace.slow_run([200, 200], [100, 100], run=0) == round(1 / share)
    assert delta_pace.slow_run([200, 200], [100, 100], run=40) == 80
    assert delta_pace.slow_run([200, 200], [100, 100], run=200) == delta_pace.SLOW_RUN
    # A rank that took no part posts zeros: the others decide.
    assert delta_pace.slow_run([0, 300], [0, 100], run=0) == round(2 / share)
