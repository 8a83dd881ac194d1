"""CPU offload in the planned step: which of the engine's buffers live in host memory.

With ``CPUOffloadPolicy`` the engine keeps each group's sharded parameters on the host, its
sharded gradients too (each reduction's output is cast if needed and copied to the host,
``engine/reduce/assign.py``), and so the optimizer's state and step run there. The device
holds what a gather and a reduction need: the staging copy of the shards that the all-gather
sends (the core's ``stages_gather_input(offload=True)``, a size the pool keeps), the receive
buffer, the unsharded parameters and gradients, and the reduction's buffers.

On a CPU device (the gloo backend) the host copy of a CPU tensor is that tensor: the
reduction's output becomes the host gradient without a copy. On a GPU (NCCL) the device output
is copied and freed once the host copy exists.
"""

from __future__ import annotations

from shardkit.tools.plan.groups import GroupSpec
from shardkit.tools.plan.ledger import Key, Ledger
from shardkit.tools.records import Category

__all__ = ["assign_sharded_grads", "free_resident", "resident"]


def resident(
    ledger: Ledger, key: Key, category: Category, nbytes: int, label: str, *, offload: bool
) -> None:
    """Allocate a buffer that lives all step: on the host when offloading, else the device."""
    if offload:
        ledger.alloc_host(key, category, nbytes, f"{label} (host)")
    else:
        ledger.alloc(key, category, nbytes, label)


def free_resident(ledger: Ledger, key: Key) -> None:
    """Free a buffer :func:`resident` (or :func:`assign_sharded_grads`) allocated."""
    if key in ledger.host:
        ledger.free_host(key)
    else:
        ledger.free(key)


def assign_sharded_grads(
    ledger: Ledger, g: int, group: GroupSpec, *, offload: bool, cpu: bool
) -> list[tuple[Key, int]]:
    """A finished reduction's output becomes group ``g``'s sharded gradients.

    Returns the device buffers the reduction's record frees afterwards (key, pool size 0).
    """
    label = f"sharded gradients {group.fqn}"
    out, grad = ("reduce_out", g), ("sharded_grad", g)
    same_dtype = group.layout.reduce_dtype == group.grad_dtype
    if not offload:
        if same_dtype:
            ledger.move(out, grad)
            return []
        ledger.alloc(grad, Category.GRADIENTS, group.sharded_grad_nbytes, label)
        return [(out, 0)]
    if not same_dtype and not cpu:  # cast on the device, then copied
        ledger.alloc(("grad_cast", g), Category.COMM_BUFFERS, group.sharded_grad_nbytes, label)
        ledger.free(("grad_cast", g))
    nbytes = group.sharded_grad_nbytes
    if cpu and same_dtype:
        # The copy to the host is the output itself: it leaves the device's ledger.
        ledger.free(out)
        ledger.alloc_host(grad, Category.GRADIENTS, nbytes, f"{label} (host)")
        return []
    ledger.alloc_host(grad, Category.GRADIENTS, nbytes, f"{label} (host)")
    return [(out, 0)]
