"""``summon_full_params``: FSDP1's full-parameter context, on the core's ``full_params``.

Inside, every wrapper of the tree (or only ``module`` with ``recurse=False``) holds full
parameters in their own dtype, and its ``named_parameters`` drop the wrapper's prefix as
FSDP1's do.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

from torch import nn

from shardkit.core import full_params
from shardkit.legacy.flat_params import per_parameter_view
from shardkit.legacy.units import is_unit, unit_of, units_in

__all__ = ["is_summoned", "summon_full_params"]

_SUMMONED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def is_summoned(wrapper: nn.Module) -> bool:
    """Whether ``wrapper`` holds full parameters now (inside ``summon_full_params``)."""
    return wrapper in _SUMMONED


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Full parameters on the wrappers in ``module``'s tree inside the context.

    Every rank must enter it. See FSDP1's ``summon_full_params`` for the arguments; unlike
    FSDP1, ``with_grads`` works whatever ``use_orig_params`` and ``offload_to_cpu`` are, and
    ``offload_to_cpu`` works with ``NO_SHARD`` and on CPU-only machines.

    Raises:
        NotImplementedError: ``writeback`` with ``rank0_only`` (as FSDP1).
    """
    if writeback and rank0_only:
        raise NotImplementedError("writeback=True and rank0_only=True is not supported yet")
    own = [module] if is_unit(module) else []
    wrappers = units_in(module, root_only=True) if recurse else own
    summoned = [w for top in wrappers for w in (units_in(top) if recurse else [top])]
    with contextlib.ExitStack() as stack:
        # FSDP1 lists the original parameters inside, not flat ones.
        stack.enter_context(per_parameter_view())
        for wrapper in wrappers:
            stack.enter_context(
                full_params(
                    unit_of(wrapper).module,
                    recurse=recurse,
                    writeback=writeback,
                    rank0_only=rank0_only,
                    offload_to_cpu=offload_to_cpu,
                    with_grads=with_grads,
                )
            )
        _SUMMONED.update(summoned)
        try:
            yield
        finally:
            for wrapper in summoned:
                _SUMMONED.discard(wrapper)
