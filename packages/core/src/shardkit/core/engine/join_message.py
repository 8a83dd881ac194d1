"""What the active ranks tell a joined rank under torch's ``Join``: one message per turn.

A rank out of batches sits in ``Join.__exit__``'s loop: each turn, torch all-reduces the
number of ranks still active (the active ranks' ``notify_join_context``), then calls the FSDP
join hook once (``engine/join``). The active ranks use that loop as a channel: every time they
are about to do something a joined rank must do too, they notify and all-reduce a
:class:`Message`, and the joined rank's turn does it. A joined rank adds zeros, so it reads
the active ranks' message (each active rank adds the same one; the count in slot 0 divides it
back).

A message is a header, ``HEADER_FIXED + max(1 + 3 * groups, 2)`` float64s, and, for some
kinds, a payload whose size both sides know from the header:

- ``ITERATION``: an iteration begins (the agreement): whether it has a backward and each
  group's ``reduce_grads``, ``all_reduce_grads`` and ``is_last_backward``.
- ``NORM``: a norm over gradients is about to be all-reduced (``torch.nn.utils.
  clip_grad_norm_`` and ``get_total_norm``): its order and foreach choice; payload, one
  flag per trainable parameter: whose gradients it covers.
- ``STEP``: the optimizer steps; payload, per trainable parameter, the factor its gradient
  was scaled by since the iteration's backward (gradient clipping's ``mul_``), 1 where none.
- ``FOREIGN``: a collective that a joined rank cannot shadow was issued; payload, its name.
  Every rank raises.
- ``NO_STEP``: an iteration that syncs gradients ended without an optimizer step (a step
  skipped for gradients that are not finite): the joined rank stops listening, skips it, and
  drops its gradients (``zero_grad()``), as a loop that skips a step does.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

__all__ = [
    "HEADER_FIXED",
    "NAME_SLOTS",
    "Kind",
    "Message",
    "decode_name",
    "encode_name",
    "header_size",
    "norm_body",
    "unshadowable_message",
]

HEADER_FIXED = 2
"""Slot 0: one per active rank; slot 1: the kind (times the count)."""

NAME_SLOTS = 96
"""A ``FOREIGN`` message's payload: the collective's name, one character a slot."""


class Kind(enum.IntEnum):
    """What a turn of the join loop is about."""

    ITERATION = 1
    NORM = 2
    STEP = 3
    FOREIGN = 4
    NO_STEP = 5


def header_size(groups: int) -> int:
    """The header's length for a root with ``groups`` parameter groups."""
    return HEADER_FIXED + max(1 + 3 * groups, 2)


@dataclass(frozen=True, slots=True)
class Message:
    """One turn's message, as summed over the join group and divided back by the count."""

    active: int
    """How many ranks are active: those that sent it."""
    kind: Kind
    body: list[float]
    """The header's slots after the first two, divided by ``active``."""

    @staticmethod
    def header(kind: Kind, body: list[float], groups: int) -> torch.Tensor:
        """An active rank's header: ``body`` padded to the size both sides use."""
        vector = torch.zeros(header_size(groups), dtype=torch.float64)
        vector[0], vector[1] = 1.0, float(kind)
        vector[HEADER_FIXED : HEADER_FIXED + len(body)] = torch.tensor(body, dtype=torch.float64)
        return vector

    @staticmethod
    def of(summed: torch.Tensor) -> Message:
        """Decode a summed header; a count of zero cannot reach a joined rank's turn."""
        values = summed.tolist()
        active = round(values[0])
        assert active > 0, "a joined rank's turn with no active rank"
        kind = Kind(round(values[1] / active))
        return Message(active, kind, [v / active for v in values[HEADER_FIXED:]])

    # --- ITERATION ------------------------------------------------------------------------

    @property
    def backward(self) -> bool:
        """Whether the iteration has a backward (a forward with gradients)."""
        return self.body[0] > 0

    def flags(self, which: int) -> list[bool]:
        """Per group: ``reduce_grads`` (0), ``all_reduce_grads`` (1), ``is_last_backward`` (2).

        A flag counts as set where any active rank set it (as before this message had kinds).
        """
        groups = (len(self.body) - 1) // 3
        return [self.body[1 + 3 * g + which] > 0 for g in range(groups)]

    @property
    def steps(self) -> bool:
        """Whether an ``ITERATION`` ends in an optimizer step: it reduces, as the last backward.

        The joined ranks then listen, after their dry iteration, until the step.
        """
        if self.kind is not Kind.ITERATION or not self.backward:
            return False
        return any(self.flags(0)) and all(self.flags(2))

    # --- NORM -----------------------------------------------------------------------------

    @property
    def norm_type(self) -> float:
        """A ``NORM``'s order (``inf`` for the max norm)."""
        return self.body[0]

    @property
    def foreach(self) -> bool | None:
        """A ``NORM``'s foreach argument, as the active ranks' norm operators show it."""
        code = round(self.body[1])
        return None if code == 0 else code == 1


def norm_body(norm_type: float, foreach: bool | None) -> list[float]:
    """A ``NORM`` header's body: the order (``inf`` travels as itself) and foreach."""
    assert not math.isnan(norm_type)
    return [norm_type, 0.0 if foreach is None else (1.0 if foreach else 2.0)]


def encode_name(name: str) -> torch.Tensor:
    """A ``FOREIGN`` payload: ``name``'s characters (cut to fit), one per slot."""
    codes = [float(ord(c)) for c in name[:NAME_SLOTS]]
    return torch.tensor(codes + [0.0] * (NAME_SLOTS - len(codes)), dtype=torch.float64)


def decode_name(summed: torch.Tensor, active: int) -> str:
    """The name in a summed ``FOREIGN`` payload."""
    codes = [round(v / active) for v in summed.tolist()]
    return "".join(chr(c) for c in codes if c > 0)


def unshadowable_message(name: str, module_name: str) -> str:
    """The error every rank raises for ``name``, which a joined rank cannot shadow."""
    return (
        f"Join([{module_name}]): {name} was issued while a rank is out of batches, outside "
        "what its join hook shadows (the engine's collectives, gradient norms and their "
        "clipping, the optimizer step); that rank cannot issue it. Issue it outside the Join, "
        "or shadow it with a torch Joinable of your own passed to Join beside the model (see "
        "docs/guide/not-spmd.md)"
    )
