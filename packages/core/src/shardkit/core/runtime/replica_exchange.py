"""Tensors that several replicas must hold alike, each read by one, broadcast to the others.

The checkpoint's replica-split loads (``checkpoint/replica_reads.py``) have each replica of a
shard read part of it; here every replica's part goes to the others over their group, packed
into buckets: one collective per bucket, never one per tensor, and one bucket's buffer beside
the state at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["broadcast_parts"]

# A bucket's bytes: each replica's part travels in pieces of at most this, so the exchange
# holds one piece beside the state, not a replica's whole part.
_BUCKET_BYTES = 256 << 20
_ALIGN = 16  # every tensor's place in a bucket, so that it can be viewed as its dtype


def _buckets(tensors: list[torch.Tensor]) -> list[list[tuple[torch.Tensor, int]]]:
    """``tensors`` cut into buckets of at most ``_BUCKET_BYTES`` (one tensor may exceed it).

    Each as (tensor, its offset in the bucket), offsets aligned to ``_ALIGN`` bytes.
    """
    buckets: list[list[tuple[torch.Tensor, int]]] = [[]]
    used = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if size == 0:
            continue
        other_device = bool(buckets[-1]) and buckets[-1][0][0].device != tensor.device
        if used and (used + size > _BUCKET_BYTES or other_device):
            buckets.append([])
            used = 0
        buckets[-1].append((tensor, used))
        used += -(-size // _ALIGN) * _ALIGN
    return [bucket for bucket in buckets if bucket]


def broadcast_parts(
    parts: list[list[torch.Tensor]], ranks: list[int], me: int, group: dist.ProcessGroup
) -> tuple[int, int]:
    """Each replica's part broadcast from it to the others, bucket by bucket (collective).

    ``parts[r]``: the tensors replica ``r`` (global rank ``ranks[r]``) holds the values of;
    the others' tensors of the same shapes and dtypes are overwritten with them. ``me``: this
    rank's place in ``ranks``. Returns (bytes received, broadcasts made).
    """
    received = broadcasts = 0
    for reader, part in enumerate(parts):
        mine = reader == me
        for bucket in _buckets(part):
            last, offset = bucket[-1]
            nbytes = offset + last.numel() * last.element_size()
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=last.device)
            if mine:
                for tensor, at in bucket:
                    _view(buffer, tensor, at).copy_(tensor)
            dist.broadcast(buffer, src=ranks[reader], group=group)
            broadcasts += 1
            if not mine:
                for tensor, at in bucket:
                    tensor.copy_(_view(buffer, tensor, at))
                received += sum(t.numel() * t.element_size() for t, _ in bucket)
    return received, broadcasts


def _view(buffer: torch.Tensor, tensor: torch.Tensor, at: int) -> torch.Tensor:
    """The bytes of ``buffer`` at ``at`` seen as ``tensor``'s dtype and shape."""
    size = tensor.numel() * tensor.element_size()
    return buffer[at : at + size].view(tensor.dtype).view(tensor.shape)
