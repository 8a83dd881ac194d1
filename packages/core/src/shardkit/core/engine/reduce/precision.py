"""A group's reductions on the wire in a narrow format, summed in float32 once, and checked.

With a ``ReducePrecision`` set (``FSDPModule.set_reduce_precision``), a group's reduce-scatter
encodes each rank's row (``wire``), exchanges the rows (the runtime's ``exchange_rows``: an
all-to-all's bytes), and the owner of each shard decodes the W-1 rows it received and adds
them to its own row, which never travelled and stays exact, in float32 and in rank order:
the same bits on every run. HSDP's all-reduce across replicas runs the same way (a compressed
reduce-scatter over the replicas, then an all-gather of the encoded sums). Error feedback
keeps what the encoding dropped from each row this rank sent and adds it to the next
reduction's row. A numerics check, every ``check_every`` reductions, reduces the same rows
exactly beside it and compares over every rank's shard, so every rank reaches the same
verdict. See [Note: precision-aware reduction].
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from shardkit.core.engine.comm_context import CommContext
from shardkit.core.engine.reduce.wire import WireFormat
from shardkit.core.errors import NumericsCheckError
from shardkit.core.reduce_precision import ReducePrecision
from shardkit.core.runtime.groups import global_rank
from shardkit.core.runtime.protocol import CollectiveHandle, GatheredRows
from shardkit.core.runtime.reduction import Reduction

__all__ = ["WireReducer", "check_policy"]

logger = logging.getLogger(__name__)


class _Param(Protocol):
    @property
    def fqn(self) -> str: ...

    @property
    def orig_dtype(self) -> torch.dtype: ...


class _Group(Protocol):
    """What the check reads of a parameter group (``FSDPParamGroup``)."""

    @property
    def fqn(self) -> str: ...

    @property
    def modules(self) -> tuple[nn.Module, ...]: ...

    @property
    def params(self) -> Sequence[_Param]: ...


def check_policy(policy: ReducePrecision | None, group: _Group, *, custom: str | None) -> None:
    """Raise if ``policy`` cannot apply to ``group`` (every rank raises the same, before a step).

    Args:
        policy: the policy being set (None: torch's behaviour, always fine).
        group: the group it would apply to, named in the message.
        custom: the setter of a user collective set on the group (``set_custom_reduce_scatter``,
            ``set_custom_all_reduce``), or None.
    """
    if policy is None:
        return
    where = f"FSDP module {group.fqn or type(group.modules[0]).__name__}"
    if not isinstance(policy, ReducePrecision):
        raise TypeError(f"{where}: set_reduce_precision takes a ReducePrecision or None")
    if not policy.compresses:
        return
    if custom is not None:
        what = custom.removeprefix("set_custom_").replace("_", "-")
        raise ValueError(
            f"{where}: set_reduce_precision({policy.wire_dtype}) cannot apply: the group has a "
            f"custom {what} ({custom}), which reduces as it likes; set one or the other"
        )
    for param in group.params:
        if not param.orig_dtype.is_floating_point:
            raise TypeError(
                f"{where}: set_reduce_precision({policy.wire_dtype}) cannot apply to parameter "
                f"{param.fqn} of dtype {param.orig_dtype}: only floating-point gradients are "
                "compressed"
            )


@dataclass(slots=True)
class _Check:
    """A numerics check in flight: the exact reduction of the same rows."""

    exact: torch.Tensor  # (S,) float32
    handle: CollectiveHandle  # the exact reduce-scatter's


@dataclass(slots=True)
class WireSum:
    """A compressed reduce-scatter in flight; ``wait()`` sums the rows into the output."""

    handle: GatheredRows
    own: torch.Tensor  # (S,) float32: this rank's own row, exact
    output: torch.Tensor  # (S,) in the reduce dtype
    sent: torch.Tensor  # (W, B) uint8: the encoded rows, alive until they are sent
    reducer: WireReducer
    comm: CommContext
    group: dist.ProcessGroup
    op: Reduction
    check: _Check | None = None

    def wait(self) -> None:
        """Decode the received rows and add them, with this rank's own, in rank order."""
        blocks = self.handle.wait()
        world, rank = self.group.size(), self.group.rank()
        total = torch.zeros_like(self.own)
        # A block at a time (at most three on gloo, one elsewhere): the kernels a reduction
        # launches do not grow with the world size.
        for block in blocks:
            count = block.rows.shape[0]
            if block.first == rank and count == 1:
                total.add_(self.own)  # this rank's own row, never encoded for itself
                continue
            decoded = self.reducer.wire.decode(block.rows, self.own.numel())  # (k, S)
            if block.first <= rank < block.first + count:
                decoded[rank - block.first] = self.own  # one all-to-all carried it: exact
            total.add_(decoded.sum(dim=0))
        self.handle.release()
        self.comm.pool.put(self.sent)
        self.op.finish_sum(total, world)
        if self.check is not None:
            self.reducer.verdict(total, self.check, self.group, self.comm)
        self.output.copy_(total)


class WireReducer:
    """One group's compressed reductions: its format, its rounding noise, its residuals."""

    def __init__(self, policy: ReducePrecision) -> None:
        """Reduce as ``policy`` says (it compresses: a wire dtype is set)."""
        assert isinstance(policy.wire_dtype, torch.dtype)
        self.policy = policy
        self.wire = WireFormat(policy.wire_dtype, policy.block_size, policy.stochastic_rounding)
        self.label = ""
        self.reductions = 0
        self._generator: torch.Generator | None = None
        self._residual: tuple[tuple[int, ...], torch.Tensor] | None = None

    @property
    def algorithm(self) -> str:
        """How observers see its reduce-scatters."""
        name = str(self.wire.dtype).removeprefix("torch.")
        return f"exchange+fp32 sum ({name} wire)"

    def _noise(self, device: torch.device, rank: int) -> torch.Generator | None:
        """The stochastic rounding's generator: seeded by the policy, the rank and the group."""
        if not self.wire.stochastic:
            return None
        if self._generator is None:
            generator = torch.Generator(device=device)
            salt = zlib.crc32(self.label.encode())
            generator.manual_seed((self.policy.seed * 1_000_003 + rank * 7_919 + salt) % 2**63)
            self._generator = generator
        return self._generator

    def reduce_scatter(
        self,
        rows: torch.Tensor,
        output: torch.Tensor,
        group: dist.ProcessGroup,
        comm: CommContext,
        *,
        key: tuple[int, ...] | None,
        op: Reduction,
    ) -> WireSum:
        """Start reducing ``rows`` (W, S) into ``output`` (S,) on this rank.

        ``key`` names the parameters the rows hold: error feedback restarts when it changes.
        None: a stage without feedback or checks (the all-reduce across replicas).
        """
        world, rank = rows.shape[0], group.rank()
        numel = rows.shape[1]
        due = False
        if key is not None:
            self.reductions += 1
            every = self.policy.check_every
            due = every > 0 and self.reductions % every == 0
        exact = rows.float()  # (W, S); a view when the rows are float32 already
        sent = exact if key is None else self._with_residual(exact, key)
        wire_bytes = self.wire.row_bytes(numel)
        encoded = comm.pool.get(world * wire_bytes, rows.device).view(world, wire_bytes)
        decoded = self.wire.encode(sent, encoded, self._noise(rows.device, global_rank()))
        if self.policy.error_feedback and key is not None:
            residual = sent - decoded
            residual[rank].zero_()  # this rank's own row is never encoded for itself
            self._residual = (key, residual)
        own = sent[rank].clone()
        check = None
        if due:
            # Issued before the exchange, and waited for in ``wait``: every rank in one order.
            exact_out = torch.empty(numel, dtype=torch.float32, device=rows.device)
            exact_handle = comm.runtime.reduce_scatter(
                exact_out, exact, group, label=self.label, op=op
            )
            check = _Check(exact_out, exact_handle)
        handle = comm.runtime.exchange_rows(
            encoded, group, label=self.label, algorithm=self.algorithm
        )
        return WireSum(handle, own, output, encoded, self, comm, group, op, check)

    def all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, comm: CommContext, *, op: Reduction
    ) -> None:
        """Reduce ``tensor`` (S,) over ``group`` in place: HSDP's replicas, compressed.

        A compressed reduce-scatter over the replicas, each summing its 1/R in float32, then an
        all-gather of the encoded sums. Every replica then holds the same values: its own
        sum is read back from its encoding too, as the others read it.
        """
        size = group.size()
        numel = tensor.numel()
        chunk = math.ceil(numel / size)
        padded = tensor.new_zeros(size * chunk, dtype=torch.float32)  # (R * C,)
        padded[:numel] = tensor
        mine = torch.empty(chunk, dtype=torch.float32, device=tensor.device)
        self.reduce_scatter(padded.view(size, chunk), mine, group, comm, key=None, op=op).wait()
        wire_bytes = self.wire.row_bytes(chunk)
        encoded = comm.pool.get(wire_bytes, tensor.device)
        self.wire.encode(
            mine.view(1, chunk),
            encoded.view(1, wire_bytes),
            self._noise(tensor.device, global_rank()),
        )
        gathered = comm.runtime.all_gather(encoded, group, label=self.label)
        rows = padded.view(size, chunk)
        for block in gathered.wait():
            rows[block.first : block.first + block.rows.shape[0]] = self.wire.decode(
                block.rows, chunk
            )
        gathered.release()
        comm.pool.put(encoded)
        tensor.copy_(padded[:numel])

    def _with_residual(self, exact: torch.Tensor, key: tuple[int, ...]) -> torch.Tensor:
        """The rows to send: the exact ones plus what the last encoding of them dropped."""
        held = self._residual
        # The rows are only read from here on (encoded, and the residual computed anew): no
        # copy is needed when there is nothing to add.
        if not self.policy.error_feedback or held is None or held[0] != key:
            return exact
        return exact + held[1]

    def verdict(
        self,
        total: torch.Tensor,
        check: _Check,
        group: dist.ProcessGroup,
        comm: CommContext,
    ) -> None:
        """Compare the compressed sum with the exact one over every rank's shard, and act."""
        check.handle.wait()
        norms = torch.stack(
            [(total - check.exact).float().pow(2).sum(), check.exact.float().pow(2).sum()]
        ).double()
        comm.runtime.all_reduce(norms, group, label=self.label).wait()
        error, reference = norms.tolist()
        relative = math.sqrt(error / reference) if reference > 0 else math.sqrt(error)
        if relative <= self.policy.check_tolerance:
            logger.debug("%s: compressed reduction's relative error %.3g", self.label, relative)
            return
        message = (
            f"FSDP module {self.label or '<root>'}: the {self.wire.dtype} reduction's relative "
            f"error is {relative:.3g}, past ReducePrecision.check_tolerance="
            f"{self.policy.check_tolerance:g} (reduction {self.reductions})"
        )
        if self.policy.check_action == "raise":
            raise NumericsCheckError(message)
        logger.warning(message)
