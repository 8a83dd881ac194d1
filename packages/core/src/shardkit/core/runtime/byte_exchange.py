"""Bytes of any length from every member of a group to every other, in one all-to-all.

The whole-matrix optimizers (``shardkit.core.optim``) move each matrix's rows to the rank that
owns it, and the owner's update rows back, once each way per step: every part a rank sends is
a different length (ragged rows, matrices of several shapes and dtypes), so the parts travel
as bytes, packed one after another, through one ``all_to_all_single`` with split sizes (gloo's
and NCCL's alltoallv). One collective per direction and round, however many matrices: the step's
collectives stay few. ``start_exchange_bytes`` leaves it in flight, so that an owner
orthogonalizes the matrices that came while the next ones travel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardkit.core.runtime.handles import WorkHandle

__all__ = ["exchange_bytes", "start_exchange_bytes"]


def exchange_bytes(
    send: torch.Tensor,
    send_sizes: list[int],
    receive_sizes: list[int],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Send part j of ``send`` to rank j of ``group``; return the parts received, in rank order.

    Blocking: :func:`start_exchange_bytes`, waited for.
    """
    received, handle = start_exchange_bytes(send, send_sizes, receive_sizes, group)
    handle.wait()
    return received


def start_exchange_bytes(
    send: torch.Tensor,
    send_sizes: list[int],
    receive_sizes: list[int],
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, WorkHandle]:
    """Start sending part j of ``send`` to rank j of ``group``; the received parts and a handle.

    ``send`` must stay as it is, and the received buffer unread, until the handle's ``wait()``.

    Args:
        send: 1-D uint8, the parts for ranks 0 to W-1 one after another.
        send_sizes: W lengths in bytes, summing to ``send``'s (this rank's own part, if any,
            is copied locally by the collective).
        receive_sizes: W lengths in bytes, what each rank sends this one (every rank knows
            them from the plan it shares with the others, so none is exchanged first).
        group: the members.

    Returns:
        1-D uint8 on ``send``'s device, to be filled: the part from rank 0, then rank 1's, and
        so on; and the handle to wait on before reading it.
    """
    assert send.dtype == torch.uint8 and send.dim() == 1, "bytes, packed"
    assert len(send_sizes) == len(receive_sizes) == group.size(), "one size per member"
    assert sum(send_sizes) == send.numel(), "the parts fill the buffer"
    received = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=send.device)
    work = dist.all_to_all_single(
        received, send, receive_sizes, send_sizes, group=group, async_op=True
    )
    return received, WorkHandle(work)
