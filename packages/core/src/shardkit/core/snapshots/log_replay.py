"""Replaying the gradient log: a lost node's rank from its newest replica to the newest step.

A rank whose node's memory is gone restores the newest full replica its peer holds (step b)
and the log entries of steps b+1..k after it (``gradient_log``). ``check_entry`` refuses an
entry it could not replay into its live state before anything is written; ``replay`` runs the
live optimizer once per entry (the logged gradients and group values set); ``reached`` lays
the state it reached out as step k's full snapshot and checks it against the checksums the
writer recorded for step k, all of it. ``restore`` calls them between its agreements.
See [Note: memory snapshots].
"""

from __future__ import annotations

import json

import torch
from torch.distributed.tensor import DTensor

from shardkit.core.runtime.dtensors import dtensor_like
from shardkit.core.snapshots.checksum import checksum_count
from shardkit.core.snapshots.contents import JSONValue, Layout, Leaves
from shardkit.core.snapshots.format import (
    Header,
    SnapshotRefusal,
    SnapshotRefused,
    verify_data,
)
from shardkit.core.snapshots.gradient_log import (
    FULL_SUMS,
    GRAD,
    GROUPS,
    LOG_VALUES,
    PRESENT,
    STEPPED,
    UNUSABLE,
    GradientLog,
    local_shard,
)
from shardkit.core.snapshots.state_copy import SlotCopier

__all__ = ["check_entry", "reached", "replay"]


def check_entry(header: Header, layout: Layout, log: GradientLog) -> None:
    """Refuse an entry this rank cannot replay into a state of ``layout``.

    Raises:
        SnapshotRefused: OTHER_LAYOUT (its gradients or carried tensors are not the live
            optimizer's and state's), UNUSABLE (the writer said why it cannot be replayed).
    """
    problem = header.values.get(UNUSABLE)
    if problem:
        raise SnapshotRefused(SnapshotRefusal.UNREPLAYABLE, str(problem))
    full = {e.key: e for e in layout.entries}
    grads = [e for e in header.layout.entries if e.key.startswith(GRAD)]
    if len(grads) != len(log.params):
        detail = f"{len(grads)} gradients logged, the optimizer has {len(log.params)} parameters"
        raise SnapshotRefused(SnapshotRefusal.OTHER_LAYOUT, detail)
    for index, (entry, param) in enumerate(zip(grads, log.params, strict=True)):
        local = local_shard(param)
        dtype = str(local.dtype).removeprefix("torch.")
        if entry.key != f"{GRAD}{index:05d}" or (entry.dtype, entry.shape) != (
            dtype,
            tuple(local.shape),
        ):
            detail = f"{entry.key} is not the local shard of the optimizer's parameter {index}"
            raise SnapshotRefused(SnapshotRefusal.OTHER_LAYOUT, detail)
    for entry in header.layout.entries[len(grads) :]:
        mine = full.get(entry.key)
        if mine is None or (mine.dtype, mine.shape) != (entry.dtype, entry.shape):
            raise SnapshotRefused(SnapshotRefusal.OTHER_LAYOUT, f"{entry.key} is not the state's")
    expected = set(layout.value_keys) | set(LOG_VALUES)
    if set(header.layout.value_keys) != expected:
        raise SnapshotRefused(SnapshotRefusal.OTHER_LAYOUT, "its plain values are not the state's")
    try:
        groups = json.loads(str(header.values[GROUPS]))
    except ValueError:
        groups = None
    present = header.values[PRESENT]
    if not isinstance(groups, list) or len(groups) != len(log.optimizer.param_groups):
        raise SnapshotRefused(SnapshotRefusal.OTHER_LAYOUT, "its parameter groups are not these")
    live = log.optimizer.param_groups
    if not all(
        isinstance(logged, dict) and logged.keys() <= group.keys() - {"params"}
        for logged, group in zip(groups, live, strict=True)
    ):
        detail = "its parameter groups are not objects of the live groups' keys"
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, detail)
    if not isinstance(present, str) or len(present) != len(grads) or set(present) - {"0", "1"}:
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, "its gradients' presence is malformed")
    if header.values[STEPPED] not in (0, 1):
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, "its count of optimizer steps")
    sums = header.values[FULL_SUMS]
    try:
        whole = isinstance(sums, str) and len(bytes.fromhex(sums)) == 8 * checksum_count(
            layout.data_bytes
        )
    except ValueError:
        whole = False
    if not whole:
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, "its step's checksums are malformed")


def replay(entries: list[tuple[Header, torch.Tensor]], log: GradientLog) -> None:
    """Replay ``entries`` (headers and data, checked) with ``log``'s optimizer.

    The state must hold the entries' base step. Only the optimizer runs (no state dict is
    taken or loaded: those are collective for some states, and only a lost node's ranks
    replay); ``reached`` then checks what it gave.
    """
    optimizer = log.optimizer
    with log.replaying(), torch.no_grad():
        for header, data in entries:
            groups = json.loads(str(header.values[GROUPS]))
            for group, logged in zip(optimizer.param_groups, groups, strict=True):
                for key, value in logged.items():
                    live = group.get(key)
                    group[key] = tuple(value) if isinstance(live, tuple) else value
            if header.values[STEPPED] != 1:
                continue
            present = str(header.values[PRESENT])
            grads = header.layout.entries[: len(log.params)]
            for param, entry, flag in zip(log.params, grads, present, strict=True):
                param.grad = _grad_for(param, entry.view(data)) if flag == "1" else None
            try:
                optimizer.step()
            except Exception as error:  # values the log holds that the optimizer refuses
                detail = f"the optimizer's step {header.step} raised {type(error).__name__}"
                raise SnapshotRefused(SnapshotRefusal.UNREPLAYABLE, f"{detail}: {error}") from error
            finally:
                for param in log.params:
                    param.grad = None


def reached(
    leaves: Leaves, layout: Layout, entries: list[tuple[Header, torch.Tensor]], n_grads: int
) -> tuple[torch.Tensor, dict[str, JSONValue]]:
    """The full snapshot of the last entry's step, as a replay reached it: data and values.

    ``leaves``: the state's after the replay; the last entry's carried tensors and plain values
    replace theirs. ``n_grads``: the gradients an entry starts with.

    Raises:
        SnapshotRefused: UNREPLAYABLE, naming the first tensor whose bytes are not the step's.
    """
    last, data = entries[-1]
    state = torch.zeros(layout.data_bytes, dtype=torch.uint8)
    SlotCopier(layout).copy(state, [entry.view(state) for entry in layout.entries], leaves)
    full = {e.key: e for e in layout.entries}
    for entry in last.layout.entries[n_grads:]:
        full[entry.key].view(state).copy_(entry.view(data))
    values = {k: v for k, v in last.values.items() if not k.startswith("log/")}
    sums = bytes.fromhex(str(last.values[FULL_SUMS]))
    claimed = Header(last.run_id, last.world_size, last.rank, last.step, layout, sums, values)
    try:
        verify_data(claimed, state)
    except SnapshotRefused as error:
        first = entries[0][0].step
        detail = f"replaying steps {first} to {last.step} did not give step {last.step}'s state"
        raise SnapshotRefused(
            SnapshotRefusal.UNREPLAYABLE, f"{detail}: {str(error).split(': ', 1)[1]}"
        ) from None
    return state, values


def _grad_for(param: torch.Tensor, logged: torch.Tensor) -> torch.Tensor:
    """The gradient ``param`` had: ``logged``'s values on its local shard's device (a copy)."""
    local = logged.to(device=local_shard(param).device, copy=True)
    return dtensor_like(local, param) if isinstance(param, DTensor) else local
