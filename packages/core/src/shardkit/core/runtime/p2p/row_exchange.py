"""Rows exchanged point to point with every other member of a group: the core's one such loop.

gloo's all-gather and reduce-scatter (``runtime/collectives.py``), the desync checks'
fingerprints (sent from there too) and the step check's digests (``watch/step_check.py``) each
send this rank's row, or one row per peer, to every other member and receive every member's row
for this rank. They all
post through :func:`post_row_exchange`, so the order of their messages is one rule, not copies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["post_row_exchange"]


def post_row_exchange(
    group: dist.ProcessGroup,
    tag: int,
    *,
    send: torch.Tensor,
    receive_into: torch.Tensor,
    row_per_peer: bool = False,
) -> list[dist.Work]:
    """Post this rank's receives and sends of an exchange of rows on ``group``; wait on none.

    For each peer in rank order, a receive of its row, then a send of this rank's. Every message
    is posted before any is waited for, so no member waits on another before its own sends are
    out, and an exchange cannot deadlock whatever its peers' timing. gloo pairs messages from
    one sender with one tag in the order they were posted, so the n-th exchange with a tag
    between two ranks meets the n-th.

    Args:
        group: the members; this rank's own row is never sent.
        tag: the messages' tag, from :mod:`~shardkit.core.runtime.p2p.p2p_tags`.
        send: the one row (N) sent to every peer; or, with ``row_per_peer``, rows (W, N)
            whose row j goes to rank j.
        receive_into: (W-1, N): the peers' rows in rank order, this rank having no row; or
            (W, N): row j from rank j, this rank's own row left as it is.
        row_per_peer: whether ``send`` holds one row for each rank.

    Returns:
        The works of the receives and sends, in the order they were posted.
    """
    size, rank = group.size(), group.rank()
    own_row_included = receive_into.size(0) == size
    assert own_row_included or receive_into.size(0) == size - 1, "one row per peer, or per rank"
    works: list[dist.Work] = []
    for peer in range(size):
        if peer == rank:
            continue
        slot = peer if own_row_included or peer < rank else peer - 1
        received = dist.irecv(receive_into[slot], group=group, group_src=peer, tag=tag)
        row = send[peer] if row_per_peer else send
        sent = dist.isend(row, group=group, group_dst=peer, tag=tag)
        works += [w for w in (received, sent) if w is not None]
    return works
