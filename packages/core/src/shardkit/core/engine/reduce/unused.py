"""Parameters that got no gradient on this rank: zeros on the wire, None where no rank used one.

A parameter of a module that ran on every rank may get a gradient on some ranks and none on
others (an expert no token reached, a head a batch did not need). torch packs only the
gradients a rank has, so the ranks' reductions differ in size and fail or hang (torch 2.13 adds
an opt-in, ``set_reduce_scatter_unused_params``, that reduces zeros and leaves zeros). Here the
missing gradients are reduced as zeros by default, so every rank's reduction has the same size
and the ranks that used the parameter get the mean they expect; a parameter that no rank used
must still end with ``grad`` None, as torch gives it and as optimizers expect (a zero gradient
moves a parameter through weight decay and momentum).

Which parameters no rank used is learnt without a collective of its own: each rank flags the
parameters it reduced as zeros and never used since the last step check, and the check's
exchange (``runtime/watch/step_check.py``) ANDs the flags over every rank. A parameter flagged on
every rank whose gradient this rank created from zeros gets None back. On an accelerator, a
rank that flagged a parameter reads the combined flags at the end of backward: one wait for
the device in such steps only (a program where every rank used every parameter never waits).
See [Note: step check].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardkit.core.engine.param import FSDPParam
from shardkit.core.runtime.watch.progress import SETTINGS

__all__ = ["UnusedGrads"]

Taken = list[tuple[FSDPParam, torch.Tensor | None]]


class UnusedGrads:
    """One group's parameters reduced as zeros since the last step check (this rank's)."""

    def __init__(self) -> None:
        # id(param) -> (param, whether its sharded gradient was None when zeros were taken)
        self._zeroed: dict[int, tuple[FSDPParam, bool]] = {}
        # HSDP with the all-reduce deferred (set_requires_all_reduce(False)): parameters whose
        # real gradients wait in the group's partial sum. Unused in the backward that finally
        # all-reduces, they still get that sum, never None; kept until the sum is assigned.
        self._carried: set[int] = set()
        self._deferring = False
        # Parameters this rank reduced a real gradient of since the last check. A group that
        # reduces twice in one backward (gradients that came after its end) must not flag
        # them as unused in the second reduction, or the check would erase the first one's.
        self._used: set[int] = set()

    def choose(self, grads: Taken, *, world: int, ran_forward: bool) -> Taken:
        """What to reduce of ``grads`` (one per trainable parameter; None: no gradient).

        Every gradient, None ones reduced as zeros, when the step check can tell afterwards
        whether any rank used them; else the ones present (torch's way, which a parameter used
        on some ranks only cannot train with). ``ran_forward``: the group ran forward with
        gradients enabled since its last reduction, so another rank may reduce it even where
        this one has no gradient at all.
        """
        present: Taken = [(p, g) for p, g in grads if g is not None]
        for p, _ in present:
            self._used.add(id(p))
            self._zeroed.pop(id(p), None)  # used after all: its gradient is a real one
        if len(present) == len(grads):
            return grads
        if not present and not ran_forward:
            return []
        if not self.fills([p for p, _ in grads], world):
            return present
        for p, g in grads:
            if g is None and id(p) not in self._zeroed and id(p) not in self._used:
                self._zeroed[id(p)] = (p, p.sharded_param.grad is None)
        return grads

    @staticmethod
    def fills(trainable: Sequence[FSDPParam], world: int) -> bool:
        """Whether a missing gradient among ``trainable`` is reduced as zeros (automatically)."""
        # Zeros need one dtype on every rank, which grad_dtype=None leaves to each gradient;
        # without the step check nothing would give None back to a parameter no rank used.
        if world == 1 or not SETTINGS.step_checks:
            return False
        return not any(p.grad_accumulation.any_dtype for p in trainable)

    def flag(self, flags: bytearray, offset: int, trainable: Sequence[FSDPParam]) -> bool:
        """Set ``flags[offset + i]`` for each trainable parameter ``i`` reduced as zeros only.

        Returns whether any was.
        """
        if not self._zeroed:
            return False
        for i, p in enumerate(trainable):
            if id(p) in self._zeroed:
                flags[offset + i] = 1
        return True

    def defer(self, params: Sequence[FSDPParam]) -> None:
        """A reduction of ``params`` stays partial: carry those with real gradients in it."""
        self._carried.update(id(p) for p in params if id(p) not in self._zeroed)
        self._deferring = True

    def fold(self) -> None:
        """The partial sum went into a reduction that all-reduces and assigns."""
        self._deferring = False

    def settle(self, unused: bytes | None, offset: int, trainable: Sequence[FSDPParam]) -> None:
        """Give None back where no rank used a parameter (``unused``: the ANDed flags).

        Only to gradients this rank created from zeros: one that held a value before keeps it
        (the zeros added nothing to it), and so does one whose earlier gradients a deferred
        all-reduce carried into this sum.
        """
        zeroed, self._zeroed = self._zeroed, {}
        self._used.clear()
        carried = self._carried
        if not self._deferring:
            self._carried = set()
        if unused is None:
            return
        for i, p in enumerate(trainable):
            entry = zeroed.get(id(p))
            if entry is not None and entry[1] and unused[offset + i] and id(p) not in carried:
                p.sharded_param.grad = None

    def forget(self) -> None:
        """Drop the record (recovery after an exception, or a check that did not run)."""
        self._zeroed.clear()
        self._used.clear()
        self._carried.clear()
        self._deferring = False
