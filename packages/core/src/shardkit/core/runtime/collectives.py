"""The collective runtime: the step's collectives, issued on ``torch.distributed``.

Collectives are issued asynchronously and return handles; ``wait()`` comes right before the
output is used. On gloo, a reduce-scatter is carried out as an exchange of rows plus a local sum,
because gloo's own reduce-scatter sends twice the minimum bytes (it runs as an all-reduce).
Whole objects moved between steps (state dicts, agreements) go through
``p2p/object_collectives.py``. gloo's exchanges (and the fingerprints of the desync checks)
post their messages through ``p2p/row_exchange.py``, with tags from ``p2p/p2p_tags.py``.

Next to split off: the desync checks' fingerprint exchange (``_send_fingerprint``, ``_ToHost``)
into ``watch/fingerprints.py``, beside ``desync``: ``_begin`` is its one caller, and it needs
only ``desync``, the row exchange and ``all_gather_single``, none of the runtime's state.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.core.runtime.custom import custom_all_gather_rows, custom_reduce_scatter
from shardkit.core.runtime.flat_collectives import all_gather_single, reduce_scatter_single
from shardkit.core.runtime.handles import DoneHandle, GatherHandle, SumRowsHandle, WorkHandle
from shardkit.core.runtime.p2p import p2p_tags
from shardkit.core.runtime.p2p.row_exchange import post_row_exchange
from shardkit.core.runtime.pool import BufferPool
from shardkit.core.runtime.protocol import CustomComm, RowBlock
from shardkit.core.runtime.reduction import SUM, Reduction
from shardkit.core.runtime.watch import comm_debug, desync, lifetimes, step_check
from shardkit.core.runtime.watch.announce import announce, announce_issued
from shardkit.core.runtime.watch.hang import ensure_watching
from shardkit.core.runtime.watch.progress import (
    FINGERPRINT_BYTES,
    PROGRESS,
    SETTINGS,
    CollectiveInfo,
)

__all__ = [
    "DoneHandle",
    "GatherHandle",
    "ProcessGroupRuntime",
    "WorkHandle",
    "gathers_by_exchange",
]


@dataclass(frozen=True, slots=True)
class _Issued:
    """A collective about to be issued, as :meth:`ProcessGroupRuntime._begin` recorded it."""

    info: CollectiveInfo
    tag: int
    """The tag of its point-to-point messages (exchanges only)."""
    check: desync.PendingCheck | None = None
    """Its fingerprint exchange, compared at its wait (desync checks on an exchange)."""

    def issued_as(self, works: list[dist.Work]) -> None:
        """Tell the check the collective's own messages, kept alive if an error abandons it."""
        if self.check is not None:
            self.check.data = list(works)


def _uses_gloo(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO


def gathers_by_exchange(group: dist.ProcessGroup) -> bool:
    """Whether the all-gather on ``group`` receives W-1 rows rather than W.

    On gloo it is a direct exchange (this rank's own row stays in place); elsewhere a native
    all-gather. That decides the size of the receive buffer it borrows from the pool.
    """
    return _uses_gloo(group)


class ProcessGroupRuntime:
    """Collectives on c10d process groups (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, pool: BufferPool | None = None) -> None:
        self.pool = pool if pool is not None else BufferPool()
        # Collectives issued per process group: the sequence number of each fingerprint.
        self._issued: weakref.WeakKeyDictionary[dist.ProcessGroup, int]
        self._issued = weakref.WeakKeyDictionary()
        # Steps are counted from this runtime's creation (a root's first forward), so that
        # ranks agree on them even in a process that trained other models before.
        self._steps_before = PROGRESS.steps_taken

    def _begin(
        self,
        kind: str,
        group: dist.ProcessGroup,
        label: str,
        data: torch.Tensor,
        tag: int | None = None,
    ) -> _Issued:
        """Record the collective about to be issued, and with desync checks send its fingerprint.

        ``tag``: the fixed tag of its point-to-point messages, for an exchange; None for any
        other collective, which with desync checks waits here until the fingerprints have
        been compared. See [Note: desync checks].
        """
        seq = self._issued.get(group, 0) + 1
        self._issued[group] = seq
        nbytes = data.numel() * data.element_size()
        dtype = str(data.dtype).removeprefix("torch.")
        step = PROGRESS.steps_taken - self._steps_before + 1
        info = CollectiveInfo(seq, kind, label, nbytes, dtype, PROGRESS.phase, step)
        PROGRESS.issued(info)
        step_check.record(group, info)
        ensure_watching()
        if not SETTINGS.desync_checks or group.size() == 1:
            return _Issued(info, tag or 0)
        encoded = info.encode()
        check = _send_fingerprint(info, encoded, group, data.device)
        if tag is None:
            check.settle()
            return _Issued(info, 0)
        return _Issued(info, desync.data_tag(encoded, group), check)

    def gather_buffer(
        self, nbytes: int, group: dist.ProcessGroup, device: torch.device
    ) -> torch.Tensor | None:
        """The receive buffer (W x ``nbytes`` uint8, pooled) of an all-gather to come.

        The caller writes its input into this rank's row of it, then passes it as ``into``:
        torch's in-place all-gather: the input needs no buffer of its own, which saves 1/W of a
        group's bytes per all-gather in flight. None where the gather would not take one:
        gloo's exchange (the input is sent from where it is), a group of one rank.
        """
        size = group.size()
        if size == 1 or _uses_gloo(group):
            return None
        return self.pool.get(size * nbytes, device)

    def all_gather(
        self,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        label: str = "",
        custom: CustomComm | None = None,
        into: torch.Tensor | None = None,
    ) -> GatherHandle:
        """Gather every rank's ``input`` (N uint8 bytes), asynchronously.

        A group of one rank has nothing to gather: its one row is ``input``, and no collective
        is issued or announced (as for a reduction over one rank). ``into``: the buffer from
        :meth:`gather_buffer`, whose row of this rank ``input`` is.
        """
        if custom is None and group.size() == 1:
            return GatherHandle([], [RowBlock(0, input.view(1, -1))], None, self.pool)
        exchange = custom is None and _uses_gloo(group)
        tag = p2p_tags.GATHER_EXCHANGE.tag() if exchange else None
        issued = self._begin("all_gather", group, label, input, tag)
        if custom is not None:
            announce("all_gather", group.size(), input.numel(), "custom", label)
            rows, work = custom_all_gather_rows(custom, input, group)
            works = [w for w in (work,) if w is not None]
            handle = GatherHandle(works, [RowBlock(0, rows)], None, self.pool)
        else:
            handle = self._all_gather(input, group, label, issued.tag, into)
        if exchange:
            comm_debug.count_all_gather(input, group)
        handle.info, handle.check = issued.info, issued.check
        issued.issued_as(handle.works)
        if SETTINGS.lifetime_checks:
            # The receive buffer; a custom gather's own output where it has none.
            written = [handle.buffer] if handle.buffer is not None else [handle.blocks[0].rows]
            handle.flight = lifetimes.track(issued.info, group, reads=[input], writes=written)
        announce_issued("all_gather")
        return handle

    def _all_gather(
        self,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        label: str,
        tag: int,
        into: torch.Tensor | None,
    ) -> GatherHandle:
        """See :meth:`all_gather`.

        On gloo this is a direct exchange with each peer: the same bytes as a ring all-gather,
        about twice as fast there, and this rank's own row is never copied (it stays
        ``input``), so only W-1 rows need a buffer.
        """
        size, rank = group.size(), group.rank()
        nbytes = input.numel()
        announce("all_gather", size, nbytes, "exchange" if _uses_gloo(group) else "native", label)
        if not _uses_gloo(group):
            buffer = self.pool.get(size * nbytes, input.device) if into is None else into
            if into is not None and input.data_ptr() != into.data_ptr() + rank * nbytes:
                raise ValueError("an in-place all-gather's input must be its own row of `into`")
            work = all_gather_single(buffer, input, group=group, async_op=True)
            native = [RowBlock(0, buffer.view(size, nbytes))]
            return GatherHandle([w for w in (work,) if w is not None], native, buffer, self.pool)
        buffer = self.pool.get((size - 1) * nbytes, input.device)
        received = buffer.view(size - 1, nbytes)  # (W-1, N): the peers' rows, in rank order
        works = post_row_exchange(group, tag, send=input, receive_into=received)
        blocks = [
            RowBlock(0, received[:rank]),
            RowBlock(rank, input.view(1, nbytes)),
            RowBlock(rank + 1, received[rank:]),
        ]
        return GatherHandle(works, [b for b in blocks if b.rows.shape[0]], buffer, self.pool)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        label: str = "",
        custom: CustomComm | None = None,
        op: Reduction = SUM,
    ) -> WorkHandle | DoneHandle | SumRowsHandle:
        """Reduce row r of ``input`` (W, S) over the group into ``output`` (S) on rank r."""
        handle: WorkHandle | DoneHandle | SumRowsHandle
        exchange = custom is None and group.size() > 1 and _uses_gloo(group)
        tag = p2p_tags.REDUCE_EXCHANGE.tag() if exchange else None
        issued = self._begin("reduce_scatter", group, label, input, tag)
        if custom is not None:
            row_bytes = output.numel() * output.element_size()
            announce("reduce_scatter", group.size(), row_bytes * group.size(), "custom", label)
            work = custom_reduce_scatter(custom, output, input, group, op.torch_op())
            handle = WorkHandle(work, issued.info)
        else:
            handle = self._reduce_scatter(output, input, group, label, issued.tag, op)
            if exchange:
                comm_debug.count_reduce_scatter(output, input, group, op)
            if isinstance(handle, SumRowsHandle):
                handle.info, handle.check = issued.info, issued.check
                issued.issued_as(handle.works)
            elif isinstance(handle, WorkHandle):
                handle.info = issued.info
        if SETTINGS.lifetime_checks and not isinstance(handle, DoneHandle):
            # The exchange receives into ``received`` (the output itself at W=2, else scratch).
            written = handle.received if isinstance(handle, SumRowsHandle) else output
            handle.flight = lifetimes.track(issued.info, group, reads=[input], writes=[written])
        announce_issued("reduce_scatter")
        return handle

    def _reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        label: str,
        tag: int,
        op: Reduction,
    ) -> WorkHandle | DoneHandle | SumRowsHandle:
        size = group.size()
        gloo = size > 1 and _uses_gloo(group)
        row_bytes = output.numel() * output.element_size()
        announce(
            "reduce_scatter", size, row_bytes * size, "exchange+sum" if gloo else "native", label
        )
        if size == 1:
            output.copy_(input[0])
            op.finish_sum(output, 1)
            return DoneHandle()
        if gloo:
            return self._reduce_scatter_by_exchange(output, input, group, tag, op)
        return WorkHandle(
            reduce_scatter_single(
                output, input.view(-1), op=op.torch_op(), group=group, async_op=True
            )
        )

    def _reduce_scatter_by_exchange(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        tag: int,
        op: Reduction,
    ) -> SumRowsHandle:
        # Row j of ``input`` goes to rank j and rank j's row for us comes back: the bytes of an
        # all-to-all, but a rank's own row stays put, so only W-1 rows are received. At W=2
        # the one received row lands in ``output`` directly: no scratch buffer at all.
        size, rank = group.size(), group.rank()
        row = input.size(1)
        scratch: torch.Tensor | None = None
        if size == 2:
            received = output.view(1, row)
        else:
            scratch = self.pool.get((size - 1) * row * input.element_size(), input.device)
            received = scratch.view(input.dtype).view(size - 1, row)
        works = post_row_exchange(group, tag, send=input, receive_into=received, row_per_peer=True)
        # gloo's own mean is this sum divided by W, bit for bit; its lack of a scaled sum is
        # made up the same way (divided after the sum, where NCCL scales each input).
        return SumRowsHandle(works, input[rank], received, output, scratch, self.pool, rank, op)

    def exchange_rows(
        self, rows: torch.Tensor, group: dist.ProcessGroup, *, label: str = "", algorithm: str
    ) -> GatherHandle:
        """Send row j of ``rows`` (W, B uint8) to rank j; ``wait()`` gives each rank's for us.

        The blocks come in rank order; this rank's is its own row, never sent. The transport
        of a compressed reduce-scatter (the engine encodes and sums): point to point on gloo,
        one all-to-all elsewhere (NCCL sends nothing to itself either). Announced as a
        reduce-scatter of B-byte rows, ``algorithm`` naming the format.
        """
        size, rank = group.size(), group.rank()
        exchange = _uses_gloo(group)
        tag = p2p_tags.REDUCE_EXCHANGE.tag() if exchange else None
        issued = self._begin("reduce_scatter", group, label, rows, tag)
        announce("reduce_scatter", size, rows.numel(), algorithm, label)
        nbytes = rows.size(1)
        if not exchange:
            buffer = self.pool.get(size * nbytes, rows.device)
            work = dist.all_to_all_single(buffer, rows.view(-1), group=group, async_op=True)
            works = [w for w in (work,) if w is not None]
            blocks = [RowBlock(0, buffer.view(size, nbytes))]
        else:
            buffer = self.pool.get((size - 1) * nbytes, rows.device)
            received = buffer.view(size - 1, nbytes)  # (W-1, B): the peers' rows, rank order
            works = post_row_exchange(
                group, issued.tag, send=rows, receive_into=received, row_per_peer=True
            )
            blocks = [
                RowBlock(0, received[:rank]),
                RowBlock(rank, rows[rank : rank + 1]),
                RowBlock(rank + 1, received[rank:]),
            ]
            comm_debug.count_all_to_all(rows, group)
        handle = GatherHandle(works, [b for b in blocks if b.rows.shape[0]], buffer, self.pool)
        handle.info, handle.check = issued.info, issued.check
        issued.issued_as(handle.works)
        if SETTINGS.lifetime_checks:
            handle.flight = lifetimes.track(issued.info, group, reads=[rows], writes=[buffer])
        announce_issued("reduce_scatter")
        return handle

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        label: str = "",
        op: Reduction = SUM,
    ) -> WorkHandle | DoneHandle:
        """Reduce ``tensor`` over ``group`` in place, asynchronously."""
        info = self._begin("all_reduce", group, label, tensor).info
        handle = self._all_reduce(tensor, group, label, op)
        if isinstance(handle, WorkHandle):
            handle.info = info
            if SETTINGS.lifetime_checks:
                handle.flight = lifetimes.track(info, group, reads_and_writes=[tensor])
        announce_issued("all_reduce")
        return handle

    def _all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup, label: str, op: Reduction
    ) -> WorkHandle | DoneHandle:
        size = group.size()
        announce("all_reduce", size, tensor.numel() * tensor.element_size(), "ring", label)
        if size == 1:
            op.finish_sum(tensor, 1)
            return DoneHandle()
        return WorkHandle(dist.all_reduce(tensor, op=op.torch_op(), group=group, async_op=True))


def _send_fingerprint(
    info: CollectiveInfo, encoded: bytes, group: dist.ProcessGroup, device: torch.device
) -> desync.PendingCheck:
    """Send this collective's fingerprint to the other members and receive theirs, not waiting.

    On a gloo group: point to point, in issue order and with one tag (per epoch), so the n-th
    fingerprint from a peer is always that of its n-th collective on the group; the messages
    share the collective's own connections (a tag no collective uses). On any other backend:
    an all-gather of the fingerprints on the group itself, on ``device`` (the collective's:
    NCCL takes no CPU tensor), which the caller waits for before it issues the collective.
    """
    size, rank = group.size(), group.rank()
    rows = torch.empty(size, FINGERPRINT_BYTES, dtype=torch.uint8)  # (W, FINGERPRINT_BYTES)
    mine = rows[rank]
    mine.copy_(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
    if not _uses_gloo(group):
        # No gloo twin of the group: its members alone would create it (torch 2.14 on, that
        # advances torch's group counter on them alone, and the world's next group hangs).
        # These collectives are issued only once the fingerprints were compared, so the n-th
        # fingerprint all-gather of every member meets the n-th of the others.
        gathered = torch.empty(size * FINGERPRINT_BYTES, dtype=torch.uint8, device=device)
        work = all_gather_single(gathered, mine.to(device), group=group, async_op=True)
        assert work is not None, "an all-gather with async_op=True returns its work"
        return desync.expect(info, group, rows, [_ToHost(work, gathered, rows)])
    tag = desync.fingerprint_tag(group)
    works = post_row_exchange(group, tag, send=mine, receive_into=rows)
    return desync.expect(info, group, rows, list(works))


@dataclass(frozen=True, slots=True)
class _ToHost:
    """A native all-gather of fingerprints: its wait also brings the rows to the CPU."""

    work: dist.Work
    gathered: torch.Tensor  # (W * FINGERPRINT_BYTES,) uint8, on the collective's device
    rows: torch.Tensor  # (W, FINGERPRINT_BYTES) uint8, on the CPU

    def wait(self) -> object:
        """Block until the fingerprints are here, on the CPU."""
        self.work.wait()
        self.rows.copy_(self.gathered.view_as(self.rows))
        return None
