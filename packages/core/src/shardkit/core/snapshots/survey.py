"""Surveying memory snapshots: what each rank holds, checked, and the step every rank can have.

Each rank reads the snapshots it holds (its own slots, the replicas of its source's, and the
log entries that follow them: ``gradient_log``), each checked up to its data's checksums
(``format.read_header``); one that fails a check is refused, by name. From every
rank's survey (gathered by ``restore``), every rank computes the same holdings and the
same choice: the newest step for which every rank has a snapshot, its own or one its peer holds
(own preferred, then a replica, then a replica and the fewest log entries after it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardkit.core.snapshots.contents import Layout
from shardkit.core.snapshots.format import (
    Expected,
    Header,
    SnapshotRefusal,
    SnapshotRefused,
    capacity_in,
    is_blank,
    read_header,
    region_bytes,
    summary,
)
from shardkit.core.snapshots.gradient_log import BASE, UNUSABLE
from shardkit.core.snapshots.slots import SnapshotDirectory, Topology, map_existing

__all__ = ["Holding", "Link", "choose", "evaluate", "holds_files", "mapped", "survey"]


@dataclass(frozen=True, slots=True)
class Holding:
    """A snapshot of ``owner``'s state at ``step``, in ``holder``'s slot."""

    owner: int
    holder: int
    slot: int
    step: int
    region_bytes: int
    data_bytes: int
    chain: tuple[Link, ...] = ()  # a replica's log entries after it, replayed to ``step``

    @property
    def own(self) -> bool:
        """Whether the owner holds it (not a replica)."""
        return self.owner == self.holder

    def describe(self) -> str:
        """Whose snapshot, where, of which step: for refusals."""
        where = "own" if self.own else f"replica held by rank {self.holder},"
        if self.chain:
            base, to = self.chain[0].step - 1, self.step
            return f"rank {self.owner}'s {where} slot {self.slot} (step {base}) and log to {to}"
        return f"rank {self.owner}'s {where} slot {self.slot} (step {self.step})"


@dataclass(frozen=True, slots=True)
class Link:
    """A log entry of a chain (``gradient_log``): its slot, step and sizes."""

    slot: int
    step: int
    region_bytes: int
    data_bytes: int


def holds_files(directory: SnapshotDirectory, topology: Topology) -> bool:
    """Whether this rank holds any snapshot file (its own, or its source's)."""
    held = directory.held_files(topology.source(topology.rank)) if topology.replicated else []
    return bool(held) or any(True for _ in directory.own_files())


def survey(directory: SnapshotDirectory, topology: Topology, layout: Layout) -> dict[str, Any]:
    """This rank's snapshots, the replicas and log entries it holds, checked up to their data.

    JSON, for the other ranks: each file's slot and sizes (and what a holding needs), and every
    refusal by name.
    """
    me, refused = topology.rank, list[str]()
    mine = Expected(topology.run_id, topology.world_size, layout)
    own = _read_all(directory.own_files(), me, mine, f"rank {me}'s own", refused, _sizes)
    replicas, logs = [], []
    if topology.replicated:
        source = topology.source(me)
        theirs = Expected(topology.run_id, topology.world_size, None)
        held = f"rank {source}'s replica held by rank {me},"
        files = directory.replica_files(source)
        replicas = _read_all(files, source, theirs, held, refused, _replica_facts)
        held = f"rank {source}'s log entry held by rank {me},"
        logs = _read_all(directory.log_files(source), source, theirs, held, refused, _log_facts)
    expected = {"fingerprint": layout.fingerprint(), "local_shapes": layout.local_shapes()}
    found = {"own": own, "replicas": replicas, "logs": logs}
    return {"expected": expected, **found, "refused": refused}


def _read_all(
    files: Iterator[tuple[int, Path]],
    rank: int,
    expected: Expected,
    whose: str,
    refused: list[str],
    facts: Callable[[Header, torch.Tensor], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Each file's header read and checked as ``rank``'s, and its ``facts``; refusals named."""
    found = []
    for slot, path in files:
        try:
            raw = mapped(path)
            if is_blank(raw):
                continue
            header = read_header(raw, rank=rank, expected=expected)
            found.append({"slot": slot, **facts(header, raw)})
        except SnapshotRefused as error:
            refused.append(f"{whose} slot {slot}{_at(error)}: {error}")
    return found


def _replica_facts(header: Header, raw: torch.Tensor) -> dict[str, Any]:
    return {**summary(header), **_sizes(header, raw)}


def _log_facts(header: Header, raw: torch.Tensor) -> dict[str, Any]:
    """A log entry's base step and sizes; refused if its writer said it cannot be replayed."""
    base, problem = header.values.get(BASE), header.values.get(UNUSABLE)
    if type(base) is not int or not 0 <= base < header.step:
        detail = "its base step is malformed"
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, detail, header.step)
    if problem:  # its writer knew it could not be replayed, and said why
        raise SnapshotRefused(SnapshotRefusal.UNREPLAYABLE, str(problem), header.step)
    return {"base": base, **_sizes(header, raw)}


def _at(error: SnapshotRefused) -> str:
    return f" (step {error.step})" if error.step is not None else ""


def _sizes(header: Header, raw: torch.Tensor) -> dict[str, Any]:
    return {
        "step": header.step,
        "region_bytes": region_bytes(capacity_in(raw)),
        "data_bytes": header.layout.data_bytes,
    }


def evaluate(surveys: list[Any], topology: Topology) -> tuple[list[Holding], list[str]]:
    """Every snapshot any rank holds that fits its owner, and the refusals (same on all ranks)."""
    holdings: list[Holding] = []
    refused = [reason for survey in surveys for reason in survey["refused"]]
    for rank, survey in enumerate(surveys):
        for own in survey["own"]:
            sizes = own["region_bytes"], own["data_bytes"]
            holdings.append(Holding(rank, rank, own["slot"], own["step"], *sizes))
        if not topology.replicated:
            continue
        owner = topology.source(rank)
        wanted = surveys[owner]["expected"]
        for replica in survey["replicas"]:
            held = Holding(
                owner,
                rank,
                replica["slot"],
                replica["step"],
                replica["region_bytes"],
                replica["data_bytes"],
            )
            if replica["fingerprint"] != wanted["fingerprint"]:
                refused.append(f"{held.describe()}: another model: not rank {owner}'s model now")
            elif replica["local_shapes"] != wanted["local_shapes"]:
                refused.append(f"{held.describe()}: another layout: other local shard shapes")
            else:
                holdings.append(held)
                holdings += _chains(held, survey["logs"], surveys[owner]["replays"])
        if survey["logs"] and not surveys[owner]["replays"]:
            refused.append(
                f"rank {owner}'s log entries held by rank {rank}: rank {owner} has no optimizer "
                "to replay them with (MemorySnapshots(optimizer=...))"
            )
    return holdings, refused


def _chains(held: Holding, logs: list[dict[str, int]], replays: bool) -> list[Holding]:
    """A replica's log entries, one after another: a holding for each step they reach.

    None where the owner has no optimizer to replay them with.
    """
    following = {entry["step"]: entry for entry in logs if entry["base"] == held.step}
    chain: list[Link] = []
    while replays and (entry := following.get(held.step + len(chain) + 1)) is not None:
        sizes = entry["region_bytes"], entry["data_bytes"]
        chain.append(Link(entry["slot"], entry["step"], *sizes))
    return [
        Holding(
            held.owner,
            held.holder,
            held.slot,
            link.step,
            held.region_bytes,
            held.data_bytes,
            tuple(chain[: k + 1]),
        )
        for k, link in enumerate(chain)
    ]


def choose(holdings: list[Holding], world_size: int, not_before: int) -> list[Holding] | None:
    """For the newest step every rank holds, each rank's snapshot (own first); None if none."""
    steps_of = [{h.step for h in holdings if h.owner == rank} for rank in range(world_size)]
    common = set.intersection(*steps_of) if steps_of else set()
    candidates = sorted((s for s in common if s >= not_before), reverse=True)
    if not candidates:
        return None
    step = candidates[0]
    plan = []
    for rank in range(world_size):
        found = [h for h in holdings if h.owner == rank and h.step == step]
        plan.append(min(found, key=lambda h: (not h.own, len(h.chain), h.holder, h.slot)))
    return plan


def mapped(path: Path) -> torch.Tensor:
    """The bytes of the snapshot file at ``path``; refused as unreadable if it is gone."""
    raw = map_existing(path)
    if raw is None:
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, f"{path.name} is gone or empty")
    return raw
