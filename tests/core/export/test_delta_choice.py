"""A delta pays or steps aside: per bucket, the changes or the plain part, whichever is cheaper.

At W=2 on gloo, bucket by bucket: a layer whose shards all moved (a large step) goes plain, as
a full export sends it; the layers that barely moved go as changes; a bucket nobody changed
moves nothing. Every sync equals ``full_tensor()`` in the export dtype, the delta's bytes are
never more than a full export's, and the kept part is refreshed in place chunk by chunk (the
chunk made tiny here, so that chunks cut across tensors' rows and the alignment padding).
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


def _syncs(rank: int, world_size: int, chunk: int) -> Any:
    from shardkit.core.export import ModuleReceiver, delta_find
    from shardkit.core.export.exporter import ExportOptions, WeightExporter

    delta_find.CHUNK_ELEMENTS = chunk
    model = sharded("shardkit")
    exporter = WeightExporter(model, ExportOptions(dtype=torch.bfloat16, bucket_bytes=3000))
    target = Decoder().to(torch.bfloat16)
    receiver = ModuleReceiver(target) if exporter.receiving else None
    full = exporter.export(receiver, delta=True)
    rows = []
    for layers, everything in [({0, 1, 2}, set()), ({0}, {2}), (set(), set()), ({1}, {0, 1, 2})]:
        _nudge(model, layers, everything)
        report = exporter.export(receiver, delta=True)
        oracle = full_state(model, torch.bfloat16)  # a collective: every rank
        held = target.state_dict()
        wrong = [n for n, t in oracle.items() if exporter.receiving and not torch.equal(held[n], t)]
        rows.append((report.kind, report.counts.plain_buckets, report.counts.received_bytes, wrong))
    return {"full_bytes": full.counts.received_bytes, "rows": rows}


def test_each_bucket_goes_as_changes_or_plain_whichever_is_cheaper() -> None:
    results = run_on_ranks(2, _syncs, chunk=12)
    first = results[0]
    plain = [row[1] for row in first["rows"]]
    assert all(row[0] == "delta" and row[3] == [] for row in first["rows"])
    # Nudges only: no bucket plain; one layer moved whole: its bucket (and only it) plain;
    # nothing moved: no bytes; every layer moved whole, the embedding too: most plain.
    assert plain[0] == 0 and plain[1] >= 1 and plain[2] == 0 and plain[3] > plain[1]
    assert first["rows"][2][2] == 0
    assert all(row[2] <= first["full_bytes"] for row in first["rows"])
    assert first["rows"][0][2] < first["full_bytes"] // 4
