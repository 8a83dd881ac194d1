"""A parameter group's gradient reduction, in one room: ``GroupReducer`` is its entry point.

After a group's backward, its full gradients are packed into the rows of one reduce-scatter
(``packing``), reduced, all-reduced across HSDP replicas, divided where torch divides
(``division``), cast to the parameters' dtype, copied to the host if offloaded, and assigned
as the sharded parameters' gradients (``assign``); ``reducer`` tells that story and keeps
the reductions in flight. The collectives themselves are the runtime's
(``runtime.collectives``), and so is the operation they reduce with (``runtime.reduction``).

Outside this folder, import from here only. ``pack_grads_rank_major`` is exported for the
full state dict's loading, which packs full tensors into a scatter's rows the same way;
``check_policy`` for ``FSDPModule.set_reduce_precision``, which checks a ``ReducePrecision``
against each group before setting it (``precision``: reductions in a narrow wire format);
``WireFormat`` for the layout view, which sizes a compressed reduction's rows;
``take_sharded_grad`` for the group's own bookkeeping without gradient sync
(``param_group._add_sharded_grad``, FSDP1's ``NO_SHARD``), which takes a reduced gradient off
its parameter for the unsynced ones to join (``assign``, beside the assignment that put it).
"""

from __future__ import annotations

from shardkit.core.engine.reduce.assign import take_sharded_grad
from shardkit.core.engine.reduce.packing import pack_grads_rank_major
from shardkit.core.engine.reduce.precision import check_policy
from shardkit.core.engine.reduce.reducer import GroupReducer
from shardkit.core.engine.reduce.wire import WireFormat

__all__ = [
    "GroupReducer",
    "WireFormat",
    "check_policy",
    "pack_grads_rank_major",
    "take_sharded_grad",
]
