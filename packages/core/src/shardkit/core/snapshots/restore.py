"""Restoring from memory snapshots: the newest step every rank holds, agreed before any write.

1. **Survey** (each rank): the snapshots it holds, its own, the replicas of its source's and
   their log entries, each checked up to its data's checksums (``survey``); a
   snapshot that fails a check is refused, by name.
2. **Agree** (one all-gather): every rank gets every rank's survey and computes the same
   choice from it: the newest step for which every rank has a snapshot, its own or one held
   by its peer (own preferred), and no older than ``not_before`` (a newer disk checkpoint
   wins).
3. **Fetch**: a rank whose own copy is missing receives the replica (and the log entries that
   take it to the step) from its holder, point to point (``runtime.p2p.peer_transfer``).
4. **Verify** (one all-gather): each rank checks the bytes it will load (its own slot, or what
   it received) against their checksums and its state's layout. If any rank's check fails,
   that snapshot is refused on every rank and the choice is made again without it.
5. **Load**: only now does any rank write into its state, in place, as DCP loads. A rank with
   log entries replays them (``gradient_log``) and checks the state it reached against its
   step's checksums (one all-gather); a replay that does not reproduce its step is refused
   on every rank, and the choice is made again (the ranks then load an older step over it).

Nothing is written before step 4's agreement, so a refused snapshot leaves the state as it was
on every rank, except a refused replay, after which every rank loads an older step whole (see
[Note: memory snapshots] and [Note: agreed loads]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from shardkit.core.runtime.groups import is_distributed
from shardkit.core.runtime.p2p.agreement import Outcome, everyone, raise_shared
from shardkit.core.runtime.p2p.peer_transfer import Message, transfer
from shardkit.core.snapshots.contents import JSONValue, Layout, leaves_of
from shardkit.core.snapshots.format import (
    REGION_AT,
    Expected,
    Header,
    SnapshotError,
    SnapshotRefusal,
    SnapshotRefused,
    capacity_in,
    data_offset,
    parse_region,
    read_header,
    verify_data,
)
from shardkit.core.snapshots.gradient_log import BASE, GradientLog
from shardkit.core.snapshots.log_replay import check_entry, reached, replay
from shardkit.core.snapshots.slots import SnapshotDirectory, Topology, map_existing
from shardkit.core.snapshots.state_copy import restore_into
from shardkit.core.snapshots.survey import (
    Holding,
    choose,
    evaluate,
    holds_files,
    mapped,
    survey,
)

__all__ = ["Holding", "Restored", "gathered", "restore"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Fetched:
    """What a rank restoring from a replica received: the replica, then its log entries."""

    region: torch.Tensor
    data: torch.Tensor
    links: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class _Checked:
    """The snapshot a rank will load, checked: its header and data, and entries to replay."""

    header: Header
    data: torch.Tensor
    entries: list[tuple[Header, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class Restored:
    """What a restore found and did, the same on every rank."""

    step: int | None  # the step restored; None if no snapshot could be
    from_replicas: tuple[int, ...]  # ranks restored from a peer's replica
    refused: tuple[str, ...]  # every snapshot refused, and why


def restore(
    state: dict[str, Any],
    directory: SnapshotDirectory,
    topology: Topology,
    not_before: int,
    log: GradientLog | None = None,
) -> Restored:
    """Restore ``state`` from the newest snapshot every rank holds (collective).

    ``log``: this rank's gradient log, to replay its replica's log entries with, if it has one.
    """
    # Where no rank holds a file, the state is not even asked for its state_dict(): torch's
    # get_state_dict initializes an optimizer that has no state yet (a step with lr=0 that
    # counts), which a fresh start must not see.
    if not any(o.value for o in gathered(lambda: holds_files(directory, topology))):
        return Restored(None, (), ())
    layout_box: list[Layout] = []

    def surveyed() -> dict[str, Any]:
        layout_box.append(Layout.of(leaves_of(state)))
        return survey(directory, topology, layout_box[0]) | {"replays": log is not None}

    surveys = raise_shared(gathered(surveyed))
    layout = layout_box[0]
    holdings, refused = evaluate(surveys, topology)
    while True:
        plan = choose(holdings, topology.world_size, not_before)
        if plan is None:
            return Restored(None, (), tuple(refused))
        mine = plan[topology.rank]
        received = _fetch(plan, directory, topology)
        checked: list[_Checked] = []
        checking = partial(_verify, mine, received, directory, topology, layout, log)
        outcomes = gathered(lambda: checked.append(checking()))  # noqa: B023 (called at once)
        failures = [(plan[r], o) for r, o in enumerate(outcomes) if o.failed]
        if not failures:
            failures = _load(state, layout, checked[0], log, plan)
        if not failures:
            _discard_others(directory, topology, holdings, mine.step)
            from_replicas = tuple(r for r, h in enumerate(plan) if not h.own)
            return Restored(mine.step, from_replicas, tuple(refused))
        for holding, outcome in failures:
            refused.append(f"{holding.describe()}: {outcome.message}")
            holdings.remove(holding)


def gathered(work: Callable[[], Any]) -> list[Outcome]:
    """Every rank's outcome of ``work`` (this rank's alone without a process group)."""
    if is_distributed():
        return everyone(work)
    try:
        return [Outcome(value=work())]
    except Exception as error:
        return [Outcome(error_type=type(error).__name__, message=str(error))]


def _fetch(
    plan: list[Holding], directory: SnapshotDirectory, topology: Topology
) -> _Fetched | None:
    """Send the replicas (and log entries) this rank holds for the plan; receive this rank's.

    Each file travels as two messages, its header region and its data, in parts 0 and 1 for
    the replica and 2 + 2i and 3 + 2i for its i-th log entry.
    """
    me = topology.rank
    sends: list[Message] = []
    for holding in plan:
        if holding.holder == me and not holding.own:
            owner = holding.owner
            pieces = [
                (directory.replica(owner, holding.slot), holding.region_bytes, holding.data_bytes)
            ]
            pieces += [
                (directory.log(owner, link.slot), link.region_bytes, link.data_bytes)
                for link in holding.chain
            ]
            for part, (path, region_bytes, data_bytes) in enumerate(pieces):
                region, data = _held_bytes(path, region_bytes, data_bytes)
                sends += [Message(region, owner, 2 * part), Message(data, owner, 2 * part + 1)]
    mine = plan[me]
    if mine.own:
        if sends:
            transfer(sends, [])
        return None
    sized = [(mine.region_bytes, mine.data_bytes)]
    sized += [(link.region_bytes, link.data_bytes) for link in mine.chain]
    buffers = [(_empty(r), _empty(d)) for r, d in sized]
    receives = []
    for part, (region, data) in enumerate(buffers):
        receives += [
            Message(region, mine.holder, 2 * part),
            Message(data, mine.holder, 2 * part + 1),
        ]
    transfer(sends, receives)
    return _Fetched(buffers[0][0], buffers[0][1], buffers[1:])


def _empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _held_bytes(
    path: Path, region_bytes: int, data_bytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A held file's header region and data (a replica or a log entry), as surveyed.

    A file gone since then is sent as zeros: the owner's receive still completes, and its
    check refuses the bytes, instead of waiting forever.
    """
    raw = map_existing(path)
    if raw is not None:
        capacity = capacity_in(raw)
        region = raw[REGION_AT : REGION_AT + region_bytes]
        start = data_offset(capacity)
        data = raw[start : start + data_bytes]
        if region.numel() == region_bytes and data.numel() == data_bytes:
            return region, data
    return torch.zeros(region_bytes, dtype=torch.uint8), torch.zeros(data_bytes, dtype=torch.uint8)


def _verify(
    mine: Holding,
    received: _Fetched | None,
    directory: SnapshotDirectory,
    topology: Topology,
    layout: Layout,
    log: GradientLog | None,
) -> _Checked:
    """The snapshot this rank will load, every check passed (else raises)."""
    expected = Expected(topology.run_id, topology.world_size, layout)
    if received is not None:
        header = parse_region(received.region, rank=topology.rank, expected=expected)
        data = received.data
    else:
        raw = mapped(directory.own(mine.slot))
        header = read_header(raw, rank=topology.rank, expected=expected)
        data = _data_of(raw, header)
    base = mine.chain[0].step - 1 if mine.chain else mine.step
    _check_sizes(header, data, base)
    verify_data(header, data)
    entries = []
    logged = Expected(topology.run_id, topology.world_size, None)
    for step, (region, entry_data) in enumerate(received.links if received else [], base + 1):
        entry = parse_region(region, rank=topology.rank, expected=logged)
        _check_sizes(entry, entry_data, step)
        if entry.values.get(BASE) != base or log is None:
            detail = f"its log entry of step {step} follows another step than {base}"
            raise SnapshotRefused(SnapshotRefusal.TORN, detail if log else "no optimizer")
        verify_data(entry, entry_data)
        check_entry(entry, layout, log)
        entries.append((entry, entry_data))
    return _Checked(header, data, entries)


def _check_sizes(header: Header, data: torch.Tensor, step: int) -> None:
    if header.step != step or data.numel() != header.layout.data_bytes:
        detail = f"holds step {header.step} now, the survey found {step}"
        raise SnapshotRefused(SnapshotRefusal.TORN, detail)


def _data_of(raw: torch.Tensor, header: Header) -> torch.Tensor:
    start = data_offset(capacity_in(raw))
    return raw[start : start + header.layout.data_bytes]


def _load(
    state: dict[str, Any],
    layout: Layout,
    checked: _Checked,
    log: GradientLog | None,
    plan: list[Holding],
) -> list[tuple[Holding, Outcome]]:
    """Write the snapshot into ``state`` on every rank; one rank's failure raised on all.

    A rank restoring from a replica and its log replays the log here. A replay that does not
    reproduce its step is refused, not raised: its holding and outcome are returned (on every
    rank), and the ranks choose again, overwriting what they loaded.
    """
    header = checked.header

    def load() -> None:
        restore_into(state, layout, checked.data, header.values)
        if checked.entries and log is not None:
            replay(checked.entries, log)

    refusals = _refusals(gathered(load), header.step, plan)
    if refusals or not any(holding.chain for holding in plan):
        return refusals
        return []
    # Every rank takes its state's state_dict() and loads one again (for some states both are
    # collective): the replaying ranks check what they reached and load its carried tensors
    # and values, the others load what they loaded before.
    final: list[tuple[torch.Tensor, Mapping[str, JSONValue]]] = [(checked.data, header.values)]

    def check() -> None:
        leaves = leaves_of(state)
        if checked.entries and log is not None:
            final[0] = reached(leaves, layout, checked.entries, len(log.params))

    refusals = _refusals(gathered(check), header.step, plan)
    if not refusals:
        _raise_failures(gathered(lambda: restore_into(state, layout, *final[0])), header.step)
    return refusals


def _refusals(
    outcomes: list[Outcome], step: int, plan: list[Holding]
) -> list[tuple[Holding, Outcome]]:
    """The refused replays among ``outcomes``, with their holdings; any other failure raised."""
    refused = [(plan[r], o) for r, o in enumerate(outcomes) if o.error_type == "SnapshotRefused"]
    _raise_failures(outcomes, step)
    return refused


def _raise_failures(outcomes: list[Outcome], step: int) -> None:
    """The first failure of ``outcomes`` raised on every rank; a refused replay is not one."""
    refused = "SnapshotRefused"
    failed = [(r, o) for r, o in enumerate(outcomes) if o.failed and o.error_type != refused]
    if failed:
        rank, outcome = failed[0]
        raise SnapshotError(
            f"restoring the memory snapshot of step {step} failed on rank {rank} "
            f"part-way, so the state may be partly restored: {outcome.error_type}: "
            f"{outcome.message}"
        )


def _discard_others(
    directory: SnapshotDirectory, topology: Topology, kept: list[Holding], step: int
) -> None:
    """Remove this rank's slot files but those of ``step`` or older that passed every check.

    Snapshots of later steps belong to a future that was abandoned (a rank lacked them), and
    refused ones can only mislead a later restart. Older ones stay: where only some steps are
    replicated, the newest replicated one is what a node lost after this restart goes back to.
    """
    me = topology.rank
    keep = {
        directory.own(h.slot) if h.own else directory.replica(h.owner, h.slot)
        for h in kept
        if h.holder == me and h.step <= step
    }
    chains = [h.chain for h in kept if h.holder == me and h.step <= step]
    keep |= {directory.log(topology.source(me), link.slot) for chain in chains for link in chain}
    files = [path for _, path in directory.own_files()]
    if topology.replicated:
        files += directory.held_files(topology.source(me))
    for path in files:
        if path not in keep:
            path.unlink(missing_ok=True)
