"""Muon in the plan (``PlanOptions.optimizer="muon"``): its state and its owner's transient.

The planned program is docs/guide/muon.md's: ``shardkit.core.optim.Muon`` on the 2-D
parameters of the groups other than the root (a transformer's blocks: attention and MLP
matrices), ``torch.optim.AdamW`` on everything else (embeddings, head, norms, biases, which
sit in the root or are not 2-D).

- State: Muon keeps one buffer per matrix, the momentum, shaped as the local shard; AdamW two
  and its 4-byte ``step``.
- The step's transient (*approximate*; ``shardkit.core.optim.whole_matrix`` and ``exchange``):
  every rank keeps its rows of every matrix in bf16 for the step (what the first exchange
  sends); the owner receives its matrices whole (bf16), orthogonalizes them one shape at a
  time (a batch: its stack, the normalized copy, the next iterate, and the two (k, k) Gram
  products, k the smaller side), and keeps each whole update until the second exchange has
  sent it, whose buffers hold the owned updates out and this rank's rows back. The peak is
  the larger of the last batch's iteration and that second exchange, highest on the rank
  that owns the most (the largest matrices go first, to rank 0). Matrices whole on a rank
  (one shard rank) are updated one at a time, with no exchange. Owners are the core's own assignment
  (``assign_owners`` by Newton-Schulz cost), so the planned rank's share is what it will get.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from shardkit.core.optim.newton_schulz import newton_schulz_cost
from shardkit.core.optim.owners import assign_owners
from shardkit.tools.plan.groups import GroupSpec
from shardkit.tools.plan.options import PlanOptions

__all__ = ["Matrix", "matrices_scratch", "muon_step_scratch", "state_tensors", "takes_muon"]

_BF16 = 2  # bytes: Newton-Schulz's dtype, and the exchanges'

Matrix = tuple[tuple[int, int], int]
"""A Muon matrix as the planner sees it: its whole (m, n) and this rank's rows of it."""


def takes_muon(shape: Sequence[int], in_root: bool) -> bool:
    """Whether a trainable parameter takes Muon: 2-D and outside the root's group."""
    return len(shape) == 2 and not in_root


def state_tensors(options: PlanOptions, shape: Sequence[int], *, in_root: bool) -> int:
    """Optimizer state tensors of a trainable parameter: Muon's one, or AdamW's two beside it.

    Any other optimizer: its own count.
    """
    if options.optimizer != "muon":
        return options.num_states
    return 1 if takes_muon(shape, in_root) else 2


def muon_step_scratch(groups: Sequence[GroupSpec], root: int | None, rank: int) -> int:
    """:func:`matrices_scratch` of the model's Muon matrices, on the planned ``rank``."""
    matrices: list[Matrix] = []
    world = 1
    for i, group in enumerate(groups):
        for p in group.trainable:
            if takes_muon(p.shape, i == root):
                shape = (int(p.shape[0]), int(p.shape[1]))
                matrices.append((shape, p.local_numel(rank) // max(1, shape[1])))
                world = group.world  # one mesh: every group's shard axis is the same
    return matrices_scratch(matrices, rank, world)


def matrices_scratch(matrices: Sequence[Matrix], rank: int, world: int) -> int:
    """Bytes the Muon step allocates on ``rank`` of ``world`` beyond the state, at its peak.

    Args:
        matrices: every Muon matrix of the model, in the optimizer's order (the model's).
        rank: the planned rank on the shard axis.
        world: the shard axis' ranks (one exchange over them).
    """
    if not matrices:
        return 0
    shapes = [shape for shape, _ in matrices]
    rows = sum(local * shape[1] for shape, local in matrices) * _BF16
    if world == 1:  # every matrix whole here: updated one at a time, no exchange
        return rows + max(_batch_bytes(s, 1) for s in shapes)
    owners = assign_owners([newton_schulz_cost(s) for s in shapes], world)
    owned = [s for s, o in zip(shapes, owners, strict=True) if o == rank]
    wholes = sum(m * n for m, n in owned) * _BF16
    batch = max((_batch_bytes(s, count) for s, count in Counter(owned).items()), default=0)
    iterating = rows + 2 * wholes + batch  # received wholes and updates so far, last batch
    sending = 2 * rows + 3 * wholes  # rows, wholes, updates, the send and receive buffers
    return max(iterating, sending)


def _batch_bytes(shape: tuple[int, int], count: int) -> int:
    """Newton-Schulz's temporaries for ``count`` matrices of ``shape`` batched."""
    m, n = shape
    k = min(m, n)
    return count * (3 * m * n + 2 * k * k) * _BF16
