"""Gradient reduction of one parameter group: pack, reduce-scatter, all-reduce, assign.

The full gradients of the group's trainable parameters are packed rank-major into one (W, S)
buffer (row r: rank r's padded shards), reduced with one collective, optionally all-reduced
across HSDP replicas, divided, and assigned as DTensor gradients that view the result (or
added to gradients already there). See [Note: flat group buffers].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardkit.core.context import CommContext
from shardkit.core.mesh_info import MeshInfo
from shardkit.core.options import GroupOptions
from shardkit.core.param import FSDPParam
from shardkit.core.runtime.buffers import pack_grads_rank_major
from shardkit.core.runtime.collectives import DoneHandle
from shardkit.core.runtime.dtensors import dtensor_like, local_of
from shardkit.core.runtime.protocol import CollectiveHandle

__all__ = ["GroupReducer", "PendingReduce"]


@dataclass(slots=True)
class PendingReduce:
    """A gradient reduction in flight, finished by ``GroupReducer.finish``."""

    reducer: GroupReducer
    handle: CollectiveHandle
    output: torch.Tensor  # (S,) in the reduce dtype: this rank's summed shard
    buffers: tuple[torch.Tensor, ...]  # pool buffers to return once the exchange is done

    def finish(self, comm: CommContext) -> None:
        """Wait, all-reduce across replicas, divide and assign the sharded gradients."""
        self.reducer.finish(self, comm)


class GroupReducer:
    """Reduces the gradients of one group's trainable parameters."""

    def __init__(
        self,
        trainable: list[FSDPParam],
        reduce_dtype: torch.dtype,
        mesh_info: MeshInfo,
        options: GroupOptions,
        offload: tuple[bool, bool],
    ) -> None:
        self.trainable = trainable
        self.label = ""  # the group's module, named in its collectives' events (see start)
        self.dtype = reduce_dtype
        self.mesh_info = mesh_info
        self.options = options  # shared with the group: set_* methods change it
        self.offload, self.pin_memory = offload
        self.orig_dtype = trainable[0].orig_dtype if trainable else None
        offsets: list[int] = []
        cursor = 0
        for p in trainable:
            offsets.append(cursor)
            cursor += p.geometry.shard_numel
        self.offsets = tuple(offsets)
        self.numel = cursor  # S: one rank's padded shards of every trainable parameter
        self.geometries = [p.geometry for p in trainable]
        self.partial: torch.Tensor | None = None  # HSDP: reduced but not yet all-reduced

    @property
    def send_nbytes(self) -> int:
        """Bytes of the (W, S) buffer a reduction sends from."""
        return self.mesh_info.shard_size * self.numel * self.dtype.itemsize

    @property
    def pre_divide(self) -> float:
        """Divisor applied before the sum (fp16 only, against overflow)."""
        # fp16 sums of many ranks can overflow: divide by about sqrt(factor) before the sum
        # and the rest after. fp32 and bf16 have the range to divide once, after.
        if self.dtype != torch.float16:
            return 1.0
        factor = self.options.gradient_divide_factor or self.mesh_info.dp_size
        pre = 1.0
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return pre

    def start(
        self, grads: Sequence[torch.Tensor | None], comm: CommContext, label: str = ""
    ) -> None:
        """Pack ``grads`` (one per trainable parameter, or None) and issue the reduction.

        ``label`` names the group's module to observers (known only after lazy init).
        """
        self.label = label
        world = self.mesh_info.shard_size
        device = self.mesh_info.device
        # Bound the memory of reductions in flight: finish the oldest before allocating this
        # one's buffers, so two send buffers never coexist at backward's memory peak. The
        # oldest had a whole group's backward to complete: waiting here is (almost) free.
        while len(comm.pending_reduces) >= comm.max_reduces_in_flight:
            comm.finish_oldest()
        output = torch.empty(self.numel, dtype=self.dtype, device=device)
        if world == 1:
            # Nothing to scatter: pack straight into the output.
            pack_grads_rank_major(grads, self.geometries, self.offsets, output.view(1, -1))
            if self.pre_divide != 1:
                output.div_(self.pre_divide)
            comm.pending_reduces.append(PendingReduce(self, DoneHandle(), output, ()))
        else:
            send = comm.pool.get(self.send_nbytes, device)
            rows = send.view(self.dtype).view(world, self.numel)  # (W, S)
            pack_grads_rank_major(grads, self.geometries, self.offsets, rows)
            if self.pre_divide != 1:
                rows.div_(self.pre_divide)
            handle = comm.runtime.reduce_scatter(
                output, rows, self.mesh_info.shard_group, label=self.label
            )
            comm.pending_reduces.append(PendingReduce(self, handle, output, (send,)))

    def finish(self, pending: PendingReduce, comm: CommContext) -> None:
        """Wait for a reduction, all-reduce across replicas, divide, assign sharded grads."""
        pending.handle.wait()
        for buffer in pending.buffers:
            comm.pool.put(buffer)
        reduced = pending.output
        if self.mesh_info.replicate_group is not None:
            if self.partial is not None:
                reduced.add_(self.partial)
                self.partial = None
            if not self.options.all_reduce_grads:
                self.partial = reduced
                return
            comm.runtime.all_reduce(
                reduced, self.mesh_info.replicate_group, label=self.label
            ).wait()
        factor = (self.options.gradient_divide_factor or self.mesh_info.dp_size) / self.pre_divide
        if factor != 1:
            reduced.div_(factor)
        self._assign(reduced)

    def _assign(self, reduced: torch.Tensor) -> None:
        if self.orig_dtype is not None and reduced.dtype != self.orig_dtype:
            reduced = reduced.to(self.orig_dtype)
        if self.offload and reduced.device.type != "cpu":
            reduced = reduced.to("cpu", non_blocking=self.pin_memory)
        for p, offset in zip(self.trainable, self.offsets, strict=True):
            local = p.local_view(reduced[offset : offset + p.geometry.shard_numel])
            param = p.sharded_param
            if param.grad is None:
                param.grad = dtensor_like(local, param)
            else:
                local_of(param.grad).add_(local)
