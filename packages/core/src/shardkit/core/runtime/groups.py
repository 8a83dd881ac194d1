"""Process groups: who this rank is, the default group, subgroups and barriers.

With ``collectives.py`` and ``p2p/object_collectives.py`` this is the only place the core talks
to ``torch.distributed``, so a backend quirk or an API change is handled once.
"""

from __future__ import annotations

import logging
import os
import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import PrefixStore, Store, _get_default_store

__all__ = [
    "barrier",
    "checkpoint_group",
    "cpu_world",
    "default_mesh",
    "global_rank",
    "group_ranks",
    "is_distributed",
    "new_subgroup",
    "own_group",
    "lower_thread_priority",
    "mesh_group",
    "progress_store",
    "snapshot_group",
    "SNAPSHOT_NICENESS",
    "subgroup_of",
    "world_group",
    "world_subgroup",
    "world_size",
]


logger = logging.getLogger(__name__)


def global_rank() -> int:
    """This process's rank in the default process group."""
    return dist.get_rank()


def world_size() -> int:
    """Ranks in the default process group."""
    return dist.get_world_size()


def is_distributed() -> bool:
    """Whether the default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Block until every rank of ``group`` (default: all) arrives."""
    dist.barrier(group=group)


def default_mesh(axis_name: str | None = None) -> DeviceMesh:
    """A 1-D mesh over the whole default process group, on the device type it serves.

    The default group is initialised from the environment (as torchrun sets it) if needed.
    ``axis_name`` names the mesh's axis (``replicate``'s is ``"replicate"``, as torch's).
    """
    if not dist.is_initialized():
        dist.init_process_group()
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    names = None if axis_name is None else (axis_name,)
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=names)


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup), "the default process group is not initialised"
    return world


def mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of every rank of ``mesh`` (its one group where it is 1-D).

    An N-D mesh over the whole world gives the default group; one over some ranks a group of
    its own, made as :func:`world_group` makes it (every rank of the world calls this).
    """
    if mesh.ndim == 1:
        return mesh.get_group(0)
    members = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
    if len(members) == dist.get_world_size():
        return _world()
    group = world_group(members)
    assert group is not None, f"rank {dist.get_rank()} is not in the mesh {mesh}"
    return group


def group_ranks(group: dist.ProcessGroup) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return dist.get_process_group_ranks(group)


# Subgroups by their parent group, then by member ranks: callers that share a parent share its
# subgroups. Weak keys: after destroy_process_group() and a new init (tests, elastic restarts)
# the parent is a new object, so no subgroup of a dead world is ever handed out.
_SUBGROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, ...], dist.ProcessGroup]]
_SUBGROUPS = weakref.WeakKeyDictionary()


def subgroup_of(parent: dist.ProcessGroup, members: tuple[int, ...]) -> dist.ProcessGroup:
    """The subgroup of ``parent`` with these global ranks, created on first use (members only)."""
    known = _SUBGROUPS.setdefault(parent, {})
    group = known.get(members)
    if group is None:
        group = known[members] = new_subgroup(list(members))
    return group


def new_subgroup(members: list[int]) -> dist.ProcessGroup:
    """A process group of ``members`` (global ranks), created by the members alone.

    Local synchronisation: ranks outside it need not take part, so disjoint subgroups are
    created without any global agreement on their order. From torch 2.14 this advances
    torch's group counter on the members alone: where the members are some ranks of the
    world, the world's next group hangs unless it was made before. Kept only for the groups
    that are the shard group's own ranks by nature and that torch's ``fully_shard`` makes
    the same way (``reshard_after_forward=<int>``, ``set_separate_reduce_scatter_group``) and
    for :func:`own_group`; loads and desync checks make none (see docs/torch-releases.md,
    "Known issues").
    """
    group = dist.new_group(members, use_local_synchronization=True)
    assert isinstance(group, dist.ProcessGroup), f"not a member of the subgroup {members}"
    return group


def world_subgroup(members: tuple[int, ...]) -> dist.ProcessGroup:
    """The subgroup of the default group with these global ranks (members only call it)."""
    return subgroup_of(_world(), members)


def own_group() -> dist.ProcessGroup:
    """A process group of this rank alone: the shard group when nothing is sharded.

    Created by this rank only (no other rank takes part) and reused after.
    """
    return world_subgroup((global_rank(),))


# Groups of the default group made by every rank of the world (members and the others), by
# their members: a rank that is not a member keeps None, so that every rank's next call with
# the same members finds its entry and none of them creates the group twice.
_WORLD_GROUPS: weakref.WeakKeyDictionary[
    dist.ProcessGroup, dict[tuple[int, ...], dist.ProcessGroup | None]
]
_WORLD_GROUPS = weakref.WeakKeyDictionary()


def world_group(members: tuple[int, ...]) -> dist.ProcessGroup | None:
    """The group of these global ranks; None on a rank that is not one of them.

    Collective over the world on first use: every rank calls it, members or not, with the same
    ``members``. From torch 2.14 every group creation advances the counter torch names later
    groups by, on the ranks that take part; made by every rank, the counter stays equal on all
    of them, so later world-wide groups (``init_device_mesh``) pair the same ranks.
    """
    world = _world()
    known = _WORLD_GROUPS.setdefault(world, {})
    if members not in known:
        made = dist.new_group(list(members))
        known[members] = made if isinstance(made, dist.ProcessGroup) else None
    return known[members]


# A gloo group of every rank per default group whose backend is not gloo: the world's small
# CPU messages (outcomes, agreements of the whole world).
_GLOO_WORLDS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup]
_GLOO_WORLDS = weakref.WeakKeyDictionary()


def cpu_world() -> dist.ProcessGroup:
    """A group of every rank that takes CPU tensors: the default group on gloo, else a twin.

    Collective over the world on first use (where the default group is not gloo): its callers
    are the world's own collectives, which every rank runs, so every rank creates the twin at
    the same point and torch's group counter stays equal on all of them.
    """
    world = _world()
    return world if dist.get_backend(world) == dist.Backend.GLOO else _gloo_world(_GLOO_WORLDS)


# One gloo group of every rank per default group, for checkpoint writes in a background thread.
_CHECKPOINT_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup]
_CHECKPOINT_GROUPS = weakref.WeakKeyDictionary()


def checkpoint_group() -> dist.ProcessGroup:
    """A gloo group of every rank that only background checkpoint writes use.

    Collective on first use: every rank calls it, from the training thread. A write running in
    another thread must never issue collectives on a group the training thread also uses: the
    ranks could pair a checkpoint message with a training collective, and both would hang or
    mix data. Gloo groups are independent (their own connections), so the two threads can
    each run collectives on their own group at the same time.
    """
    return _gloo_world(_CHECKPOINT_GROUPS)


# One gloo group of every rank per default group, for memory snapshots' replicas.
_SNAPSHOT_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup]
_SNAPSHOT_GROUPS = weakref.WeakKeyDictionary()


# The niceness of memory snapshots' background work: the writer's thread and the snapshot
# group's gloo threads (its TCP loop moves every replica's bytes). Where training keeps every
# core busy, the work then takes the cycles that training leaves while it waits in its own
# collectives instead of stretching a step. 10, not 19: other jobs' niced processes must not
# starve it (a replica late by a step holds up the next snapshot), and the writer's thread,
# which takes the GIL between its calls, must not be preempted by them while it holds it.
SNAPSHOT_NICENESS = 10


def snapshot_group() -> dist.ProcessGroup:
    """A gloo group of every rank that only memory snapshots' transfers to peers use.

    Collective on first use, from the training thread. The replicas travel from a thread of
    their own while the training thread runs its collectives on the default group (and an
    asynchronous checkpoint's writer on ``checkpoint_group()``): each thread has its own group,
    so no message of one is ever paired with a message of another. The threads gloo starts for
    the group run at ``SNAPSHOT_NICENESS`` (on Linux).
    """
    return _gloo_world(_SNAPSHOT_GROUPS, niceness=SNAPSHOT_NICENESS)


def lower_thread_priority(thread_id: int, niceness: int) -> None:
    """Set one thread's niceness (``threading.get_native_id()``); nothing where not allowed.

    On Linux, ``PRIO_PROCESS`` with a thread id sets that thread's niceness alone.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, thread_id, niceness)
    except (AttributeError, OSError) as error:  # not Linux, or not allowed: run as is
        logger.debug("thread %d keeps its priority: %s", thread_id, error)


def _gloo_world(
    made: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup],
    niceness: int | None = None,
) -> dist.ProcessGroup:
    """The gloo group of every rank kept in ``made`` for the default group; made on first use.

    Collective on first use: every rank of the world makes it together (a plain ``new_group``),
    so torch's group counter advances alike on all of them. With ``niceness``, the threads that
    appear while the group is made (gloo's TCP loop and its workers) get it.
    """
    world = _world()
    group = made.get(world)
    if group is None:
        before = _thread_ids()
        new = dist.new_group(backend="gloo")
        assert isinstance(new, dist.ProcessGroup), "every rank is a member of the world"
        group = made[world] = new
        if niceness is not None:
            for thread_id in _thread_ids() - before:
                lower_thread_priority(thread_id, niceness)
    return group


def _thread_ids() -> set[int]:
    """This process's threads (Linux); empty where /proc does not list them."""
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def progress_store() -> Store | None:
    """The store where ranks post their progress for hang reports (the default group's).

    None when there is no default group. torch has no public accessor for it.
    """
    if not is_distributed():
        return None
    return PrefixStore("shardkit/progress/", _get_default_store())
