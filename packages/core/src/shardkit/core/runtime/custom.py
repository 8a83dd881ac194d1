"""User-supplied collectives (``set_custom_all_gather`` / ``set_custom_reduce_scatter``).

A custom collective follows torch's ``AllGather`` / ``ReduceScatter`` interface: it allocates
its own buffers and runs the communication itself (a quantized all-gather, a buffer from a
special memory pool). The runtime hands it the same flat buffers its own collectives take and
wraps what it returns in the same handles, so parameter groups see no difference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardkit.core.runtime.protocol import CustomComm

__all__ = ["custom_all_gather_rows", "custom_reduce_scatter"]


def custom_all_gather_rows(
    comm: CustomComm, input: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, dist.Work | None]:
    """Run ``comm`` on ``input`` (N uint8 bytes): the (W, N) rows it gathered, and its work."""
    size, nbytes = group.size(), input.numel()
    output = comm.allocate((size * nbytes,), dtype=input.dtype, device=input.device)
    work = comm(output, input, group, async_op=True)
    return output.view(size, nbytes), work


def custom_reduce_scatter(
    comm: CustomComm,
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp | dist.ReduceOp.RedOpType,
) -> dist.Work | None:
    """Run ``comm``: row r of ``input`` (W, S), reduced over ranks by ``op``, into ``output``.

    ``op`` is the one torch's fully_shard would hand it (a mean, in most runs).
    """
    return comm(output, input.view(-1), group, op, async_op=True)
