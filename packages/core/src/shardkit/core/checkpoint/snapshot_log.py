"""The gradient log: what a replica carries on the steps between two full ones.

With ``replicate_every=N``, a rank's full snapshot (parameters, optimizer state, the rest)
travels to its peer on another node every N steps. Given the optimizer
(``MemorySnapshots(optimizer=...)``), the steps between send a log entry instead: the
gradients the optimizer consumed at that step (taken by a step pre-hook, so after any
clipping), its parameter groups' values then, the state's tensors that the optimizer does not
produce (buffers, RNG states: carried in full), the step's plain values, and the checksums of
the step's full snapshot, which the writer computed for its own slot anyway. With fp32
parameters and AdamW that is 4 bytes a parameter on the wire instead of 12.

Only a lost node's ranks read entries. Each loads its newest full replica (step b), replays
steps b+1..k with its live optimizer (the logged gradients set, the groups' values set, its
``step()``), and checks the state it reached against step k's checksums: all of it, the
parameters and the optimizer's state. A replay that does not give those bits (an optimizer
whose state is not a function of its gradients, a hook that changed what the log does not hold)
is refused by name, like a torn slot, and the ranks choose an older step. A killed process
never replays: its own slots hold every step in full.

An entry is a snapshot in the same format (``snapshot_format``): its layout lists the gradients
first (``log/grad/00000`` on, in the optimizer's parameter order, each as the parameter's local
shard), then the carried tensors under their own keys; its plain values are the step's and the
log's own, under ``log/``. See [Note: memory snapshots].
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from shardkit.core.checkpoint.snapshot_checksum import checksum_count, checksums_of
from shardkit.core.checkpoint.snapshot_format import (
    REGION_AT,
    Header,
    SnapshotRefusal,
    SnapshotRefused,
    data_offset,
    header_region,
    layout_json_of,
    verify_data,
)
from shardkit.core.checkpoint.snapshot_layout import (
    JSONValue,
    Layout,
    Leaves,
    SlotCopier,
    TensorEntry,
    dtype_named,
)
from shardkit.core.checkpoint.snapshot_slots import Topology
from shardkit.core.runtime.dtensors import dtensor_like, local_of

__all__ = [
    "GradientLog",
    "LogEntry",
    "LogPlan",
    "check_entry",
    "entry_capacity",
    "params_of",
    "reached",
    "replay",
]

_ALIGN = 64  # as the layout aligns tensors
_GRAD = "log/grad/"
BASE = "log/base"  # the step of the full replica the entry follows
STEPPED = "log/stepped"  # optimizer steps since the snapshot before (1; 0 if none ran)
GROUPS = "log/groups"  # the parameter groups' values at the step, JSON text
PRESENT = "log/present"  # "1" for each parameter that had a gradient, else "0"
FULL_SUMS = "log/full_checksums"  # the step's full snapshot's checksums, hex
UNUSABLE = "log/unusable"  # why this entry cannot be replayed ("" when it can)
_LOG_VALUES = (BASE, FULL_SUMS, GROUPS, PRESENT, STEPPED, UNUSABLE)


@dataclass(frozen=True, slots=True)
class LogPlan:
    """What a rank's log entries hold, made at its first snapshot."""

    layout: Layout  # the entries' layout: gradients, then carried tensors
    grads_end: int  # bytes of the gradients' part
    carried: tuple[tuple[TensorEntry, TensorEntry], ...]  # (in the entry, in the full snapshot)

    @staticmethod
    def of(layout: Layout, leaves: Leaves, optimizer: torch.optim.Optimizer) -> LogPlan:
        """The plan for a state of ``layout`` (its ``leaves``) and its ``optimizer``.

        A tensor of the state is produced by the optimizer (so replayed, not carried) when it
        starts where one of its parameters' local shards or state tensors does; the check of
        the replayed state against its checksums makes that test safe to be wrong.
        """
        params = params_of(optimizer)
        produced = {_start(p) for p in params}
        for state in optimizer.state.values():
            produced |= {_start(t) for t in state.values() if isinstance(t, torch.Tensor)}
        entries: list[TensorEntry] = []
        offset = 0
        for index, param in enumerate(params):
            local = local_of(param) if isinstance(param, DTensor) else param
            nbytes = local.numel() * local.element_size()
            dtype = str(local.dtype).removeprefix("torch.")
            shapes = tuple(local.shape), tuple(param.shape)
            entries.append(TensorEntry(f"{_GRAD}{index:05d}", dtype, *shapes, offset, nbytes))
            offset += _aligned(nbytes)
        grads_end = offset
        carried = []
        for entry in layout.entries:
            tensor = leaves.tensors[entry.key]
            if tensor.numel() and _start(tensor) in produced:
                continue
            carried.append((replace(entry, offset=offset), entry))
            entries.append(carried[-1][0])
            offset += _aligned(entry.nbytes)
        values = tuple(sorted(layout.value_keys + _LOG_VALUES))
        return LogPlan(Layout(tuple(entries), values, offset), grads_end, tuple(carried))


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One step's capture, ready for the background thread to finish and send."""

    buffer: torch.Tensor  # the entry's bytes from offset 0 (header region, then data)
    stepped: int
    groups: str
    present: str
    problem: str


class GradientLog:
    """Takes the gradients an optimizer consumes at each step, for the replicas' log entries.

    A step pre-hook on ``optimizer`` copies every parameter's gradient (its local shard) into
    one of two buffers in one concatenation: one entry is being sent while the next is taken.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = params_of(optimizer)
        self.plan: LogPlan | None = None
        self.capacity = 0
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._pieces: list[torch.Tensor] = []  # gradients' bytes and the gaps between
        self._zeros = torch.zeros(0, dtype=torch.uint8)
        self._stepped, self._problem = 0, ""
        self._groups, self._present = "[]", ""
        self._replaying = False
        self._layout_json = ""
        self._expected: list[tuple[torch.dtype, tuple[int, ...], int]] = []  # each gradient's
        self._handle = optimizer.register_step_pre_hook(self._capture)

    @property
    def data_bytes(self) -> int:
        """The size of an entry's data (0 before ``start``)."""
        return self.plan.layout.data_bytes if self.plan is not None else 0

    def start(
        self, plan: LogPlan, topology: Topology, full: Layout, values: dict[str, JSONValue]
    ) -> None:
        """Allocate the two entry buffers (the first snapshot, before its entries are taken).

        ``full``: the full snapshot's layout; ``values``: the state's plain values now (for
        the headers' room).
        """
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        described = json.dumps(groups, default=repr)
        capacity = entry_capacity(topology, plan, full.data_bytes, values, described)
        self.plan, self.capacity = plan, capacity
        self._layout_json = layout_json_of(plan.layout)  # every entry's header repeats it
        size = data_offset(capacity) + plan.layout.data_bytes
        self._buffers = [torch.zeros(size, dtype=torch.uint8) for _ in range(2)]
        grads = plan.layout.entries[: len(self.params)]
        self._expected = [(dtype_named(e.dtype), e.shape, e.nbytes) for e in grads]
        widest = max((e.nbytes for e in plan.layout.entries), default=0)
        self._zeros = torch.zeros(max(widest, _ALIGN), dtype=torch.uint8)
        self._stepped = 0

    def finish(
        self, entry: LogEntry, full: Header, full_data: torch.Tensor, base: int
    ) -> torch.Tensor:
        """Complete ``entry`` for the full snapshot ``full`` (background thread): what travels.

        The carried tensors are copied from the full snapshot's data (``full_data``, its slot),
        and the entry's header written in front of its data.
        """
        assert self.plan is not None
        start = data_offset(self.capacity)
        data = entry.buffer[start : start + self.plan.layout.data_bytes]
        for in_entry, in_full in self.plan.carried:
            data[in_entry.offset : in_entry.offset + in_entry.nbytes].copy_(
                full_data[in_full.offset : in_full.offset + in_full.nbytes]
            )
        values: dict[str, JSONValue] = dict(full.values)
        values |= {
            BASE: base,
            STEPPED: entry.stepped,
            GROUPS: entry.groups,
            PRESENT: entry.present,
            FULL_SUMS: full.checksums.hex(),
            UNUSABLE: entry.problem[:400],
        }
        who = full.run_id, full.world_size, full.rank, full.step
        header = Header(*who, self.plan.layout, checksums_of(data), values)
        region = header_region(header.to_json(self._layout_json), self.capacity)
        entry.buffer[REGION_AT : REGION_AT + len(region)].numpy()[:] = np.frombuffer(
            region, np.uint8
        )
        return entry.buffer[REGION_AT : start + self.plan.layout.data_bytes]

    def close(self) -> None:
        """Remove the hook: the optimizer no longer pays for the log."""
        self._handle.remove()

    def take(self) -> LogEntry:
        """The capture since the last ``take`` (training thread, at a snapshot)."""
        problem = self._problem
        if self._stepped > 1:
            problem = f"the optimizer stepped {self._stepped} times between two snapshots"
        entry = LogEntry(
            self._buffers[self._next], self._stepped, self._groups, self._present, problem
        )
        self._next ^= 1
        self._stepped, self._problem = 0, ""
        return entry

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """The optimizer's steps in here are a replay's, not the training's: not captured."""
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    def _capture(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._replaying or self.plan is None:
            return
        self._stepped += 1
        if self._stepped > 1:
            return
        self._problem = ""
        try:
            self._groups = json.dumps(
                [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            )
        except (TypeError, ValueError) as error:  # a tensor lr, an object in a group
            self._problem = f"a parameter group holds a value that is not JSON: {error}"
        pieces, present = [], []
        for param, (dtype, shape, nbytes) in zip(self.params, self._expected, strict=True):
            grad = param.grad
            local = local_of(grad) if isinstance(grad, DTensor) else grad
            if local is None:
                pieces.append(self._zeros[:nbytes])
                present.append("0")
            elif local.dtype != dtype or local.shape != shape or local.device.type != "cpu":
                self._problem = (
                    f"a gradient ({local.dtype}, {tuple(local.shape)} on {local.device}) is "
                    f"not its parameter's local shard's ({dtype}, {shape}, on the host)"
                )
                pieces.append(self._zeros[:nbytes])
                present.append("0")
            else:
                pieces.append(local.detach().reshape(-1).view(torch.uint8))
                present.append("1")
            gap = _aligned(nbytes) - nbytes
            if gap:
                pieces.append(self._zeros[:gap])
        self._present = "".join(present)
        start = data_offset(self.capacity)
        buffer = self._buffers[self._next]
        with torch.no_grad():
            torch.cat(pieces, out=buffer[start : start + self.plan.grads_end])


def entry_capacity(
    topology: Topology, plan: LogPlan, full_bytes: int, values: dict[str, JSONValue], groups: str
) -> int:
    """Room for any of this rank's entry headers: twice a wide one, and 4 KiB more.

    ``values``: the state's plain values at its first snapshot; ``groups``: the optimizer's
    parameter groups' values then, as an entry holds them.
    """
    values = dict(values) | {
        BASE: 2**62,
        STEPPED: 2**62,
        FULL_SUMS: bytes(8 * checksum_count(full_bytes)).hex(),
        GROUPS: groups,
        PRESENT: "1" * len(plan.layout.entries),
        UNUSABLE: "x" * 400,
    }
    sums = bytes(8 * checksum_count(plan.layout.data_bytes))
    who = topology.run_id, topology.world_size, topology.rank
    widest = Header(*who, 2**62, plan.layout, sums, values)
    return 2 * len(widest.to_json()) + 4096


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
    grads = [e for e in header.layout.entries if e.key.startswith(_GRAD)]
    if len(grads) != len(log.params):
        detail = f"{len(grads)} gradients logged, the optimizer has {len(log.params)} parameters"
        raise SnapshotRefused(SnapshotRefusal.OTHER_LAYOUT, detail)
    for index, (entry, param) in enumerate(zip(grads, log.params, strict=True)):
        local = local_of(param) if isinstance(param, DTensor) else param
        dtype = str(local.dtype).removeprefix("torch.")
        if entry.key != f"{_GRAD}{index:05d}" or (entry.dtype, entry.shape) != (
            dtype,
            tuple(local.shape),
        ):
            detail = f"{entry.key} is not the local shard of the optimizer's parameter {index}"
            raise SnapshotRefused(SnapshotRefusal.OTHER_LAYOUT, detail)
    for entry in header.layout.entries[len(grads) :]:
        mine = full.get(entry.key)
        if mine is None or (mine.dtype, mine.shape) != (entry.dtype, entry.shape):
            raise SnapshotRefused(SnapshotRefusal.OTHER_LAYOUT, f"{entry.key} is not the state's")
    expected = set(layout.value_keys) | set(_LOG_VALUES)
    if set(header.layout.value_keys) != expected:
        raise SnapshotRefused(SnapshotRefusal.OTHER_LAYOUT, "its plain values are not the state's")
    try:
        groups = json.loads(str(header.values[GROUPS]))
    except ValueError:
        groups = None
    present = header.values[PRESENT]
    if not isinstance(groups, list) or len(groups) != len(log.optimizer.param_groups):
        raise SnapshotRefused(SnapshotRefusal.OTHER_LAYOUT, "its parameter groups are not these")
    if not all(isinstance(group, dict) for group in groups):
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, "its parameter groups are not objects")
    if not isinstance(present, str) or len(present) != len(grads) or set(present) - {"0", "1"}:
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, "its gradients' presence is malformed")
    if header.values[STEPPED] not in (0, 1):
        raise SnapshotRefused(SnapshotRefusal.UNREADABLE, "its count of optimizer steps")


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
                param.grad = _grad_for(param, entry.view(data).clone()) if flag == "1" else None
            try:
                optimizer.step()
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


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters, in its groups' order."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def _grad_for(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    return dtensor_like(local, param) if isinstance(param, DTensor) else local


def _start(tensor: torch.Tensor) -> int:
    local = local_of(tensor) if isinstance(tensor, DTensor) else tensor
    return int(local.data_ptr())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
