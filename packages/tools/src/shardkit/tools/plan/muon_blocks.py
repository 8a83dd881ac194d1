"""Where the core's Muon finds each planned matrix: every rank's block, from the layout alone.

The planned mesh is (dp_replicate, dp_shard, tp), a rank's index ``(replica * shards + shard)
* tp + tp_rank``: the order of the group the core's Muon exchanges over (the whole mesh,
flattened). A matrix is cut by TP first, as DTensor cuts it (``torch.chunk`` on the style's
dim: ``ColwiseParallel`` rows, ``RowwiseParallel`` columns), and FSDP then cuts each TP block's
rows (``_StridedShard`` where both cut rows); HSDP's replicas hold the same blocks.

A matrix that TP leaves whole (no style names it) is planned as the core's Muon steps it when
given ``replicated_over=mesh["tp"]`` (docs/guide/muon.md): the same blocks on every tp rank, so
one owner in the whole mesh; the planned program passes it.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardkit.core.layout import ParamLayout
from shardkit.core.optim.blocks import Block, MatrixPlacement

__all__ = ["TPCuts", "matrix_placement"]

TPCuts = Mapping[str, tuple[tuple[int, int], int | None]]
"""Parameter FQN -> (its whole (m, n), the dim TP cuts or None), for Muon's matrices."""


def matrix_placement(
    p: ParamLayout, shards: int, replicas: int, tp: int = 1, cuts: TPCuts | None = None
) -> MatrixPlacement:
    """Every rank's block of ``p``'s matrix on a (replicas, shards, tp) mesh.

    Args:
        p: the parameter's layout (under TP, its TP-local shape on the planned rank).
        shards: ranks of the shard axis.
        replicas: HSDP's replicas (1: FSDP).
        tp: ranks of the tp axis.
        cuts: with TP, each matrix's whole shape and TP's dim; a matrix not in it is whole
            on the tp axis.
    """
    shape, tp_dim = (int(p.shape[0]), int(p.shape[1])), None
    if cuts is not None and p.fqn in cuts:
        shape, tp_dim = cuts[p.fqn]
    blocks, holders = [], []
    for replica in range(replicas):
        for shard in range(shards):
            for tp_rank in range(tp):
                blocks.append(_block(shape, p.shard_dim, shard, shards, tp_dim, tp_rank, tp))
                # The mesh axes that replicate it: HSDP's, and TP's where TP leaves it whole.
                holders.append((replica,) if tp_dim is not None else (replica, tp_rank))
    return MatrixPlacement(
        name=p.fqn, shape=shape, group=None, blocks=tuple(blocks), replicas=tuple(holders)
    )


def _block(
    shape: tuple[int, int],
    cut: int,
    shard: int,
    shards: int,
    tp_dim: int | None,
    tp_rank: int,
    tp: int,
) -> Block:
    """One rank's rectangle: TP's chunk of ``tp_dim``, then FSDP's chunk of ``cut`` in it."""
    starts, sizes = [0, 0], list(shape)
    if tp_dim is not None:
        starts[tp_dim], sizes[tp_dim] = _chunk(shape[tp_dim], tp, tp_rank)
    start, size = _chunk(sizes[cut], shards, shard)
    starts[cut], sizes[cut] = starts[cut] + start, size
    if sizes[0] == 0 or sizes[1] == 0:
        return Block(0, 0, 0, 0)
    return Block(starts[0], starts[0] + sizes[0], starts[1], starts[1] + sizes[1])


def _chunk(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of chunk ``index`` of ``total`` in ``parts``, as ``torch.chunk`` cuts.

    Chunks of the rounded-up share; the last ones short or empty.
    """
    each = -(-total // parts)
    start = min(total, index * each)
    return start, max(0, min(each, total - start))
