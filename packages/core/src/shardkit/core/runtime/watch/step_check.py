"""The step check: every rank's collectives since the last check, compared once (on by default).

Collectives pair on a process group in the order its members issue them, whatever they carry:
rank 0's all-gather of one block meets rank 1's all-gather of another block of the same size,
and both go on with the wrong parameters (pytorch#174862). So each rank folds every collective
the runtime issues on a group into a running digest of that group, on the host, as it issues
it (:func:`record`: the fields of :class:`~shardkit.core.runtime.watch.progress.CollectiveInfo`, the
module's name among them, but its step: a process that trains another model on some ranks
only counts optimizer steps the others do not): no byte on the wire and no device work per
collective. Where a
backward ends, or a forward that no backward follows, the engine compares the digests of every
group the collectives used (:func:`verify`): one small all-gather per group, a few dozen bytes.
Equal digests mean that every collective met its own kind on every member; a difference raises
:class:`~shardkit.core.errors.DesyncError` on every member, after a second exchange (only then)
of each member's list, naming the first collective where they differ.

The same exchange carries a bitmap of the caller's (the engine's parameters that this rank
reduced as zeros, never used): the members' bitmaps are combined bit by bit (AND) and the result
returned, so that the engine learns, with no collective of its own, which parameters no rank
used. Groups are verified one after the other, each carrying what the earlier ones combined, so
that over a shard group and then its replicate group the result covers every rank of the mesh.

On the CPU the verdict is known before :func:`verify` returns, so before the optimizer step can
use anything a mismatched collective produced. A native collective on an accelerator is compared
on the host too: the rows come back with one copy, waited for there (the end of backward, where
the host already waits for the reductions). The debug mode's per-collective check
(``runtime/watch/desync.py``) stays, and finds the first difference as it happens. See
[Note: step check].
"""

from __future__ import annotations

import struct
import weakref
import zlib
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from shardkit.core.errors import DesyncError
from shardkit.core.runtime.device import HostCopies
from shardkit.core.runtime.flat_collectives import all_gather_single
from shardkit.core.runtime.p2p.p2p_tags import STEP_CHECK
from shardkit.core.runtime.p2p.row_exchange import post_row_exchange
from shardkit.core.runtime.watch import stuck
from shardkit.core.runtime.watch.desync import check_fingerprints, epoch_of
from shardkit.core.runtime.watch.progress import (
    FINGERPRINT_BYTES,
    PROGRESS,
    SETTINGS,
    CollectiveInfo,
)

__all__ = [
    "HEADER_BYTES",
    "Verdict",
    "forget",
    "pending_groups",
    "record",
    "set_step_checks",
    "step_checks_on",
    "verify",
]

_HEADER = struct.Struct("<IIQ")  # digest, collectives in the window, reserved (zeros)
HEADER_BYTES = _HEADER.size
"""Bytes of a member's header in a check's exchange; one byte per flag follows (the engine's:
one per trainable parameter of the root). The planner predicts the exchange from these."""
_KEPT = 4096
"""Collectives a window keeps to name the first difference; past that only the digest counts
(a forward repeated without backward or check, for example, must not grow without bound)."""


@dataclass(slots=True)
class _Window:
    """One process group's collectives since its last check, on this rank."""

    epoch: int = 0
    """The group's desync errors when it began: a window that an error of the debug mode's
    check interrupted (raised on every member alike) is dropped, not compared."""
    digest: int = 0
    count: int = 0
    infos: list[CollectiveInfo] = field(default_factory=list)


_WINDOWS: weakref.WeakKeyDictionary[dist.ProcessGroup, _Window]
_WINDOWS = weakref.WeakKeyDictionary()  # in order of first use: the same on ranks in step


def set_step_checks(enabled: bool = True) -> None:
    """Compare every rank's collectives once per step (the default; ``SHARDKIT_STEP_CHECK=0``).

    Call it on every rank, between steps. Off, collectives of different modules that happen to
    have the same size pair silently. The cost: see docs/guide/not_spmd.md.
    """
    SETTINGS.step_checks = bool(enabled)
    if not enabled:
        forget()


def step_checks_on() -> bool:
    """Whether the step check runs (``set_step_checks``, ``SHARDKIT_STEP_CHECK``)."""
    return SETTINGS.step_checks


def forget() -> None:
    """Start every window afresh (every rank, at one point: a recovery after an exception)."""
    _WINDOWS.clear()


def record(group: dist.ProcessGroup, info: CollectiveInfo) -> None:
    """Fold the collective ``info`` that this rank issues on ``group`` into its window."""
    if not SETTINGS.step_checks or group.size() == 1:
        return
    window = _WINDOWS.get(group)
    epoch = epoch_of(group)
    if window is None or window.epoch != epoch:
        if dist.get_backend(group) == _THREADED:
            return  # ranks as threads of one process would share these windows: see below
        window = _WINDOWS[group] = _Window(epoch)
    text = f"{info.seq}|{info.kind}|{info.label}|{info.phase}|{info.nbytes}|{info.dtype}"
    window.digest = zlib.crc32(text.encode(), window.digest)
    window.count += 1
    if len(window.infos) < _KEPT:
        window.infos.append(info)


_THREADED = "threaded"
"""torch's multi-threaded test process group (``FSDPTestMultiThread``: its ranks are threads of
one process). Its collectives are not checked: the windows are the process's, so each thread's
check would take the others' groups for its own, and wait on them forever."""


def pending_groups() -> list[dist.ProcessGroup]:
    """The groups with collectives since their last check, in order of first use.

    A group destroyed since (``destroy_process_group``, on every member) is forgotten.
    """
    for group in [g for g in _WINDOWS if not _alive(g)]:
        del _WINDOWS[group]
    return [g for g, w in _WINDOWS.items() if w.count and w.epoch == epoch_of(g)]


def _alive(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError):
        return False  # "not initialized in the world group map": destroyed
    return True


@dataclass(slots=True)
class _Checked:
    """One group's exchange of digests: every member's row, and this rank's window."""

    group: dist.ProcessGroup
    window: _Window
    header: bytes
    rows: torch.Tensor  # (W, header + flags) uint8: on the CPU once the verdict is read


@dataclass(slots=True)
class Verdict:
    """The exchanges of one check, compared by :meth:`settle` (at once on the CPU).

    On an accelerator the rows come back to the host with one copy that nobody waits for in
    the step: the engine settles the verdict where the host next waits anyway (the root's next
    forward), unless it needs :meth:`flags` before the optimizer step.
    """

    device: torch.device
    checked: list[_Checked]
    combined: torch.Tensor | None
    """The flags ANDed over every rank (as a minimum of 0/1 bytes); None: no group checked."""
    copies: HostCopies = field(default_factory=HostCopies)
    settled: bool = False

    def flags(self) -> bytes | None:
        """The flags ANDed over every rank of the groups checked (None: none was)."""
        if self.combined is None:
            return None
        self.copies.wait()
        return bytes(self.combined.tolist())

    def settle(self) -> None:
        """Compare the digests (every member at the same point of its program).

        Raises:
            DesyncError: as :func:`verify` says.
        """
        if self.settled:
            return
        self.settled = True
        self.copies.wait()
        for checked in self.checked:
            headers = [bytes(r[: _HEADER.size].tolist()) for r in checked.rows]
            if any(h != checked.header for h in headers):
                counts = [_HEADER.unpack(h)[1] for h in headers]
                _name_difference(checked, counts, self.device)


def verify(flags: bytes, device: torch.device) -> Verdict:
    """Exchange every group's window with its members, then start new windows.

    Args:
        flags: this rank's 0/1 bytes (as many on every rank), combined by AND.
        device: where the groups' collectives run (NCCL takes no CPU tensor).

    Returns:
        The verdict, whose :meth:`Verdict.settle` raises DesyncError on every member of a group
        whose members' collectives differ, naming the first collective where they do and what
        each rank ran there.
    """
    combined = torch.frombuffer(bytearray(flags), dtype=torch.uint8) if flags else None
    checked: list[_Checked] = []
    copies = HostCopies()
    for group in pending_groups():
        window = _WINDOWS[group]
        _WINDOWS[group] = _Window(window.epoch)
        header = _HEADER.pack(window.digest, window.count, 0)
        rows = _exchange(group, header, combined, device)
        if rows is None:
            continue  # the fake process group moves nothing: there is nothing to compare
        if rows.size(1) > _HEADER.size:
            combined = rows[:, _HEADER.size :].amin(dim=0)  # AND of 0/1 bytes: one kernel
        checked.append(_Checked(group, window, header, rows))
    for item in checked:
        item.rows = copies.to_host(item.rows, non_blocking=True)
    if combined is not None:
        combined = copies.to_host(combined, non_blocking=True)
    return Verdict(device, checked, combined if checked else None, copies)


def _exchange(
    group: dist.ProcessGroup, header: bytes, flags: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Every member's header and flags (as many on each), as (W, len) uint8.

    Not through the runtime's collectives: the check is no collective of the step's (the
    pool, the events and torch's communication counters never see it), though a wait on it
    shows in a hang report.
    """
    gloo = dist.get_backend(group) == dist.Backend.GLOO
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    mine = head if gloo or device.type == "cpu" else head.to(device)
    if flags is not None:
        mine = torch.cat([mine, flags.to(mine.device)])
    size, rank, length = group.size(), group.rank(), mine.numel()
    rows = torch.empty(size, length, dtype=torch.uint8, device=mine.device)  # (W, len)
    info = CollectiveInfo(0, "all_gather", "step check", length, "uint8", PROGRESS.phase, 0)
    works: list[dist.Work] = []
    PROGRESS.begin_wait(info, works)  # the works, filled below, for the stuck check to break
    try:
        if gloo:
            rows[rank].copy_(mine)
            works += post_row_exchange(group, STEP_CHECK.tag(), send=mine, receive_into=rows)
            for work in works:
                work.wait()
        else:
            all_gather_single(rows.view(-1), mine, group=group)
    except RuntimeError as error:  # the stuck check broke a wait past its bound
        stuck.raise_if_stuck(error)
        raise
    finally:
        PROGRESS.end_wait()
    return None if dist.get_backend(group) == "fake" else rows


def _name_difference(checked: _Checked, counts: list[int], device: torch.device) -> None:
    """Exchange every member's list of collectives and raise at the first that differs."""
    group = checked.group
    longest = min(max(counts), _KEPT)
    mine = bytearray(longest * FINGERPRINT_BYTES)
    for i, info in enumerate(checked.window.infos[:longest]):
        mine[i * FINGERPRINT_BYTES : (i + 1) * FINGERPRINT_BYTES] = info.encode()
    gathered = _exchange(group, bytes(mine), None, device)
    assert gathered is not None, "a fake group never disagrees"
    rows = gathered.cpu()
    ranks = dist.get_process_group_ranks(group)
    kept = [min(c, _KEPT) for c in counts]
    for i in range(longest):
        records = rows[:, i * FINGERPRINT_BYTES : (i + 1) * FINGERPRINT_BYTES]
        infos = [
            CollectiveInfo.decode(bytes(r.tolist())) if i < kept[m] else _NOTHING
            for m, r in enumerate(records)
        ]
        if len({replace(info, step=0) for info in infos}) > 1:
            check_fingerprints(infos, ranks)  # raises at the first difference
    # Equal lists that differ past what was kept, or by the bytes decoding drops.
    raise DesyncError(
        f"ranks {ranks} ran different collectives since the last step check ({counts} "
        "collectives each); every rank must run the same forwards and backwards on a sharded "
        "model, or mark the modules that some ranks skip with set_conditional(True)"
    )


_NOTHING = CollectiveInfo(0, "nothing", "(no further collective)", 0, "", "-", 0)
"""What a member that ran fewer collectives than the others is shown running."""
