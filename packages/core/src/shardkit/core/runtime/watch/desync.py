"""Desync checks: every rank's fingerprint of each collective, compared before its data is used.

With ``SHARDKIT_DEBUG=1`` (or ``set_debug(True)``) the runtime sends the fingerprint of each
collective (:class:`~shardkit.core.runtime.watch.progress.CollectiveInfo`) to the other members of
its group when it issues it, and compares what they sent before the collective's result is
used. Ranks that run different code (one more micro-batch on one rank, a module skipped on
another) are caught at the first collective where they differ, before the mismatched data
reaches a gradient or the optimizer, and every rank raises the same
:class:`~shardkit.core.errors.DesyncError`.

A collective whose messages carry a tag of their own (the gloo exchanges) is issued at once,
its tag derived from its fingerprint (:func:`data_tag`): messages of collectives that differ
never pair, so they can neither mix data nor abort on a size mismatch, and the comparison
waits until the collective's own wait. Any other collective (a native one, a custom one) is
issued only once the fingerprints were compared. See [Note: desync checks].
"""

from __future__ import annotations

import weakref
import zlib
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.distributed as dist

from shardkit.core.errors import DesyncError
from shardkit.core.runtime.p2p.p2p_tags import DATA_BY_FINGERPRINT, FINGERPRINTS
from shardkit.core.runtime.watch import stuck
from shardkit.core.runtime.watch.progress import FINGERPRINT_BYTES, PROGRESS, CollectiveInfo

__all__ = [
    "PendingCheck",
    "Waitable",
    "check_fingerprints",
    "data_tag",
    "epoch_of",
    "expect",
    "fingerprint_tag",
]


class Waitable(Protocol):
    """A c10d ``Work``, as far as a check needs it."""

    def wait(self) -> object:
        """Block until done."""
        ...


@dataclass(slots=True)
class _GroupChecks:
    """The checks of one process group: its epoch and its exchanges not yet compared."""

    epoch: int = 0
    """Desync errors raised on this group so far: every member raises each, so they agree. It
    is part of every tag, so that messages left unmatched by an error never pair with later
    ones."""
    pending: deque[PendingCheck] = field(default_factory=deque)
    """Exchanges in issue order, oldest first."""
    retired: list[Waitable] = field(default_factory=list)
    """The messages of collectives an error left behind, kept for the group's lifetime: gloo
    stalls every later message from a peer once a receive freed before its message came
    gets one (a peer in step with this rank can still send it, at W > 2)."""


_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, _GroupChecks]
_GROUPS = weakref.WeakKeyDictionary()


def _checks(group: dist.ProcessGroup) -> _GroupChecks:
    checks = _GROUPS.get(group)
    if checks is None:
        checks = _GROUPS[group] = _GroupChecks()
    return checks


def epoch_of(group: dist.ProcessGroup) -> int:
    """Desync errors raised on ``group`` so far (every member counts the same)."""
    checks = _GROUPS.get(group)
    return 0 if checks is None else checks.epoch


def fingerprint_tag(group: dist.ProcessGroup) -> int:
    """The tag of ``group``'s fingerprint messages (on its gloo twin), in its current epoch."""
    return FINGERPRINTS.tag(_checks(group).epoch)


def data_tag(encoded: bytes, group: dist.ProcessGroup) -> int:
    """The tag of a collective's own messages on ``group``, from its encoded fingerprint.

    Members in step compute the same tag; members about to run different collectives compute
    different ones (but for a hash collision, about one chance in 10^9), so their messages
    stay unmatched instead of pairing. A gloo receive paired with a longer message aborts the
    process, and one paired with a message of the same size mixes data silently.
    """
    digest = zlib.crc32(_checks(group).epoch.to_bytes(8, "little"), zlib.crc32(encoded))
    return DATA_BY_FINGERPRINT.tag(digest % DATA_BY_FINGERPRINT.count)


@dataclass(slots=True, eq=False)
class PendingCheck:
    """One collective's fingerprint exchange, in flight until :meth:`settle`."""

    info: CollectiveInfo
    group: dist.ProcessGroup
    rows: torch.Tensor  # (W, FINGERPRINT_BYTES) uint8: every member's fingerprint, group order
    works: list[Waitable]  # this rank's sends and receives of fingerprints
    data: list[Waitable] = field(default_factory=list)
    """The collective's own messages (its handle's works), set once it is issued."""
    done: bool = False
    error: str | None = None
    """Why this collective must never be waited on: the desync error that failed or abandoned
    it (every member raised that error)."""

    def settle(self) -> None:
        """Compare the members' fingerprints of this collective (and of earlier ones pending).

        The group's exchanges not compared yet are compared in issue order, up to this one.

        Raises:
            DesyncError: on every member, naming what each was about to run; again on every
                later wait of this collective or of one issued after it before the error
                (their peers' messages may never come: a wait would hang).
        """
        if self.error is not None:
            raise DesyncError(self.error)
        if self.done:
            return
        queue = _checks(self.group).pending
        while queue:
            check = queue.popleft()
            check._compare()
            if check is self:
                return
        raise AssertionError(f"{self.info.detail()}: its fingerprint exchange was never queued")

    def _compare(self) -> None:
        PROGRESS.begin_wait(self.info, self.works)
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as error:  # the stuck check broke a wait past its bound
            stuck.raise_if_stuck(error)
            raise
        finally:
            PROGRESS.end_wait()
        self.done = True
        blob = self.rows.numpy().tobytes()
        first = blob[:FINGERPRINT_BYTES]
        if blob == first * self.rows.size(0):
            return
        infos = [CollectiveInfo.decode(row.numpy().tobytes()) for row in self.rows]
        ranks = dist.get_process_group_ranks(self.group)
        try:
            check_fingerprints(infos, ranks)
            # Records that differ only where decoding drops bytes (a label cut mid-character):
            # their collectives' tags differ too, so they would never meet.
            raise DesyncError(
                f"ranks {ranks} are out of step: {self.info.detail()} differs in bytes"
            )
        except DesyncError as error:
            self._fail(str(error))
            raise

    def _fail(self, message: str) -> None:
        """Abandon this collective and every later one of the group issued before the error."""
        checks = _checks(self.group)
        checks.epoch += 1
        abandoned = [self, *checks.pending]
        checks.pending.clear()
        for check in abandoned:
            check.error = message  # a later wait raises instead of waiting for messages
            checks.retired += check.works + check.data  # never freed before they complete


def expect(
    info: CollectiveInfo, group: dist.ProcessGroup, rows: torch.Tensor, works: list[Waitable]
) -> PendingCheck:
    """Queue the exchange of ``info``'s fingerprint (``works`` fill ``rows``) for comparison."""
    check = PendingCheck(info, group, rows, works)
    _checks(group).pending.append(check)
    return check


def check_fingerprints(infos: list[CollectiveInfo], ranks: list[int]) -> None:
    """Raise if the group's ranks (global ``ranks``) are not about to run the same collective.

    ``infos`` holds each member's fingerprint in group order; every member calls this with
    the same list, so every member raises the same error.

    Raises:
        DesyncError: the fingerprints differ; the message names what each rank runs.
    """
    if all(info == infos[0] for info in infos):
        return
    by_info: dict[CollectiveInfo, list[int]] = {}
    for rank, info in zip(ranks, infos, strict=True):
        by_info.setdefault(info, []).append(rank)
    sides = "; ".join(
        f"{stuck.ranks_label(members)}: {info.detail()}" for info, members in by_info.items()
    )
    if len({replace(info, nbytes=0, dtype="") for info in infos}) == 1:
        # In step, yet one collective carries other bytes: the ranks built different groups.
        raise DesyncError(
            f"ranks {ranks} disagree on what one collective carries: {sides}. The ranks are in "
            f"step, but the parameters of {infos[0].label or '<root>'} differ between them "
            "(their shapes or dtypes): every rank must build the same model and shard it with "
            "the same policy; a model or a MixedPrecisionPolicy.param_dtype_override_fn whose "
            "answer depends on the rank does this"
        )
    raise DesyncError(
        f"ranks {ranks} are out of step: {sides}. Every rank must run the same forwards and "
        "backwards on a sharded model (the same micro-batches, the same modules, an optimizer "
        "step at the same time); the first difference is shown. Modules that some ranks skip "
        "or run in another order: mark them with set_conditional(True); ranks with fewer "
        "batches: train under torch's Join([model], optimizer=...)"
    )
