"""Muon in the plan (``PlanOptions.optimizer="muon"``): its state and its owner's transient.

The planned program is docs/guide/muon.md's: ``shardkit.core.optim.Muon`` on the 2-D
parameters of the groups other than the root (a transformer's blocks: attention and MLP
matrices), ``torch.optim.AdamW`` on everything else (embeddings, head, norms, biases, which
sit in the root or are not 2-D).

- State: Muon keeps one buffer per matrix, the momentum, shaped as the local shard; AdamW two
  and its 4-byte ``step``.
- The step's transient (*approximate*; ``shardkit.core.optim.whole_matrix`` and ``exchange``):
  every rank keeps its rows of every matrix in bf16 until the first exchange is in (what it
  sends); the owner joins its matrices whole (bf16) from them and the received blocks,
  orthogonalizes them one at a time (an iterate and the next one beside it, and the two
  (k, k) Gram products, k the smaller side), lets each whole go once orthogonalized, and
  keeps each update until the second exchange has sent it, whose buffers hold the owned
  updates' blocks out and this rank's rows back. The peak is the largest of those three
  moments (:func:`_scratch`), highest on the rank that owns the most. Matrices whole on a rank
  (one shard rank) are updated one at a time, with no exchange. Owners are the core's own assignment
  (``assign_owners`` by Newton-Schulz cost), so the planned rank's share is what it will get.
- The step's collectives and work (:func:`muon_step`): the two all-to-alls of the exchange
  (rows to owners, update rows back) over every rank of the FSDP or HSDP mesh, sized by the
  core's own routes (``shardkit.core.optim.exchange.routes``) on the blocks each rank holds, and
  this rank's Newton-Schulz on the matrices it owns (:func:`newton_schulz_costs`: five
  iterations of three matrix multiplies each, in bf16; the norm and the division are left out).
  With tensor parallelism the exchange runs over the whole (dp, tp) mesh, a matrix's blocks
  cut by TP and then by FSDP (``muon_blocks.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardkit.core.optim.newton_schulz import newton_schulz_cost
from shardkit.core.optim.owners import assign_owners
from shardkit.core.optim.routes import routes, row_joins
from shardkit.tools.plan.groups import GroupSpec
from shardkit.tools.plan.muon_blocks import TPCuts, matrix_placement
from shardkit.tools.plan.op_costs import OpCost
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.units import format_bytes

__all__ = [
    "Matrix",
    "format_muon_step",
    "MuonStep",
    "matrices_scratch",
    "muon_exchange_calls",
    "muon_step",
    "step_scratch",
    "newton_schulz_costs",
    "state_tensors",
    "takes_muon",
]

_NS_STEPS = 5  # torch's Muon's default, which shardkit's keeps

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
    held = sum(local * shape[1] for shape, local in matrices)
    if world == 1:
        return _scratch(held, shapes, world)
    costs = [newton_schulz_cost(s) for s in shapes]
    owners = assign_owners(costs, world, tall=[m > n for m, n in shapes])
    return _scratch(held, [s for s, o in zip(shapes, owners, strict=True) if o == rank], world)


def step_scratch(step: MuonStep | None) -> int:
    """:func:`matrices_scratch` of a planned step: its rank's elements and owned matrices.

    The core's own owners over the whole mesh (HSDP's replicas, TP's ranks too) and the
    elements of the blocks the rank holds (TP's and FSDP's cut).
    """
    if step is None:
        return 0
    moved = None
    if len(step.calls) == 2 and len(step.received) == 2:
        (_, rows_out), (_, updates_out) = step.calls
        moved = (rows_out, step.received[0], updates_out, step.received[1])
    return _scratch(step.held, list(step.owned), step.world, moved, step.early)


def _scratch(
    held: int,
    owned: Sequence[tuple[int, int]],
    world: int,
    moved: tuple[int, int, int, int] | None = None,
    early: int = 0,
) -> int:
    """The step's peak beyond the state: ``held`` elements of rows, ``owned`` whole here.

    Four moments, each holding what the core's step holds then (the rows let go of once the
    first exchange is in, the wholes once orthogonalized, each exchange's buffers once read):
    the first exchange posted (the rows, both its buffers, the wholes made before it is in),
    the wholes being joined (the rows, the received blocks of the owned matrices, the wholes),
    the last matrix orthogonalized (the wholes, the updates so far, one matrix's
    temporaries: no device batches yet, ``newton_schulz.batches_on``), and the updates sent
    (the updates, the blocks of them that leave, this rank's rows that come back).
    """
    rows = held * _BF16
    if world == 1:  # every matrix whole here: updated one at a time, no exchange
        return rows + max((_newton_schulz_bytes(s) for s in owned), default=0)
    wholes = sum(m * n for m, n in owned) * _BF16
    if moved is None:  # rows cut evenly: the other ranks hold (W - 1) / W of each matrix
        others = (world - 1) / world
        theirs = int(others * rows)
        moved = (theirs, int(others * wholes), int(others * wholes), theirs)
    rows_out, blocks_in, updates_out, rows_back = moved
    one_at_a_time = max((_newton_schulz_bytes(s) for s in set(owned)), default=0)
    posting = rows + rows_out + blocks_in + early
    joining = rows + blocks_in + wholes
    iterating = 2 * wholes + one_at_a_time
    sending = wholes + updates_out + rows_back
    return max(posting, joining, iterating, sending)


def _newton_schulz_bytes(shape: tuple[int, int]) -> int:
    """Newton-Schulz's temporaries for one matrix of ``shape``.

    An iterate and the next one beside it (the first is the normalized copy), and the two
    (k, k) Gram products.
    """
    m, n = shape
    k = min(m, n)
    return (2 * m * n + 2 * k * k) * _BF16


@dataclass(frozen=True, kw_only=True, slots=True)
class MuonStep:
    """Muon's step on the planned rank: its share of Newton-Schulz and the exchange."""

    world: int
    """Ranks the exchange runs over: every rank of the mesh (HSDP's replicas too)."""
    matrices: int
    """Muon's matrices in the model."""
    owned: tuple[tuple[int, int], ...]
    """The shapes this rank orthogonalizes, in the step's order."""
    flops: int
    """Newton-Schulz's FLOPs on them (a multiply-add is two)."""
    calls: tuple[tuple[int, int], ...]
    """(input bytes, sent bytes) of each all-to-all, in issue order: rows out, update back."""
    held: int = 0
    """Elements of Muon's matrices this rank holds (its blocks)."""
    received: tuple[int, ...] = ()
    """Bytes each all-to-all brings this rank from the others, in ``calls``' order."""
    early: int = 0
    """Bytes of the owned matrices made whole before the first exchange is in: those whose
    blocks are not full-width rows (TP's column blocks) are copied into place as they come,
    where row blocks are joined by one ``cat`` once all is in."""


def muon_step(
    groups: Sequence[GroupSpec],
    root: int | None,
    shard_rank: int,
    replicas: int,
    replica: int,
    tp: tuple[int, int, TPCuts] | None = None,
) -> MuonStep | None:
    """Muon's step on the rank at ``shard_rank`` of replica ``replica`` (None: no matrices).

    Args:
        groups: the plan's groups; Muon takes the 2-D parameters outside ``root``'s.
        root: the root group's index (its parameters take AdamW).
        shard_rank: the planned rank on the shard axis.
        replicas: HSDP's replicas (1: FSDP).
        replica: the planned rank's replica.
        tp: with tensor parallelism, (tp degree, the planned rank on tp, the matrices' whole
            shapes and TP's dims): the exchange then runs over the whole mesh
            (``muon_blocks.py``).
    """
    params = [
        p for i, g in enumerate(groups) for p in g.trainable if takes_muon(p.shape, i == root)
    ]
    if not params:
        return None
    shards = groups[0].world
    degree, tp_rank, cuts = tp if tp is not None else (1, 0, None)
    world = shards * replicas * degree
    placements = [matrix_placement(p, shards, replicas, degree, cuts) for p in params]
    costs = [newton_schulz_cost(m.shape) for m in placements]
    # The flattened (replicate, shard, tp) mesh's order.
    rank = (replica * shards + shard_rank) * degree + tp_rank
    if world == 1:  # every matrix whole here: no exchange
        owned = tuple(m.shape for m in placements)
        held = sum(m * n for m, n in owned)
        return MuonStep(
            world=1, matrices=len(params), owned=owned, flops=_flops(owned), calls=(), held=held
        )
    owners = assign_owners(
        costs, world, [m.whole_on() for m in placements], [m.tall for m in placements]
    )
    bf16 = [torch.bfloat16] * len(placements)
    there, home = routes(placements, owners, bf16, bf16, rank)
    owned = tuple(m.shape for m, o in zip(placements, owners, strict=True) if o == rank)
    calls = tuple((r.traffic().sent, r.traffic().sent) for r in (there, home))  # no own part
    held = sum(m.blocks[rank].shape[0] * m.blocks[rank].shape[1] for m in placements)
    joined = row_joins(there, placements)
    return MuonStep(
        world=world,
        matrices=len(params),
        owned=owned,
        flops=_flops(owned),
        calls=calls,
        held=held,
        received=tuple(r.traffic().received for r in (there, home)),
        early=sum(
            placements[i].shape[0] * placements[i].shape[1] * _BF16
            for i in there.owned
            if i not in joined
        ),
    )


def muon_exchange_calls(step: MuonStep | None) -> tuple[tuple[int, int, int], ...]:
    """(ranks, input bytes, sent bytes) of each all-to-all of Muon's step on the planned rank.

    None where there is no step or every matrix is whole here: an empty tuple.
    """
    if step is None:
        return ()
    return tuple((step.world, input_bytes, sent) for input_bytes, sent in step.calls)


def newton_schulz_costs(step: MuonStep) -> tuple[OpCost, ...]:
    """The matrix multiplies of this rank's Newton-Schulz, in bf16.

    Per iteration on a k x K matrix (k its smaller side): the Gram matrix (k x K by K x k),
    its polynomial (k x k by k x k) and the update (k x k by k x K), each ``_NS_STEPS`` times
    per owned matrix.
    """
    found: list[OpCost] = []
    for (m, n), count in Counter(step.owned).items():
        k, big = min(m, n), max(m, n)
        for flops, elements in (
            (2 * k * k * big, k * big + k * k),  # gram = X X^T
            (2 * k * k * k, 3 * k * k),  # b G + c G G
            (2 * k * k * big, k * k + 2 * k * big),  # a X + P X
        ):
            found.append(OpCost(flops, 2 * elements, "bfloat16", count * _NS_STEPS))
    return tuple(found)


def _flops(owned: Sequence[tuple[int, int]]) -> int:
    total = 0
    for m, n in owned:
        k, big = min(m, n), max(m, n)
        total += _NS_STEPS * (4 * k * k * big + 2 * k**3)
    return total


def format_muon_step(step: MuonStep, timed: tuple[str, float] | None = None) -> str:
    """The plan's lines for Muon's step on the planned rank.

    Its share of Newton-Schulz (``timed``: its seconds on a hardware profile, as (name,
    seconds)) and the exchange's collectives.
    """
    gflop = step.flops / 1e9
    line = (
        f"\nmuon step (this rank): {len(step.owned)} of {step.matrices} matrices "
        f"orthogonalized here, {gflop:.3f} GFLOP of Newton-Schulz"
    )
    if timed is not None:
        line += f", {timed[1] * 1e3:.3f} ms on {timed[0]}"
    if step.calls:
        sent = " + ".join(format_bytes(s) for _, s in step.calls)
        line += f"\n  exchange over {step.world} ranks: {len(step.calls)} all_to_all, {sent} sent"
    return line + "\n"
