"""The exchange after a replica-split load (``runtime/replica_exchange.py``): bit for bit, in
a few copies a bucket.

Each replica's part (row boxes, a transposed and a column box that are not contiguous, a
scalar, mixed dtypes, an empty tensor) lands on every replica exactly as its reader holds it,
whether the parts share one bucket or are cut into many; the copies grow with the buckets
(a ``cat`` for this rank's span, a ``split_with_sizes_copy`` for the spans before it and one
for those after), plus one for each box that is not contiguous, never one per box; the
broadcasts stay one per replica's part where the parts fit in a bucket.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.pool import run_on_ranks

_COPIES = ("aten.copy_", "aten.cat", "aten.split_with_sizes_copy")


def _tensors(seed: int) -> list[torch.Tensor]:
    """The local tensors every replica holds (the same shapes and dtypes everywhere)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(40, 6, generator=generator),
        torch.randn(17, 3, generator=generator).to(torch.bfloat16),
        torch.randint(-9, 9, (9,), generator=generator),
        torch.randn(5, 4, generator=generator, dtype=torch.float64),
        torch.rand(11, generator=generator) > 0.5,
        torch.randn((), generator=generator),
        torch.randn(0, 3, generator=generator),
    ]


def _parts(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Three replicas' parts: boxes of ``tensors``, none overlapping."""
    a, b, c, d, e, f, g = tensors
    return [
        [a[0:7], a[7:8], b.t()[:, 0:5], c, g],  # b.t()[...]: not contiguous
        [a[8:30], d[:, 1:3], f],  # d[:, 1:3]: not contiguous
        [a[30:40], b[5:17], d[:, 0], d[:, 3], e],
    ]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _exchange(rank: int, world_size: int, bucket_bytes: int) -> dict[str, Any]:
    import torch.distributed as dist

    from shardkit.core.runtime import replica_exchange
    from shardkit.tools import OpCounter

    truth = _parts(_tensors(seed=0))
    mine = _tensors(seed=100 + rank)  # what this rank holds before: not the truth
    parts = _parts(mine)
    for box, true in zip(parts[rank], truth[rank], strict=True):
        box.copy_(true)  # this rank read its own part
    held = replica_exchange._BUCKET_BYTES
    replica_exchange._BUCKET_BYTES = bucket_bytes
    group = dist.group.WORLD
    assert group is not None
    try:
        buckets = len(replica_exchange._buckets(parts))
        with OpCounter() as ops:
            received, broadcasts = replica_exchange.broadcast_parts(
                parts, list(range(world_size)), rank, group
            )
    finally:
        replica_exchange._BUCKET_BYTES = held
    same = all(
        torch.equal(_bits(box), _bits(true))
        for part, true_part in zip(parts, truth, strict=True)
        for box, true in zip(part, true_part, strict=True)
    )
    others = [t for r, part in enumerate(parts) if r != rank for t in part if t.numel()]
    alone = 0  # the broadcasts of each part cut into buckets on its own (the rule before)
    for part in parts:
        used = 0
        for size in (t.numel() * t.element_size() for t in part if t.numel()):
            if not used or used + size > bucket_bytes:
                alone, used = alone + 1, 0
            used += size
    return {
        "same": same,
        "copies": sum(ops.by_op[name] for name in _COPIES),
        "buckets": buckets,
        "broadcasts": broadcasts,
        "alone": alone,
        "received": received,
        "expected_received": sum(t.numel() * t.element_size() for t in others),
        "boxes": sum(len(part) for part in parts),
        "scattered": sum(not t.is_contiguous() for t in others),
    }


def _exchanges(rank: int, world_size: int) -> list[dict[str, Any]]:
    """:func:`_exchange` with every part in one bucket, with a few buckets, and a bucket a box."""
    return [_exchange(rank, world_size, b) for b in _BUCKET_SIZES]


_BUCKET_SIZES = (256 << 20, 200, 1)


def test_replicas_parts_land_bit_for_bit_in_a_few_copies_a_bucket() -> None:
    found = run_on_ranks(3, _exchanges)
    for i, bucket_bytes in enumerate(_BUCKET_SIZES):
        results = [per_rank[i] for per_rank in found]
        for rank, r in enumerate(results):
            assert r["same"], (bucket_bytes, rank)
            assert r["received"] == r["expected_received"], r
            # One cat (this rank's span) and at most two splits a bucket, one copy more for
            # each box it receives that is not contiguous; before: one copy a box.
            assert r["copies"] <= 3 * r["buckets"] + r["scattered"], r
            # Parts share buckets, but none is cut more than it would be alone.
            assert r["broadcasts"] == r["alone"], r
        if bucket_bytes > 1024:  # every part in one bucket: one broadcast a part
            assert all(r["buckets"] == 1 and r["broadcasts"] == 3 for r in results), results
            assert all(r["copies"] <= 3 + r["scattered"] < r["boxes"] for r in results), results
