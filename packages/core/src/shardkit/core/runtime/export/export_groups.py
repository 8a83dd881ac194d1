"""The weight export's own process groups, its collectives, and its bounded waits.

An export runs its collectives on groups of its own, never on the training's: a rank that does
receiver work between two buckets (rank 0 handing a bucket to vLLM) can then never pair an
export gather with a training collective (trl#7103's hang). The groups are made once per
exporter, by every rank of the world in the same order, and dropped after a failed export (a
peer may have left a collective pending on them); the next export makes new ones.

Every wait is bounded. A waiting rank polls its work, and on the way reads a verdict from the
c10d store: the first rank that finds the export failed (its receiver raised, or a peer is
late past the bound) writes the verdict once (``compare_set``), and every rank raises that same
text as :class:`~shardkit.core.errors.WeightExportError`. A peer is late when its beat (where
it is in the export, posted before each collective and each hand-off, with the poster's clock)
has not moved for ``bound_s`` and is not where this rank waits. Ranks that wait at the same
place (a slow transfer) are never accused.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import PrefixStore, _get_default_store

from shardkit.core.errors import WeightExportError
from shardkit.core.runtime.flat_collectives import all_gather_single
from shardkit.core.runtime.p2p.p2p_tags import EXPORT_GATHER
from shardkit.core.runtime.p2p.row_exchange import post_row_exchange
from shardkit.core.runtime.watch.store_board import StoreBoard

__all__ = [
    "DEFAULT_EXPORT_BOUND_S",
    "ExportGroups",
    "ExportWatch",
    "all_gather_vector",
    "export_bound_s",
    "gather_buffer",
    "make_export_groups",
    "on_gloo",
    "post_pieces",
    "vector_device",
]

DEFAULT_EXPORT_BOUND_S = 300.0
_POLL_S = 0.05  # how often a waiting rank reads the store
_DEVICE_POLL_S = 0.0002  # how often a device collective's completion is asked for


def export_bound_s(bound_s: float | None) -> float:
    """The bound: the argument, else ``SHARDKIT_EXPORT_BOUND``, else 300 s."""
    if bound_s is not None:
        return float(bound_s)
    return float(os.environ.get("SHARDKIT_EXPORT_BOUND", DEFAULT_EXPORT_BOUND_S))


@dataclass(slots=True)
class ExportGroups:
    """An exporter's groups: all of the mesh's ranks, and one group per gathered mesh axis."""

    world: dist.ProcessGroup
    """Every rank of the mesh: the per-export agreement and the status at the end."""
    world_ranks: list[int]
    """Its global ranks."""
    axes: dict[int, tuple[dist.ProcessGroup, list[int]] | None] = field(default_factory=dict)
    """Mesh dim -> this rank's group along it (and its global ranks, in mesh order)."""
    dead: bool = False
    """A failed export may have left work pending on these groups: make new ones."""


def make_export_groups(mesh: DeviceMesh, gathered_dims: list[int], bound_s: float) -> ExportGroups:
    """New groups for ``mesh``: every rank of the world calls this, in the same order.

    A mesh over part of the world (pipeline stages, each its own mesh) makes its groups with
    its members alone (``use_local_synchronization``).
    """
    timeout = timedelta(seconds=bound_s + 60.0)
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    whole = ranks == list(range(dist.get_world_size()))

    def new(members: list[int]) -> dist.ProcessGroup | None:
        if whole:
            made = dist.new_group(members, timeout=timeout)
        elif dist.get_rank() in members:
            made = dist.new_group(members, timeout=timeout, use_local_synchronization=True)
        else:
            return None
        return made if isinstance(made, dist.ProcessGroup) else None

    world = new(ranks)
    assert world is not None, "this rank is not on the exported model's mesh"
    groups = ExportGroups(world, ranks)
    me = dist.get_rank()
    for dim in gathered_dims:
        layout = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.shape[dim])
        groups.axes[dim] = None
        for row in layout.tolist():
            members = [int(r) for r in row]
            group = new(members) if whole or me in members else None
            if me in members and group is not None:
                groups.axes[dim] = (group, members)
    return groups


@dataclass(slots=True)
class ExportWatch:
    """One export's beats and verdict in the store, and the bounded wait."""

    board: StoreBoard
    rank: int
    bound_s: float
    export_key: str
    """Unique per exporter and export: the keys of one export never meet another's."""
    where: str = "starting"

    @staticmethod
    def open(exporter: int, export_id: int, rank: int, bound_s: float) -> ExportWatch:
        """The watch of export ``export_id`` of this process's exporter ``exporter``."""
        store = PrefixStore("shardkit/export/", _get_default_store())
        # Not tolerant: a store that fails mid-export fails the export, loudly.
        return ExportWatch(
            StoreBoard(store, tolerant=False), rank, bound_s, f"{exporter}/{export_id}"
        )

    def post(self, where: str) -> None:
        """Say where this rank is (before a collective, before a hand-off)."""
        self.where = where
        self.board.post(f"{self.export_key}/beat/{self.rank}", f"{time.time():.3f} {where}")

    def verdict(self) -> str | None:
        """The export's verdict, if a rank gave one."""
        return self.board.read(f"{self.export_key}/verdict")

    def give_verdict(self, message: str) -> WeightExportError:
        """Record ``message`` as the verdict unless one was given first; the error to raise."""
        return WeightExportError(self.board.decide(f"{self.export_key}/verdict", message))

    def raise_if_failed(self) -> None:
        """Raise the verdict, if there is one (before issuing anything new)."""
        verdict = self.verdict()
        if verdict is not None:
            raise WeightExportError(verdict)

    def wait(self, works: list[dist.Work], members: list[int], on_device: bool = False) -> None:
        """Wait for ``works``, raising the verdict, or giving one if a member is late.

        gloo's point-to-point works report completion only to ``wait()``, and a ``wait`` with a
        timeout closes the group's connections when it runs out: so a thread of its own waits
        without one while this one watches the store. A wait given up on (a verdict) leaves
        that thread in gloo until the group's timeout; the group is dropped.

        Works on device tensors (``on_device``: NCCL) are different: their ``wait()`` returns
        at once, having ordered this thread's current stream after the collective (so it must
        run here, not on another thread, whose stream is another), and their completion is
        polled.
        """
        if on_device:
            for work in works:
                work.wait()
            self._watch(lambda: all(work.is_completed() for work in works), members)
            return
        done = threading.Event()
        failures: list[BaseException] = []

        def wait_all() -> None:
            try:
                for work in works:
                    work.wait()
            except BaseException as error:  # handed to the export's thread
                failures.append(error)
            finally:
                done.set()

        threading.Thread(target=wait_all, name="shardkit-export-wait", daemon=True).start()
        self._watch(lambda: done.wait(_POLL_S), members)
        if failures:
            self.raise_if_failed()
            error = failures[0]
            raise self.give_verdict(
                f"weight export {self.export_key}: rank {self.rank} failed in {self.where}: "
                f"{type(error).__name__}: {error}"
            ) from error

    def _watch(self, finished: Callable[[], bool], members: list[int]) -> None:
        """Until ``finished()``: every ``_POLL_S``, read the verdict and judge late members.

        ``finished`` may block for a while itself (the gloo thread's event); a device work's
        completion is polled every 0.2 ms (a collective of a bucket takes milliseconds).
        """
        start = last = time.monotonic()
        while not finished():
            now = time.monotonic()
            if now - last < _POLL_S:
                time.sleep(_DEVICE_POLL_S)
                continue
            last = now
            self.raise_if_failed()
            if now - start >= self.bound_s:
                late = self._late_member(members)
                if late is not None:
                    raise self.give_verdict(late)

    def _late_member(self, members: list[int]) -> str | None:
        others = [m for m in members if m != self.rank]
        beats = [self.board.read(f"{self.export_key}/beat/{m}") for m in others]
        now = time.time()
        for member, beat in zip(others, beats, strict=True):
            if beat is None:
                return (
                    f"weight export {self.export_key}: rank {member} is late: it has not started "
                    f"the export while rank {self.rank} waits in {self.where} (bound "
                    f"{self.bound_s:g} s, SHARDKIT_EXPORT_BOUND)"
                )
            stamp, _, where = beat.partition(" ")
            if where != self.where and now - float(stamp) >= self.bound_s:
                return (
                    f"weight export {self.export_key}: rank {member} is late: it has been in "
                    f"{where} for {now - float(stamp):.1f} s while rank {self.rank} waits in "
                    f"{self.where} (bound {self.bound_s:g} s, SHARDKIT_EXPORT_BOUND)"
                )
        return None


def gather_buffer(
    buffer: torch.Tensor, group: dist.ProcessGroup, members: list[int], *, to_all: bool
) -> tuple[list[dist.Work], torch.Tensor | None]:
    """Start gathering ``buffer`` (1-D, the same length on every member) along ``group``.

    Returns the works and the (members, length) result: on every member with ``to_all`` (an
    all-gather), else on the first member only (a gather; None elsewhere). On gloo both are
    point-to-point messages, as the engine's own all-gather: gloo's collectives move a
    fraction of the bytes a second that its sends do here.
    """
    size = len(members)
    if size == 1:
        # A group of one (one GPU, or a mesh axis of one): the buffer is the result; the
        # gather would be a copy of a bucket, and one more bucket held.
        return [], buffer.view(1, -1)
    me = dist.get_rank(group)
    receives = to_all or me == 0
    out = (
        torch.empty((size, buffer.numel()), dtype=buffer.dtype, device=buffer.device)
        if receives
        else None
    )
    tag = EXPORT_GATHER.tag()
    if not on_gloo(group):
        if to_all:
            assert out is not None
            work = all_gather_single(out.view(-1), buffer, group=group, async_op=True)
        else:
            rows = list(out.unbind(0)) if out is not None else None
            work = dist.gather(buffer, rows, group=group, group_dst=0, async_op=True)
        assert work is not None
        return [work], out
    if to_all:
        assert out is not None
        out[me].copy_(buffer)
        return post_row_exchange(group, tag, send=buffer, receive_into=out), out
    if me != 0:
        work = dist.isend(buffer, group=group, group_dst=0, tag=tag)
        return [work] if work is not None else [], None
    assert out is not None
    out[0].copy_(buffer)
    works = [dist.irecv(out[peer], group=group, group_src=peer, tag=tag) for peer in range(1, size)]
    return [w for w in works if w is not None], out


def on_gloo(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs on gloo (whose point-to-point messages beat its collectives)."""
    return dist.get_backend(group) == "gloo"


def post_pieces(
    group: dist.ProcessGroup,
    *,
    sends: dict[int, list[torch.Tensor]],
    receives: dict[int, list[torch.Tensor]],
) -> list[dist.Work]:
    """Post point-to-point messages of tensors to and from other members of ``group``.

    ``sends[j]`` go to group rank ``j`` and ``receives[j]`` are filled from it, each list in
    order: gloo pairs one sender's messages with one tag in the order both sides post them, so
    the n-th tensor sent to a member lands in the n-th tensor it posted for this rank. The
    export gathers a bucket so, each rank's piece of each tensor received straight into its
    place in the full tensor (no unpacking copy). Wait on none.
    """
    tag = EXPORT_GATHER.tag()
    works: list[dist.Work | None] = []
    for peer in sorted(set(sends) | set(receives)):
        works += [
            dist.irecv(t, group=group, group_src=peer, tag=tag) for t in receives.get(peer, [])
        ]
        works += [dist.isend(t, group=group, group_dst=peer, tag=tag) for t in sends.get(peer, [])]
    return [w for w in works if w is not None]


def all_gather_vector(
    values: torch.Tensor, groups: ExportGroups
) -> tuple[list[dist.Work], torch.Tensor]:
    """Start an all-gather of a small int64 vector over every rank of the mesh.

    The vector travels on a device the group serves: a group made under
    ``init_process_group("nccl")`` has no CPU backend, so there it goes through the GPU (the
    rows come back on the host: the caller reads them at once).
    """
    device = vector_device(groups.world)
    flat = torch.empty(len(groups.world_ranks) * values.numel(), dtype=values.dtype, device=device)
    work = all_gather_single(flat, values.to(device), group=groups.world, async_op=True)
    assert work is not None
    return [work], flat.view(len(groups.world_ranks), values.numel())


def vector_device(group: dist.ProcessGroup) -> torch.device:
    """The host where ``group`` serves CPU tensors, else this process's accelerator."""
    served = getattr(group, "_device_types", None)
    if served is None or any(d.type == "cpu" for d in served):
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None, "a process group without a CPU backend, and no accelerator"
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
