"""Bytes from one rank to another, point to point: memory snapshots and their replicas.

A memory snapshot of each rank is copied to a rank of another node (its peer), and back to its
owner when a restart needs it (``shardkit.core.snapshots``). Each transfer names who sends
what to whom; every rank posts all of its sends and receives at once, then waits for them, so
two ranks that send to each other (the peers of a two-node job) never wait on one another.
They run on ``groups.snapshot_group()``, a gloo group nothing else uses: the replicas travel
from a background thread while the training thread uses the default group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.core.runtime.groups import snapshot_group
from shardkit.core.runtime.p2p.p2p_tags import PEER_TRANSFER

__all__ = ["Message", "transfer"]


@dataclass(frozen=True, slots=True)
class Message:
    """A tensor sent to, or received from, one global rank.

    Attributes:
        tensor: what is sent, or where the bytes received are written (contiguous).
        rank: the global rank it goes to or comes from.
        part: which part of a transfer between one pair of ranks (0, 1, ...: a snapshot's
            header and data, then a log entry's each): each has its own tag, so the receiver
            never writes one part into another's tensor.
    """

    tensor: torch.Tensor
    rank: int
    part: int = 0


def transfer(sends: Sequence[Message], receives: Sequence[Message]) -> None:
    """Post every send and receive of this rank, then wait for all of them.

    Every rank named must post the matching half (a send for each of its peer's receives) with
    the same part. Blocking; safe to call from a background thread (the group is its own).
    """
    group = snapshot_group()
    works = [
        dist.irecv(m.tensor, src=m.rank, group=group, tag=PEER_TRANSFER.tag(m.part))
        for m in receives
    ]
    works += [
        dist.isend(m.tensor, dst=m.rank, group=group, tag=PEER_TRANSFER.tag(m.part)) for m in sends
    ]
    for work in works:
        if work is not None:
            work.wait()
