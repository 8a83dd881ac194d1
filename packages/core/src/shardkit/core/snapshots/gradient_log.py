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

An entry is a snapshot in the same format (``format``): its layout lists the gradients
first (``log/grad/00000`` on, in the optimizer's parameter order, each as the parameter's local
shard), then the carried tensors under their own keys; its plain values are the step's and the
log's own, under ``log/``. Reading and replaying entries: ``log_replay``. See [Note:
memory snapshots].
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

from shardkit.core.runtime.device import can_pin_memory, is_accelerator
from shardkit.core.runtime.dtensors import local_of
from shardkit.core.snapshots.checksum import checksum_count, checksums_of
from shardkit.core.snapshots.contents import JSONValue, Layout, Leaves, TensorEntry, dtype_named
from shardkit.core.snapshots.format import (
    REGION_AT,
    Header,
    data_offset,
    header_region,
    layout_json_of,
)
from shardkit.core.snapshots.slots import Topology

__all__ = ["GradientLog", "LogEntry", "LogPlan", "entry_capacity", "local_shard", "params_of"]

_ALIGN = 64  # as the layout aligns tensors
GRAD = "log/grad/"
BASE = "log/base"  # the step of the full replica the entry follows
STEPPED = "log/stepped"  # optimizer steps since the snapshot before (1; 0 if none ran)
GROUPS = "log/groups"  # the parameter groups' values at the step, JSON text
PRESENT = "log/present"  # "1" for each parameter that had a gradient, else "0"
FULL_SUMS = "log/full_checksums"  # the step's full snapshot's checksums, hex
UNUSABLE = "log/unusable"  # why this entry cannot be replayed ("" when it can)
LOG_VALUES = (BASE, FULL_SUMS, GROUPS, PRESENT, STEPPED, UNUSABLE)


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
            local = local_shard(param)
            nbytes = local.numel() * local.element_size()
            dtype = str(local.dtype).removeprefix("torch.")
            shapes = tuple(local.shape), tuple(param.shape)
            entries.append(TensorEntry(f"{GRAD}{index:05d}", dtype, *shapes, offset, nbytes))
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
        values = tuple(sorted(layout.value_keys + LOG_VALUES))
        return LogPlan(Layout(tuple(entries), values, offset), grads_end, tuple(carried))


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One step's capture, ready for the background thread to finish and send."""

    buffer: torch.Tensor  # the entry's bytes from offset 0 (header region, then data)
    stepped: int
    groups: str
    present: str
    problem: str
    staged: torch.Tensor | None = None  # the gradients on their device, where they are there
    captured: Any = None  # the device's event after they were staged (None on the host)


class GradientLog:
    """Takes the gradients an optimizer consumes at each step, for the replicas' log entries.

    A step pre-hook on ``optimizer`` copies every parameter's gradient (its local shard) into
    its place in one of two buffers, in one multi-tensor copy: one entry is being sent while
    the next is taken. An accelerator's gradients are copied on the device, in stream order
    (the hook only launches it), and the background thread moves them to the host on a stream
    of its own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = params_of(optimizer)
        self.plan: LogPlan | None = None
        self.capacity = 0
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._device = torch.device("cpu")  # where the gradients are
        self._staged: list[torch.Tensor] = []  # two device buffers, where they are not here
        self._events: list[Any] = [None, None]
        self._module: Any = None  # the device's module (torch.cuda), for streams and events
        self._copy_stream: Any = None
        self._places: list[list[torch.Tensor]] = [[], []]  # each gradient's, in each target
        self._stepped, self._problem = 0, ""
        self._groups, self._present = "[]", ""
        self._replaying = False
        self._layout_json = ""
        self._expected: list[tuple[torch.dtype, tuple[int, ...]]] = []  # each gradient's
        self._handle = optimizer.register_step_pre_hook(self._capture)

    @property
    def data_bytes(self) -> int:
        """The size of an entry's data (0 before ``start``)."""
        return self.plan.layout.data_bytes if self.plan is not None else 0

    def start(
        self,
        plan: LogPlan,
        topology: Topology,
        full: Layout,
        values: dict[str, JSONValue],
        device: torch.device | None = None,
    ) -> None:
        """Allocate the two entry buffers (the first snapshot, before its entries are taken).

        ``full``: the full snapshot's layout; ``values``: the state's plain values now (for
        the headers' room); ``device``: the accelerator the state lives on, if it does
        (``staging_device``; the host itself only in tests: the same steps, no streams).
        """
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        described = json.dumps(groups, default=repr)
        capacity = entry_capacity(topology, plan, full.data_bytes, values, described)
        self.plan, self.capacity = plan, capacity
        self._layout_json = layout_json_of(plan.layout)  # every entry's header repeats it
        size = data_offset(capacity) + plan.layout.data_bytes
        pin = device is not None and is_accelerator(device) and can_pin_memory()
        self._buffers = [torch.zeros(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        grads = plan.layout.entries[: len(self.params)]
        self._expected = [(dtype_named(e.dtype), e.shape) for e in grads]
        self._device = device if device is not None else torch.device("cpu")
        start = data_offset(capacity)
        targets = [buffer[start : start + plan.grads_end] for buffer in self._buffers]
        if device is not None:
            # Zeroed once, as the host buffers are: the gaps between gradients are never
            # written, and an entry's bytes must not depend on what memory held before.
            self._staged = [
                torch.zeros(plan.grads_end, dtype=torch.uint8, device=device) for _ in range(2)
            ]
            targets = self._staged
            if device.type != "cpu":
                self._module = torch.get_device_module(device)
                self._copy_stream = self._module.Stream(device=device)
        # Each gradient's place in each target, as a tensor of its dtype and shape: a step's
        # capture is then one multi-tensor copy, with no per-gradient view to make.
        self._places = [[entry.view(target) for entry in grads] for target in targets]
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
        if entry.staged is not None:
            self._to_host(entry, data[: self.plan.grads_end])
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
        staged = self._staged[self._next] if self._staged else None
        entry = LogEntry(
            self._buffers[self._next],
            self._stepped,
            self._groups,
            self._present,
            problem,
            staged,
            self._events[self._next],
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
        places = self._places[self._next]
        sources, targets, absent, present = [], [], [], []
        for param, place, (dtype, shape) in zip(self.params, places, self._expected, strict=True):
            grad = param.grad
            local = local_shard(grad) if grad is not None else None
            if local is not None and (
                local.dtype != dtype or local.shape != shape or local.device != self._device
            ):
                self._problem = (
                    f"a gradient ({local.dtype}, {tuple(local.shape)} on {local.device}) is "
                    f"not its parameter's local shard's ({dtype}, {shape} on {self._device})"
                )
                local = None
            if local is None:
                absent.append(place)
                present.append("0")
            else:
                sources.append(local)
                targets.append(place)
                present.append("1")
        self._present = "".join(present)
        with torch.no_grad():
            if sources:
                torch._foreach_copy_(targets, sources)
            for place in absent:  # the previous capture's bytes in this buffer: zeros now
                place.zero_()
        if self._module is not None:  # after the step's gradients, before the next step's
            self._events[self._next] = self._module.Event()
            self._events[self._next].record(self._module.current_stream(self._device))

    def _to_host(self, entry: LogEntry, grads: torch.Tensor) -> None:
        """The staged gradients into the entry's bytes (background thread).

        On a stream of its own: the training's kernels never queue behind the copy.
        """
        assert entry.staged is not None
        if self._module is None:  # the host standing in for a device (tests)
            grads.copy_(entry.staged)
            return
        with self._module.stream(self._copy_stream):
            if entry.captured is not None:
                self._copy_stream.wait_event(entry.captured)
            grads.copy_(entry.staged, non_blocking=True)
            done = self._module.Event()
            done.record(self._copy_stream)
        done.synchronize()


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


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters, in its groups' order."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, or the tensor itself: what this rank holds of it."""
    return local_of(tensor) if isinstance(tensor, DTensor) else tensor


def _start(tensor: torch.Tensor) -> int:
    return int(local_shard(tensor).data_ptr())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
