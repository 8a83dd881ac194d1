"""Where this rank is: its step, its phase, the last collective it reached and what it waits on.

The runtime records every collective it issues as a :class:`CollectiveInfo`, the fingerprint
that desync checks compare across ranks and that hang reports show. The hooks tell the phase
(forward, backward, idle) and a global optimizer hook counts steps. Recording costs a few
attribute writes per collective; nothing is sent anywhere unless a check or a report asks.

The settings come from the environment (``SHARDKIT_DEBUG``, ``SHARDKIT_HANG_TIMEOUT``,
``SHARDKIT_COLLECTIVE_BOUND``, ``SHARDKIT_DEBUG_LIFETIMES``) and can be changed in code
(:func:`set_debug`, :func:`set_hang_timeout`, :func:`set_collective_bound`,
``SETTINGS.lifetime_checks``). See [Note: desync checks].
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = [
    "FINGERPRINT_BYTES",
    "PROGRESS",
    "SETTINGS",
    "CollectiveInfo",
    "Progress",
    "Settings",
    "set_collective_bound",
    "set_debug",
    "set_hang_timeout",
]

logger = logging.getLogger(__name__)

_KINDS = {
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
}
# seq, bytes, step; kind, phase, dtype; label (the module's FQN, truncated).
_LAYOUT = struct.Struct("<qqq16s16s16s192s")
FINGERPRINT_BYTES = _LAYOUT.size
"""Bytes of one encoded fingerprint."""


@dataclass(frozen=True, slots=True)
class CollectiveInfo:
    """One collective as this rank issued it: what desync checks compare across ranks."""

    seq: int
    """Its number among this runtime's collectives on its process group (1, 2, ...)."""
    kind: str
    """'all_gather', 'reduce_scatter' or 'all_reduce'."""
    label: str
    """The module whose parameters or gradients it carries ('' when not given)."""
    nbytes: int
    """Bytes this rank contributes."""
    dtype: str
    """The dtype of what it carries."""
    phase: str
    """'forward', 'backward' or 'idle' when it was issued."""
    step: int
    """The training step it belongs to (1-based): one more than the optimizer steps taken
    after a backward (several optimizers stepping after one backward count once)."""

    def describe(self) -> str:
        """E.g. 'all-gather of blocks.2 in forward, step 3'."""
        kind = _KINDS.get(self.kind, self.kind)
        return f"{kind} of {self.label or '<root>'} in {self.phase}, step {self.step}"

    def detail(self) -> str:
        """:meth:`describe` with the sequence number, bytes and dtype."""
        return f"{self.describe()} (#{self.seq}, {self.nbytes} bytes of {self.dtype})"

    def encode(self) -> bytes:
        """A fixed-size record (:data:`FINGERPRINT_BYTES`)."""
        fields = (self.kind, self.phase, self.dtype, self.label)
        return _LAYOUT.pack(self.seq, self.nbytes, self.step, *(f.encode() for f in fields))

    @staticmethod
    def decode(data: bytes) -> CollectiveInfo:
        """The info that :meth:`encode` wrote (a label cut mid-character loses that character)."""
        seq, nbytes, step, *texts = _LAYOUT.unpack(data)
        kind, phase, dtype, label = (t.rstrip(b"\0").decode(errors="ignore") for t in texts)
        return CollectiveInfo(seq, kind, label, nbytes, dtype, phase, step)


@dataclass(slots=True)
class Settings:
    """The debugging switches (process-wide)."""

    desync_checks: bool
    """Compare every collective's fingerprint across ranks before its result is used."""
    hang_timeout_s: float
    """Seconds a collective may wait before the rank reports and exits; 0 turns it off."""
    lifetime_checks: bool = False
    """Check that no buffer is released while a collective not yet waited for uses it
    (``SHARDKIT_DEBUG_LIFETIMES``; see ``runtime/watch/lifetimes.py``)."""
    step_checks: bool = True
    """Compare every rank's collectives once per step (``SHARDKIT_STEP_CHECK``, on unless
    set to 0; see ``runtime/watch/step_check.py``)."""
    collective_bound_s: float = 5.0
    """Seconds a wait in an engine collective lasts before the ranks compare what they wait
    on, through the store, and raise if they cannot pair (``SHARDKIT_COLLECTIVE_BOUND``; 0
    turns it off; see ``runtime/watch/stuck.py``)."""


def _switched_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "off")


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, str(default))
    try:
        return max(float(raw), 0.0)
    except ValueError:
        logger.warning("%s=%r is not a number of seconds; using %g", name, raw, default)
        return default


def _from_environment() -> Settings:
    debug = _switched_on("SHARDKIT_DEBUG")
    timeout = _seconds("SHARDKIT_HANG_TIMEOUT", 300.0)
    lifetimes = _switched_on("SHARDKIT_DEBUG_LIFETIMES")
    step_checks = os.environ.get("SHARDKIT_STEP_CHECK", "1").strip().lower() not in _OFF
    bound = _seconds("SHARDKIT_COLLECTIVE_BOUND", 5.0)
    return Settings(debug, timeout, lifetimes, step_checks, collective_bound_s=bound)


_OFF = ("0", "false", "off", "no")


SETTINGS = _from_environment()
"""The settings in force (``SHARDKIT_DEBUG``, ``SHARDKIT_HANG_TIMEOUT``,
``SHARDKIT_COLLECTIVE_BOUND``, ``SHARDKIT_DEBUG_LIFETIMES``, ``SHARDKIT_STEP_CHECK``, or set in
code)."""


def set_debug(enabled: bool = True) -> None:
    """Check every shardkit collective's fingerprint across ranks (as ``SHARDKIT_DEBUG=1``).

    Call it on every rank, between steps. The first mismatch raises :class:`DesyncError` on
    every rank, naming what each rank was about to do.
    """
    SETTINGS.desync_checks = bool(enabled)


def set_hang_timeout(seconds: float) -> None:
    """Seconds a collective may wait before the rank reports and exits (0: never).

    The same as ``SHARDKIT_HANG_TIMEOUT``; the default is 300.
    """
    if seconds < 0:
        raise ValueError(f"set_hang_timeout takes seconds >= 0 (0 turns it off), got {seconds}")
    SETTINGS.hang_timeout_s = float(seconds)


def set_collective_bound(seconds: float) -> None:
    """Seconds an engine collective may wait before the ranks look whether it can ever pair.

    The same as ``SHARDKIT_COLLECTIVE_BOUND``; the default is 5, 0 turns the look off. When
    every rank has waited that long in one of the engine's collectives and they do not all
    wait on the same one, every rank raises
    :class:`~shardkit.core.errors.StuckCollectiveError` naming what each waits on. Set it on
    every rank, above the longest time one collective's transfer takes.
    """
    if seconds < 0:
        raise ValueError(f"set_collective_bound takes seconds >= 0 (0: off), got {seconds}")
    SETTINGS.collective_bound_s = float(seconds)


# A step's forward is rarely longer; a longer one is compared on its first modules only, which
# keeps the record a stuck rank posts small.
_FORWARD_MODULES_KEPT = 4096


class Progress:
    """This rank's position in training, updated by the hooks and the runtime."""

    def __init__(self) -> None:
        self.steps_taken = 0
        self.phase = "idle"
        self.last: CollectiveInfo | None = None
        """The last collective issued."""
        self.waiting: CollectiveInfo | None = None
        """The collective being waited on now, if any."""
        self.waiting_since = 0.0  # time.monotonic() when the wait began
        self.waiting_works: Sequence[object] = ()
        """The c10d works of the wait, which the stuck check may break
        (``runtime/watch/stuck.py``)."""
        self.version = 0  # bumped on every change the hang watch publishes
        self._hook: Any = None
        self._backward_since_step = False
        self.forward_modules: list[str] = []
        """The sharded modules the latest forward entered, in order: where ranks that wait on
        collectives that cannot pair went apart (``runtime/watch/stuck.py``)."""

    @property
    def step(self) -> int:
        """The step in progress (1-based)."""
        return self.steps_taken + 1

    def enter(self, phase: str) -> None:
        """The hooks say the phase changed ('forward', 'backward', 'idle')."""
        if phase != self.phase:
            if phase == "forward":
                self.forward_modules = []
            self.phase = phase
            self.version += 1
            self._backward_since_step |= phase == "backward"

    def ran_forward(self, fqn: str) -> None:
        """A sharded module's forward began (the first module of a list group's)."""
        if len(self.forward_modules) < _FORWARD_MODULES_KEPT:
            self.forward_modules.append(fqn or "<root>")

    def issued(self, info: CollectiveInfo) -> None:
        """The runtime issued ``info``."""
        self.last = info
        self.version += 1

    def begin_wait(self, info: CollectiveInfo, works: Sequence[object] = ()) -> None:
        """A wait on ``info`` (on ``works``, its c10d works) begins."""
        self.waiting = info
        self.waiting_works = works
        self.waiting_since = time.monotonic()
        self.version += 1

    def end_wait(self) -> None:
        """The wait is over (done or raised)."""
        self.waiting = None
        self.waiting_works = ()
        self.version += 1

    def count_optimizer_steps(self) -> None:
        """Count every optimizer step from now on (installed once, at the first root)."""
        if self._hook is None:
            self._hook = register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # One training step however many optimizers step after its backward(s); optimizer
        # steps in backward (optimizer-in-backward hooks) count once per backward too.
        if self._backward_since_step:
            self._backward_since_step = False
            self.steps_taken += 1
            self.version += 1


PROGRESS = Progress()
"""This process's progress (one rank per process)."""
