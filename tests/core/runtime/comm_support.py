"""User collectives in torch's AllGather / ReduceScatter shape, for the custom-comm tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class CountingAllGather:
    """All-gather into one flat output through c10d, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls += 1
        work: dist.Work | None = dist.all_gather_into_tensor(
            output_tensor, input_tensor, group, async_op=async_op
        )
        return work


class AllReduceScatter:
    """Reduce-scatter as an all-reduce of the whole input, keeping this rank's chunk."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls += 1
        summed = input_tensor.clone()
        dist.all_reduce(summed, op=op, group=group)
        output_tensor.copy_(summed.view(group.size(), -1)[group.rank()])
        return None


def halve(reduced: torch.Tensor) -> None:
    """An all-reduce hook: scale the summed gradient in place."""
    reduced.mul_(0.5)
