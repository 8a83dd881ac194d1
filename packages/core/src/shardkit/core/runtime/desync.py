"""Desync checks: every rank's fingerprint of its next collective, compared before it runs.

With ``SHARDKIT_DEBUG=1`` (or ``set_debug(True)``) the runtime exchanges the fingerprint of
each collective (:class:`~shardkit.core.runtime.progress.CollectiveInfo`) within its group
before issuing it. Ranks that run different code (one more micro-batch on one rank, a
module skipped on another) are caught at the first collective where they differ, before
the mismatched data reaches a gradient or the optimizer, and every rank raises the same
:class:`~shardkit.core.errors.DesyncError`. See [Note: desync checks].
"""

from __future__ import annotations

from shardkit.core.errors import DesyncError
from shardkit.core.runtime.progress import CollectiveInfo

__all__ = ["check_fingerprints"]


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
    sides = "; ".join(f"{_ranks(members)}: {info.detail()}" for info, members in by_info.items())
    raise DesyncError(
        f"ranks {ranks} are out of step: {sides}. Every rank must run the same forwards and "
        "backwards on a sharded model (the same micro-batches, the same modules, an optimizer "
        "step at the same time); the first difference is shown"
    )


def _ranks(members: list[int]) -> str:
    if len(members) == 1:
        return f"rank {members[0]}"
    return "ranks " + ", ".join(str(m) for m in members)
