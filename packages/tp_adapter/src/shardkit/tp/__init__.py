"""shardkit.tp: FSDP with tensor parallelism (2D) and HSDP with tensor parallelism (3D).

Installing the package is all it takes: ``shardkit.core.fully_shard`` finds
:class:`TensorParallelSharding` through its entry point, so code written for torch's
``fully_shard`` on a ``parallelize_module``-d model runs unchanged.
"""

from shardkit.tp.__about__ import __version__
from shardkit.tp.sharding import TensorParallelSharding, spmd_mesh

__all__ = ["TensorParallelSharding", "__version__", "spmd_mesh"]
