"""Which tensors an export sends, under which names, and in which bucket.

The tensors are the model's state dict: parameters and persistent buffers (a loader reads a
checkpoint's names, and checkpoints hold no non-persistent buffers such as rotary tables). A
tensor tied to another (an LM head sharing the embedding) is sent once, under its first name,
as Hugging Face checkpoints store it; ``include_tied`` sends every name. ``rename`` maps each
name to the receiver's (None leaves a tensor out).

Buckets hold whole layers: every tensor of one ``layer_of`` key comes in the same bucket, so a
loader that fuses q, k and v sees them together. Layers are packed in model order, as many as
fit in ``bucket_bytes`` (in the export dtype); a layer larger than that is a bucket alone.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.core.export.axis_gathers import TensorSource, export_order, tensor_source

__all__ = [
    "ExportBucket",
    "default_layer_of",
    "export_sources",
    "plan_buckets",
    "plan_digest",
]

# Module wrappers whose prefixes are no part of a checkpoint's names.
_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def default_layer_of(name: str) -> str:
    """A name's layer: up to its first numbered part (``model.layers.3``), else its module."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


@dataclass(frozen=True, slots=True)
class ExportBucket:
    """One bucket: its tensors (whole layers), in order."""

    index: int
    sources: tuple[TensorSource, ...]

    @property
    def nbytes(self) -> int:
        """Its bytes in the export dtype, whole tensors."""
        return sum(s.nbytes for s in self.sources)


def _clean(key: str) -> str:
    return ".".join(part for part in key.split(".") if part not in _WRAPPER_PARTS)


def export_sources(
    model: nn.Module,
    *,
    dtype: torch.dtype | None,
    keep_dims: set[int],
    rename: Callable[[str], str | None] | None,
    include_tied: bool,
    root: DeviceMesh | None,
) -> list[TensorSource]:
    """The tensors to export.

    In state-dict order, each gathered along the mesh dims in one order for all (see
    :func:`~shardkit.core.export.axis_gathers.gathered_dims`).

    Raises:
        ValueError: two tensors renamed to one name.
    """
    entries = [
        (key, value)
        for key, value in model.state_dict(keep_vars=True).items()
        if isinstance(value, torch.Tensor)
    ]
    order = export_order([value for _, value in entries], keep_dims, root)
    seen: dict[int, str] = {}
    sources: list[TensorSource] = []
    names: dict[str, str] = {}
    for key, value in entries:
        identity = id(value)
        if identity in seen and not include_tied:
            continue
        seen.setdefault(identity, key)
        name = _clean(key)
        if rename is not None:
            renamed = rename(name)
            if renamed is None:
                continue
            name = renamed
        if name in names:
            raise ValueError(f"export names collide: {names[name]} and {key} are both {name!r}")
        names[name] = key
        cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
        sources.append(tensor_source(key, name, value, cast, keep_dims, root, order))
    return sources


def plan_buckets(
    sources: list[TensorSource],
    bucket_bytes: int,
    layer_of: Callable[[str], str],
    min_buckets: int = 1,
) -> list[ExportBucket]:
    """Whole layers packed into buckets of at most ``bucket_bytes`` (a larger layer alone).

    With ``min_buckets``, the bound is also at most the export's bytes over ``min_buckets``,
    so a model smaller than that many buckets is still cut (where its layers allow): a sync
    then holds part of it at a time, not all of it.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if min_buckets <= 0:
        raise ValueError(f"min_buckets must be positive, got {min_buckets}")
    total = sum(s.nbytes for s in sources)
    bucket_bytes = min(bucket_bytes, max(1, -(-total // min_buckets)))
    layers: dict[str, list[TensorSource]] = {}
    for source in sources:
        layers.setdefault(layer_of(source.name), []).append(source)
    buckets: list[list[TensorSource]] = []
    filled = 0
    for layer in layers.values():
        size = sum(s.nbytes for s in layer)
        if buckets and filled + size <= bucket_bytes:
            buckets[-1] += layer
            filled += size
        else:
            buckets.append(list(layer))
            filled = size
    return [ExportBucket(i, tuple(b)) for i, b in enumerate(buckets)]


def plan_digest(buckets: list[ExportBucket]) -> int:
    """A 63-bit digest of the plan (names, shapes, dtypes, buckets).

    Equal on every rank that exports the same model the same way.
    """
    text = ";".join(
        f"{b.index}:{s.name}:{list(s.tensor.shape)}:{s.dtype}:{[st.mesh_dim for st in s.gathers]}"
        for b in buckets
        for s in b.sources
    )
    return zlib.crc32(text.encode()) << 31 | zlib.adler32(text.encode()) & 0x7FFFFFFF
