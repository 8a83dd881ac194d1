"""The one module that touches DTensor internals.

The engine builds DTensors around local tensors it owns (views of its flat buffers) and
re-points them when those buffers move. Public DTensor constructors copy or redistribute, so
this needs DTensor's private spec types and fields; keeping every such use here means a torch
upgrade that changes them breaks one file.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

__all__ = [
    "accumulate_grads",
    "chunk_at",
    "as_dtensor",
    "contiguous_strides",
    "dtensor_like",
    "has_post_accumulate_grad_hooks",
    "local_of",
    "make_dtensor",
    "same_spec",
    "set_local",
]


def as_dtensor(tensor: torch.Tensor) -> DTensor:
    """``tensor``, typed as the DTensor it must be."""
    assert isinstance(tensor, DTensor), f"expected a DTensor, got {type(tensor).__name__}"
    return tensor


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides: list[int] = []
    running = 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def make_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    global_shape: torch.Size,
    global_stride: tuple[int, ...] | None = None,
) -> DTensor:
    """A DTensor whose local tensor is ``local`` itself (no copy, no communication)."""
    stride = global_stride if global_stride is not None else contiguous_strides(global_shape)
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(global_shape, stride, local.dtype))
    return _wrap(local, spec)


def dtensor_like(local: torch.Tensor, like: torch.Tensor) -> DTensor:
    """A DTensor with ``like``'s mesh, placements and global shape around ``local``."""
    return _wrap(local, as_dtensor(like)._spec)


def _wrap(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    # DTensor.__new__ makes the whole object; DTensor.__init__ only calls Tensor.__init__ (a
    # no-op) under dynamo-disable and export wrappers that cost about 1.5 us a call, three
    # quarters of a wrap. The engine wraps every gradient of every step, so it skips them in
    # eager mode; while torch.compile traces, the constructor is called as torch expects.
    if torch.compiler.is_compiling():
        return DTensor(local, spec, requires_grad=False)
    wrapped: DTensor = DTensor.__new__(DTensor, local, spec, requires_grad=False)
    return wrapped


def accumulate_grads(grads: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give each DTensor parameter its paired local gradient (or add it), then run its hooks.

    The gradient is wrapped with the parameter's own spec (no copy). Autograd never
    accumulates into a sharded parameter (the unsharded one takes part in backward), so the
    engine runs the hooks registered with ``register_post_accumulate_grad_hook`` itself, once
    the gradient is there: optimizer-in-backward relies on them. torch keeps them in a
    private dict. One loop for a whole group: the engine runs it for every parameter of
    every step.
    """
    for param, local in grads:
        grad = param.grad
        if grad is None:
            param.grad = _wrap(local, as_dtensor(param)._spec)
        else:
            local_of(grad).add_(local)
        if has_post_accumulate_grad_hooks(param):
            hooks = param._post_accumulate_grad_hooks
            for hook in tuple(hooks.values()):
                hook(param)


def has_post_accumulate_grad_hooks(param: torch.Tensor) -> bool:
    """Whether hooks were registered with ``param.register_post_accumulate_grad_hook``."""
    return bool(getattr(param, "_post_accumulate_grad_hooks", None))


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor a DTensor holds, itself (``to_local()`` would add an autograd view)."""
    local: torch.Tensor = as_dtensor(tensor)._local_tensor
    return local


def same_spec(a: DTensor, b: DTensor) -> bool:
    """Whether two DTensors have one mesh, placements and global shape (identity first)."""
    return a._spec is b._spec or a._spec == b._spec


def set_local(tensor: torch.Tensor, local: torch.Tensor) -> None:
    """Re-point a DTensor (a Parameter, kept by the optimizer) at a new local tensor."""
    as_dtensor(tensor)._local_tensor = local


def chunk_at(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: list[int],
    placements: tuple[Placement, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sizes, offsets) of the chunk a DTensor of ``shape`` has at ``coordinate`` of a mesh.

    torch's own arithmetic, for any placement (``_StridedShard`` too); the checkpoint's plan
    uses it where its vectorized arithmetic does not cover a placement.
    """
    sizes, offsets = _compute_local_shape_and_global_offset(
        shape, mesh_shape, coordinate, list(placements)
    )
    return tuple(sizes), tuple(offsets)
