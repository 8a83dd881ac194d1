"""shardkit.tp: FSDP with tensor parallelism (2D) and HSDP with tensor parallelism (3D).

Installing the package is all it takes: ``shardkit.core.fully_shard`` finds
:class:`TensorParallelSharding` through its entry point, so code written for torch's
``fully_shard`` on a ``parallelize_module``-d model runs unchanged.
:class:`DTensorExtensions` gives FSDP1's API (shardkit.legacy) the same for 2D models: flat
parameters of TP-local tensors, and their sharded state dicts.
"""

from shardkit.tp.__about__ import __version__
from shardkit.tp.dtensor_extensions import DTensorExtensions, DTensorMetadata
from shardkit.tp.sharding import TensorParallelSharding, spmd_mesh

__all__ = [
    "DTensorExtensions",
    "DTensorMetadata",
    "TensorParallelSharding",
    "__version__",
    "spmd_mesh",
]
