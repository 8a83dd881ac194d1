"""The seam: a whole-matrix optimizer as a rule of three functions, placed by the optimizer.

Muon, Dion, NorMuon, Shampoo: each updates a weight matrix from a function of the whole matrix
(its momentum, orthogonalized; its preconditioned gradient), which row blocks cannot compute.
A rule says only the arithmetic, in three parts:

- ``prepare``, elementwise, runs on each rank's rows of the parameter (or on a whole plain
  tensor): it updates the elementwise state (Muon's momentum) in place and returns the rows of
  the matrix to make whole;
- ``update`` runs once in the whole job, on the matrix's owner, on the whole matrix;
- ``apply``, elementwise again, runs on each rank's rows with the update's rows.

A rule may also give ``prepare`` and ``apply`` over a list of tensors at once (``prepare_all``,
``apply_all``, as it may give ``update_batch``): the same bits, in a few foreach operators a
step where one at a time is a few a matrix, each a launch on a GPU.

Everything else is :class:`~shardkit.core.optim.whole_matrix.WholeMatrixOptimizer`'s: which
rank owns which matrix (balanced by ``cost``), batching matrices of one shape on an owner, and
the two exchanges that carry rows to owners and updates back. Elementwise arithmetic on rows
has the bits it has on the whole tensor, so a rule written for one process gives the same bits
sharded. See the guide, docs/guide/muon.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.core.optim.newton_schulz import newton_schulz_cost

__all__ = ["ApplyAll", "Options", "PrepareAll", "WholeMatrixRule", "momentum_state"]

Options = Mapping[str, Any]
"""A parameter group's hyperparameters (the optimizer's ``param_groups[i]``)."""


PrepareAll = Callable[
    [list[torch.Tensor], list[torch.Tensor], list[dict[str, torch.Tensor]], Options],
    list[torch.Tensor],
]
"""(parameters' rows, gradients' rows, states' rows, options) -> ``prepare``'s result of each."""
ApplyAll = Callable[[list[torch.Tensor], list[torch.Tensor], Options, list[tuple[int, int]]], None]
"""(parameters' rows, updates' rows, options, each whole matrix's shape): ``apply`` of each."""


def momentum_state(grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """A rule's state of one buffer, zeros shaped as the (sharded) gradient: Muon's and most."""
    return {"momentum_buffer": torch.zeros_like(grad, memory_format=torch.preserve_format)}


def _always(device: torch.device) -> bool:
    del device
    return True


def _same_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype


@dataclass(frozen=True, kw_only=True, slots=True)
class WholeMatrixRule:
    """What a whole-matrix optimizer computes; where it computes it is not its concern."""

    name: str
    """Said in errors and stats ("Muon")."""
    init_state: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    """A parameter's first state, from its gradient (a DTensor like the parameter where the
    parameter is one): elementwise state only, shaped like the parameter."""
    prepare: Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], Options], torch.Tensor]
    """(parameter rows, gradient rows, state rows, options) -> the rows of the matrix that
    ``update`` takes whole. Elementwise; updates the state's tensors in place. Its dtype is what
    travels to the owner: return the narrowest that ``update`` reads (Muon: bf16)."""
    update: Callable[[torch.Tensor, Options], torch.Tensor]
    """(whole matrix (m, n), options) -> the whole update (m, n), on the matrix's owner."""
    update_batch: Callable[[torch.Tensor, Options], torch.Tensor] | None = None
    """(B, m, n) of one shape -> (B, m, n), each with ``update``'s bits; None: one at a time."""
    batches_on: Callable[[torch.device], bool] = _always
    """Whether ``update_batch`` batches on this device. Where it would only loop over the
    matrices, the optimizer calls ``update`` one at a time instead: stacking them for it would
    copy every matrix in and every update out, on the owner's peak, for nothing."""
    update_dtype: Callable[[torch.dtype], torch.dtype] = _same_dtype
    """The dtype ``update`` returns for a matrix of ``prepare``'s dtype: ranks size what they
    receive from it, before the owner has computed anything."""
    apply: Callable[[torch.Tensor, torch.Tensor, Options, tuple[int, int]], None]
    """(parameter rows, update rows, options, the whole matrix's shape): the step, in place."""
    prepare_all: PrepareAll | None = None
    """``prepare`` over one group's parameters at once, each with ``prepare``'s bits (foreach
    operators: a few launches a step, not a few a matrix); None: ``prepare`` one at a time."""
    apply_all: ApplyAll | None = None
    """``apply`` over matrices of one group at once, each with ``apply``'s bits; None: one at a
    time."""
    cost: Callable[[tuple[int, int]], int] = newton_schulz_cost
    """The work of one ``update`` on a matrix of this shape, in any unit: owners are balanced
    by it (Newton-Schulz's m * n * min(m, n) by default)."""
