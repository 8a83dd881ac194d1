"""FSDP1's names in torch, for ``shardkit.core.patch_torch``: they become shardkit.legacy's.

The core's ``patch_torch`` finds :func:`torch_patch` through the entry-point group
``shardkit.core.torch_patches`` (declared in this package's ``pyproject.toml``), so with
shardkit-legacy installed, ``torch.distributed.fsdp.FullyShardedDataParallel``, its configs and
enums, and the wrap policies of ``torch.distributed.fsdp.wrap`` resolve to this package's while
the patch is in effect. The core knows nothing of this package; this module only names objects.

The module that defines FSDP1 (``torch.distributed.fsdp.fully_sharded_data_parallel``) gets them
too: libraries import the wrapper from that path at call time (Accelerate's FSDP1 path does).
Torch's own FSDP1 code reads that module's names only while it builds or runs torch's wrappers,
which nothing does while the patch makes every FSDP1 name this package's.
"""

from __future__ import annotations

__all__ = ["torch_patch"]


def torch_patch() -> dict[str, dict[str, object]]:
    """``{torch module: {name: shardkit.legacy's object}}`` for ``patch_torch``.

    Every FSDP1 name ``torch.distributed.fsdp`` exports (there and in the module that defines
    them), and the names of ``torch.distributed.fsdp.wrap`` that shardkit.legacy's ``wrap``
    module has.
    """
    import torch.distributed.fsdp.wrap as torch_wrap

    from shardkit.legacy import fully_sharded_data_parallel as fsdp1
    from shardkit.legacy import wrap
    from shardkit.legacy.torch_compat import dcp_fsdp_state_lookup
    from shardkit.legacy.units import is_unit

    fsdp1_names = {name: getattr(fsdp1, name) for name in fsdp1.__all__}
    return {
        "torch.distributed.fsdp": fsdp1_names,
        "torch.distributed.fsdp.fully_sharded_data_parallel": fsdp1_names,
        "torch.distributed.fsdp.wrap": {
            name: getattr(wrap, name) for name in torch_wrap.__all__ if name in wrap.__all__
        },
        # DCP's state-dict helpers (get_model_state_dict...) call FSDP1's class methods on
        # the class they imported: while patched, the models they see are this package's.
        "torch.distributed.checkpoint.state_dict": {
            "FSDP": fsdp1.FullyShardedDataParallel,
            "_get_module_fsdp_state_if_fully_sharded_module": dcp_fsdp_state_lookup(is_unit),
        },
    }
