"""A collective runtime that records what the engine asks of it, for one-process tests.

It stands in for every rank at once: each "other rank" holds the same shard as this one, so
an all-gather returns this rank's row W times and a reduce-scatter sums W equal rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardkit.core.runtime.pool import BufferPool
from shardkit.core.runtime.protocol import CustomComm, RowBlock
from shardkit.core.runtime.reduction import SUM, Reduction


@dataclass
class _Done:
    def wait(self) -> None:
        pass


@dataclass
class _Rows:
    rows: list[torch.Tensor]

    def wait(self) -> list[RowBlock]:
        return [RowBlock(0, torch.stack(self.rows))]

    def release(self) -> None:
        pass


@dataclass
class RecordingRuntime:
    """Records ``(kind, label, bytes)`` for every collective issued."""

    pool: BufferPool = field(default_factory=BufferPool)
    calls: list[tuple[str, str, int]] = field(default_factory=list)

    def gather_buffer(
        self, nbytes: int, group: dist.ProcessGroup, device: torch.device
    ) -> torch.Tensor | None:
        return None  # inputs apart, as on gloo

    def all_gather(
        self,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        label: str = "",
        custom: CustomComm | None = None,
        into: torch.Tensor | None = None,
    ) -> _Rows:
        self.calls.append(("all_gather", label, input.numel()))
        return _Rows([input] + [input.clone() for _ in range(group.size() - 1)])

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        label: str = "",
        custom: CustomComm | None = None,
        op: Reduction = SUM,
    ) -> _Done:
        self.calls.append(("reduce_scatter", label, input.numel() * input.element_size()))
        output.copy_(input[group.rank()] * group.size())
        op.finish_sum(output, group.size())
        return _Done()

    def exchange_rows(
        self, rows: torch.Tensor, group: dist.ProcessGroup, *, label: str = "", algorithm: str
    ) -> _Rows:
        self.calls.append(("reduce_scatter", label, rows.numel()))
        own = rows[group.rank()]
        return _Rows([own.clone() for _ in range(group.size())])  # every rank's row: the same

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        label: str = "",
        op: Reduction = SUM,
    ) -> _Done:
        self.calls.append(("all_reduce", label, tensor.numel() * tensor.element_size()))
        tensor.mul_(group.size())
        op.finish_sum(tensor, group.size())
        return _Done()
