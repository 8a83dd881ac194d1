"""Process groups: who this rank is, the default group, subgroups and barriers.

With ``collectives.py`` and ``object_collectives.py`` this is the only place the core talks to
``torch.distributed``, so a backend quirk or an API change is handled once.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import PrefixStore, Store, _get_default_store

__all__ = [
    "barrier",
    "checkpoint_group",
    "cpu_group",
    "cpu_world",
    "default_mesh",
    "fingerprint_group",
    "global_rank",
    "group_ranks",
    "is_distributed",
    "new_subgroup",
    "own_group",
    "progress_store",
    "subgroup_of",
    "world_subgroup",
    "world_size",
]


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


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole default process group, on the device type it serves.

    The default group is initialised from the environment (as torchrun sets it) if needed.
    """
    if not dist.is_initialized():
        dist.init_process_group()
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


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
    created without any global agreement on their order.
    """
    group = dist.new_group(members, use_local_synchronization=True)
    assert isinstance(group, dist.ProcessGroup), f"not a member of the subgroup {members}"
    return group


def world_subgroup(members: tuple[int, ...]) -> dist.ProcessGroup:
    """The subgroup of the default group with these global ranks (members only call it)."""
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup), "the default process group is not initialised"
    return subgroup_of(world, members)


def own_group() -> dist.ProcessGroup:
    """A process group of this rank alone: the shard group when nothing is sharded.

    Created by this rank only (no other rank takes part) and reused after.
    """
    return world_subgroup((global_rank(),))


# Gloo groups with the same members as another group, for small CPU messages whatever that
# group's backend: fingerprints (desync checks) and outcomes (agreement).
_GLOO_TWINS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup]
_GLOO_TWINS = weakref.WeakKeyDictionary()


def fingerprint_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The gloo twin of ``group`` that desync checks use, created by its members on first use.

    Always a group of its own, even for a gloo group: a rank out of step must not be able to
    pair a fingerprint with a collective of the program's own on ``group``.
    """
    twin = _GLOO_TWINS.get(group)
    if twin is None:
        members = dist.get_process_group_ranks(group)
        made = dist.new_group(members, backend="gloo", use_local_synchronization=True)
        assert isinstance(made, dist.ProcessGroup), f"not a member of {members}"
        twin = _GLOO_TWINS[group] = made
    return twin


def cpu_world() -> dist.ProcessGroup:
    """A group of every rank that takes CPU tensors: the default group on gloo, else a twin."""
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup), "the default process group is not initialised"
    return world if dist.get_backend(world) == dist.Backend.GLOO else fingerprint_group(world)


def cpu_group(members: tuple[int, ...]) -> dist.ProcessGroup | None:
    """A group of these global ranks that takes CPU tensors; None for the whole world.

    Created by the members alone on first use (every member must call it), then reused.
    """
    if len(members) == dist.get_world_size():
        return None
    group = world_subgroup(members)
    return group if dist.get_backend(group) == dist.Backend.GLOO else fingerprint_group(group)


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
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup), "the default process group is not initialised"
    group = _CHECKPOINT_GROUPS.get(world)
    if group is None:
        made = dist.new_group(backend="gloo")
        assert isinstance(made, dist.ProcessGroup), "every rank is a member of the world"
        group = _CHECKPOINT_GROUPS[world] = made
    return group


def progress_store() -> Store | None:
    """The store where ranks post their progress for hang reports (the default group's).

    None when there is no default group. torch has no public accessor for it.
    """
    if not is_distributed():
        return None
    return PrefixStore("shardkit/progress/", _get_default_store())
