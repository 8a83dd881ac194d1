"""A delta pays or steps aside: per bucket, the changes or the plain part, whichever is cheaper.

At W=2 on gloo, bucket by bucket: a layer whose shards all moved (a large step) goes plain, as
a full export sends it; the layers that barely moved go as changes; a bucket nobody changed
moves nothing. Every sync equals ``full_tensor()`` in the export dtype, the delta's bytes are
never more than a full export's, and the kept part is refreshed in place span by span (the
span made tiny here, so that spans cut across tensors' rows and the alignment padding).
"""

from __future__ import annotations

from typing import Any

import torch

from harness.pool import run_on_ranks
from tests.core.export.export_models import Decoder, full_state, sharded


def _nudge(model: torch.nn.Module, layers: set[int], everything: set[int]) -> None:
    """One unit in the last bf16 place on a few elements of ``layers``' shards, and a large
    move of every element of ``everything``'s (as a high learning rate would)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            layer = int(name.split(".")[2]) if ".layers." in name else -1
            if layer in everything:
                local.mul_(1.5).add_(0.25)
            elif layer in layers and local.numel():
                flat = local.view(-1)
                flat[:: max(1, flat.numel() // 3)] *= 1.01  # about a bf16 unit: a step


def _syncs(rank: int, world_size: int, span: int) -> Any:
    from shardkit.core.export import ModuleReceiver, delta_find
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    spans, delta_find.SPAN_ELEMENTS = delta_find.SPAN_ELEMENTS, span  # the worker lives on
    try:
        model = sharded("shardkit")
        exporter = WeightExporter(model, ExportOptions(dtype=torch.bfloat16, bucket_bytes=3000))
        target = Decoder().to(torch.bfloat16)
        receiver = ModuleReceiver(target) if exporter.receiving else None
        full = exporter.export(receiver, delta=True)
        rows, compared = [], []
        for layers, everything in [
            ({0, 1, 2}, set()),
            ({0}, {2}),
            (set(), set()),
            ({1}, {0, 1, 2}),
        ]:
            _nudge(model, layers, everything)
            report = exporter.export(receiver, delta=True)
            oracle = full_state(model, torch.bfloat16)  # a collective: every rank
            held = target.state_dict()
            wrong = [
                n for n, t in oracle.items() if exporter.receiving and not torch.equal(held[n], t)
            ]
            counts = report.counts
            rows.append((report.kind, counts.plain_buckets, counts.received_bytes, wrong))
            compared.append(counts.compared_buckets)
    finally:
        delta_find.SPAN_ELEMENTS = spans
    return {"full_bytes": full.counts.received_bytes, "rows": rows, "compared": compared}


def test_each_bucket_goes_as_changes_or_plain_whichever_is_cheaper() -> None:
    results = run_on_ranks(2, _syncs, span=16)
    first = results[0]
    plain = [row[1] for row in first["rows"]]
    assert all(row[0] == "delta" and row[3] == [] for row in first["rows"])
    # Nudges only: no bucket plain; one layer moved whole: its bucket (and only it) plain;
    # nothing moved: that bucket, found dense, moves whole once more, uncompared (a full
    # export's cost), and the others move nothing; every layer moved whole, the embedding
    # too: most plain.
    assert plain[0] == 0 and plain[1] >= 1 and plain[2] == plain[1] and plain[3] > plain[1]
    buckets = first["compared"][0]
    assert first["compared"][1:3] == [buckets, buckets - plain[1]]
    assert 0 < first["rows"][2][2] < first["full_bytes"]
    assert all(row[2] <= first["full_bytes"] for row in first["rows"])
    assert first["rows"][0][2] < first["full_bytes"] // 4


def _dense_runs(rank: int, world_size: int, syncs: int) -> Any:
    """A model whose every element moves at each sync for ``syncs`` syncs, then none does."""
    from shardkit.core.export import ModuleReceiver
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    model = sharded("shardkit")
    exporter = WeightExporter(model, ExportOptions(dtype=torch.bfloat16))
    target = Decoder().to(torch.bfloat16)
    receiver = ModuleReceiver(target) if exporter.receiving else None
    exporter.export(receiver, delta=True)
    rows = []
    for sync in range(syncs + 12):
        if sync < syncs:
            _nudge(model, set(), {0, 1, 2})
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.125)  # the embedding and the norms too: every bucket dense
        report = exporter.export(receiver, delta=True)
        oracle = full_state(model, torch.bfloat16)
        held = target.state_dict()
        same = not exporter.receiving or all(torch.equal(held[n], t) for n, t in oracle.items())
        counts = report.counts
        rows.append((counts.compared_buckets, counts.plain_buckets, counts.received_bytes, same))
    return rows


def test_a_dense_bucket_goes_plain_uncompared_for_longer_runs_then_is_compared_again() -> None:
    """While a bucket stays dense, it is compared at syncs 1, 3, 6, 11, 20, 29 (skipping 1, 2,
    4, 8, 8 between): in between it costs a full export's cast, no comparison. Once it stops
    changing, the next comparison finds it quiet and it moves nothing from then on."""
    from shardkit.core.export.delta_transfer import DENSE_RUN

    assert DENSE_RUN == 8
    rows = run_on_ranks(2, _dense_runs, syncs=24)[0]
    assert all(row[3] for row in rows)  # every sync equals full_tensor() in bf16
    compared = [i + 1 for i, row in enumerate(rows) if row[0]]
    assert compared[:5] == [1, 3, 6, 11, 20]
    # Dense throughout the first 24 syncs: every bucket plain at each.
    assert all(row[1] == rows[0][1] > 0 for row in rows[:24])
    # Quiet from sync 25: plain (uncompared) until the comparison at 29, nothing after it.
    assert compared[5] == 29 and rows[28][1] == 0 and rows[28][2] == 0
    assert all(row[0] and row[2] == 0 for row in rows[29:])
