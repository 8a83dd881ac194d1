"""Restoring from memory snapshots: the newest step every rank holds, agreed before any write.

1. **Survey** (each rank): the snapshots it holds, its own and the replicas of its source's,
   each read and checked up to its data's checksums (``snapshot_format.read_header``); a
   snapshot that fails a check is refused, by name.
2. **Agree** (one all-gather): every rank gets every rank's survey and computes the same
   choice from it: the newest step for which every rank has a snapshot, its own or a replica
   held by its peer (own preferred), and no older than ``not_before`` (a newer disk
   checkpoint wins).
3. **Fetch**: a rank whose own copy is missing receives the replica from its holder, point to
   point (``runtime.peer_transfer``); the others send nothing.
4. **Verify** (one all-gather): each rank checks the bytes it will load (its own slot, or what
   it received) against their checksums and its state's layout. If any rank's check fails,
   that snapshot is refused on every rank and the choice is made again without it.
5. **Load**: only now does any rank write into its state, in place, as DCP loads.

Nothing is written before step 4's agreement, so a refused snapshot leaves the state as it was
on every rank (see [Note: memory snapshots] and [Note: agreed loads]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from shardkit.core.checkpoint.snapshot_format import (
    REGION_AT,
    Expected,
    Header,
    SnapshotError,
    SnapshotRefusal,
    SnapshotRefused,
    capacity_in,
    data_offset,
    is_blank,
    parse_region,
    read_header,
    region_bytes,
    summary,
    verify_data,
)
from shardkit.core.checkpoint.snapshot_layout import Layout, leaves_of, restore_into
from shardkit.core.checkpoint.snapshot_slots import SnapshotDirectory, Topology, map_existing
from shardkit.core.runtime.agreement import Outcome, everyone, raise_shared
from shardkit.core.runtime.groups import is_distributed
from shardkit.core.runtime.peer_transfer import Message, transfer

__all__ = ["Holding", "Restored", "gathered", "restore"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Holding:
    """A snapshot of ``owner``'s state at ``step``, in ``holder``'s slot."""

    owner: int
    holder: int
    slot: int
    step: int
    region_bytes: int
    data_bytes: int

    @property
    def own(self) -> bool:
        """Whether the owner holds it (not a replica)."""
        return self.owner == self.holder

    def describe(self) -> str:
        """Whose snapshot, where, of which step: for refusals."""
        where = "own" if self.own else f"replica held by rank {self.holder},"
        return f"rank {self.owner}'s {where} slot {self.slot} (step {self.step})"


@dataclass(frozen=True, slots=True)
class Restored:
    """What a restore found and did, the same on every rank."""

    step: int | None  # the step restored; None if no snapshot could be
    from_replicas: tuple[int, ...]  # ranks restored from a peer's replica
    refused: tuple[str, ...]  # every snapshot refused, and why


def restore(
    state: dict[str, Any], directory: SnapshotDirectory, topology: Topology, not_before: int
) -> Restored:
    """Restore ``state`` from the newest snapshot every rank holds (collective)."""
    # Where no rank holds a file, the state is not even asked for its state_dict(): torch's
    # get_state_dict initializes an optimizer that has no state yet (a step with lr=0 that
    # counts), which a fresh start must not see.
    if not any(o.value for o in gathered(lambda: _holds_files(directory, topology))):
        return Restored(None, (), ())
    layout_box: list[Layout] = []

    def survey() -> dict[str, Any]:
        layout_box.append(Layout.of(leaves_of(state)))
        return _survey(directory, topology, layout_box[0])

    surveys = raise_shared(gathered(survey))
    layout = layout_box[0]
    holdings, refused = _evaluate(surveys, topology)
    while True:
        plan = _choose(holdings, topology.world_size, not_before)
        if plan is None:
            return Restored(None, (), tuple(refused))
        mine = plan[topology.rank]
        received = _fetch(plan, directory, topology)
        headers: list[Header] = []
        checking = partial(_verify, mine, received, directory, topology, layout)
        outcomes = gathered(lambda: headers.append(checking()))  # noqa: B023 (called at once)
        failures = [(plan[r], o) for r, o in enumerate(outcomes) if o.failed]
        if not failures:
            header = headers[0]
            data = received[1] if received is not None else _own_data(directory, mine, header)
            _load(state, layout, data, header)
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


def _holds_files(directory: SnapshotDirectory, topology: Topology) -> bool:
    source = topology.source(topology.rank)
    replicas = directory.replica_files(source) if topology.replicated else iter(())
    return any(True for _ in directory.own_files()) or any(True for _ in replicas)


def _survey(directory: SnapshotDirectory, topology: Topology, layout: Layout) -> dict[str, Any]:
    """This rank's snapshots, and the replicas it holds, checked up to their data (JSON)."""
    mine = Expected(topology.run_id, topology.world_size, layout)
    own, replicas, refused = [], [], []
    for slot, path in directory.own_files():
        try:
            raw = _mapped(path)
            if is_blank(raw):
                continue
            header = read_header(raw, rank=topology.rank, expected=mine)
            own.append({"slot": slot, **_sizes(header, raw)})
        except SnapshotRefused as error:
            refused.append(f"rank {topology.rank}'s own slot {slot}{_at(error)}: {error}")
    source = topology.source(topology.rank)
    theirs = Expected(topology.run_id, topology.world_size, None)
    for slot, path in directory.replica_files(source) if topology.replicated else ():
        try:
            raw = _mapped(path)
            if is_blank(raw):
                continue
            header = read_header(raw, rank=source, expected=theirs)
            replicas.append({"slot": slot, **summary(header), **_sizes(header, raw)})
        except SnapshotRefused as error:
            holder = f"rank {source}'s replica held by rank {topology.rank}"
            refused.append(f"{holder}, slot {slot}{_at(error)}: {error}")
    expected = {"fingerprint": layout.fingerprint(), "local_shapes": layout.local_shapes()}
    return {"expected": expected, "own": own, "replicas": replicas, "refused": refused}


def _at(error: SnapshotRefused) -> str:
    return f" (step {error.step})" if error.step is not None else ""


def _sizes(header: Header, raw: torch.Tensor) -> dict[str, int]:
    return {
        "step": header.step,
        "region_bytes": region_bytes(capacity_in(raw)),
        "data_bytes": header.layout.data_bytes,
    }


def _evaluate(surveys: list[Any], topology: Topology) -> tuple[list[Holding], list[str]]:
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
    return holdings, refused


def _choose(holdings: list[Holding], world_size: int, not_before: int) -> list[Holding] | None:
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
        plan.append(min(found, key=lambda h: (not h.own, h.holder, h.slot)))
    return plan


def _fetch(
    plan: list[Holding], directory: SnapshotDirectory, topology: Topology
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Send the replicas this rank holds for the plan; receive this rank's if it needs one."""
    me = topology.rank
    sends: list[Message] = []
    for holding in plan:
        if holding.holder == me and not holding.own:
            region, data = _replica_bytes(directory, holding)
            sends += [Message(region, holding.owner, 0), Message(data, holding.owner, 1)]
    mine = plan[me]
    received = None
    receives: list[Message] = []
    if not mine.own:
        received = (
            torch.empty(mine.region_bytes, dtype=torch.uint8),
            torch.empty(mine.data_bytes, dtype=torch.uint8),
        )
        receives = [Message(received[0], mine.holder, 0), Message(received[1], mine.holder, 1)]
    if sends or receives:
        transfer(sends, receives)
    return received


def _replica_bytes(
    directory: SnapshotDirectory, holding: Holding
) -> tuple[torch.Tensor, torch.Tensor]:
    """The header region and data of a replica held here, as the survey found them.

    A file gone since then is sent as zeros: the owner's receive still completes, and its
    check refuses the bytes, instead of waiting forever.
    """
    raw = map_existing(directory.replica(holding.owner, holding.slot))
    if raw is not None:
        capacity = capacity_in(raw)
        region = raw[REGION_AT : REGION_AT + holding.region_bytes]
        start = data_offset(capacity)
        data = raw[start : start + holding.data_bytes]
        if region.numel() == holding.region_bytes and data.numel() == holding.data_bytes:
            return region, data
    zeros = torch.zeros(holding.region_bytes, dtype=torch.uint8)
    return zeros, torch.zeros(holding.data_bytes, dtype=torch.uint8)


def _verify(
    mine: Holding,
    received: tuple[torch.Tensor, torch.Tensor] | None,
    directory: SnapshotDirectory,
    topology: Topology,
    layout: Layout,
) -> Header:
    """The header of the snapshot this rank will load, every check passed (else raises)."""
    expected = Expected(topology.run_id, topology.world_size, layout)
    if received is not None:
        header = parse_region(received[0], rank=topology.rank, expected=expected)
        data = received[1]
    else:
        raw = _mapped(directory.own(mine.slot))
        header = read_header(raw, rank=topology.rank, expected=expected)
        data = _data_of(raw, header)
    if header.step != mine.step or data.numel() != header.layout.data_bytes:
        detail = f"holds step {header.step} now, the survey found {mine.step}"
        raise SnapshotRefused(SnapshotRefusal.TORN, detail)
    verify_data(header, data)
    return header


def _own_data(directory: SnapshotDirectory, mine: Holding, header: Header) -> torch.Tensor:
    return _data_of(_mapped(directory.own(mine.slot)), header)


def _data_of(raw: torch.Tensor, header: Header) -> torch.Tensor:
    start = data_offset(capacity_in(raw))
    return raw[start : start + header.layout.data_bytes]


def _mapped(path: Path) -> torch.Tensor:
    raw = map_existing(path)
    if raw is None:
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, f"{path.name} is gone or empty")
    return raw


def _load(state: dict[str, Any], layout: Layout, data: torch.Tensor, header: Header) -> None:
    """Write the snapshot into ``state`` on every rank; one rank's failure raised on all."""

    def load() -> None:
        restore_into(state, layout, data, header.values)

    failed = [(r, o) for r, o in enumerate(gathered(load)) if o.failed]
    if failed:
        rank, outcome = failed[0]
        raise SnapshotError(
            f"restoring the memory snapshot of step {header.step} failed on rank {rank} "
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
    files = [path for _, path in directory.own_files()]
    if topology.replicated:
        files += [path for _, path in directory.replica_files(topology.source(me))]
    for path in files:
        if path not in keep:
            path.unlink(missing_ok=True)
