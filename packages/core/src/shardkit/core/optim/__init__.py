"""Whole-matrix optimizers on sharded parameters: Muon, and the seam for its kin.

``from shardkit.core.optim import Muon`` in place of ``torch.optim.Muon`` where the parameters
are sharded by ``fully_shard`` (shardkit's or torch's): same arguments, defaults and bits, each
matrix orthogonalized once in the job, whole, on one rank. Other whole-matrix updates plug in
as a :class:`WholeMatrixRule` (:class:`ColumnNormSGD` is one). :func:`split_matrices` splits a
model's parameters into Muon's and AdamW's; :class:`MuonWithAdamW` steps both kinds as one
optimizer. See docs/guide/muon.md.
"""

from shardkit.core.errors import ShardedMatrixError
from shardkit.core.optim.column_norm import COLUMN_NORM_RULE, ColumnNormSGD
from shardkit.core.optim.muon import MUON_RULE, Muon
from shardkit.core.optim.param_split import ParamSplit, split_matrices
from shardkit.core.optim.rule import Options, WholeMatrixRule
from shardkit.core.optim.whole_matrix import StepStats, WholeMatrixOptimizer
from shardkit.core.optim.with_adamw import USE_MUON, MuonWithAdamW

__all__ = [
    "COLUMN_NORM_RULE",
    "ColumnNormSGD",
    "MUON_RULE",
    "Muon",
    "MuonWithAdamW",
    "Options",
    "ParamSplit",
    "ShardedMatrixError",
    "StepStats",
    "USE_MUON",
    "WholeMatrixOptimizer",
    "WholeMatrixRule",
    "split_matrices",
]
