"""What a vLLM engine computes with, read back on its worker: tensors, or their digests.

A sync is checked by reading every weight back out of the engine and comparing it with the
trainer's. vLLM's own ``compute_weight_checksums`` hashes the parameters as they are stored,
but its CPU build repacks each linear layer's weight for its kernels and leaves an empty
parameter behind: those weights are read through the kernel instead, the layer applied to the
identity matrix, which returns its weight transposed, exactly (each output element is one
product ``w * 1``, the rest zeros). Other parameters (embeddings, norms, biases) are read as
they are, in the dtype the engine keeps them. vLLM fuses q, k and v into ``qkv_proj`` and gate
and up into ``gate_up_proj`` (its ``packed_modules_mapping``); they are split back by the
layer's ``output_sizes``, so the names are the checkpoint's. One engine rank holding whole
layers (no tensor parallelism). Under tensor parallelism each engine rank holds its partition
of each layer, in vLLM's fused layout: :func:`partition_tensors` reads those as they are,
under vLLM's own names (a fresh engine's ranks are the oracle).

:func:`served_digests` is what crosses a process or HTTP (the worker extension's
``shardkit_weight_digests``): JSON, no tensor and no pickle. :func:`tensor_digest` is the same
digest on the trainer's side.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

__all__ = [
    "partition_digests",
    "partition_tensors",
    "served_digests",
    "served_tensors",
    "tensor_digest",
]


def served_tensors(worker: Any) -> dict[str, torch.Tensor]:
    """On vLLM's worker: every weight the engine computes with, under the checkpoint's names."""
    model = worker.model_runner.get_model()
    dtype = worker.model_runner.model_config.dtype
    fused: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    found: dict[str, torch.Tensor] = {}

    def put(module_name: str, kind: str, tensor: torch.Tensor) -> None:
        prefix, _, leaf = module_name.rpartition(".")
        parts = fused.get(leaf)
        if parts is None:
            found[f"{module_name}.{kind}"] = tensor.clone()
            return
        sizes = model.get_submodule(module_name).output_sizes
        for part, piece in zip(parts, tensor.split(sizes), strict=True):
            found[f"{prefix}.{part}.{kind}"] = piece.clone()

    with torch.no_grad():
        for name, param in model.named_parameters():
            module_name, _, kind = name.rpartition(".")
            if param.numel() > 0:
                put(module_name, kind, param.detach())
                continue
            module = model.get_submodule(module_name)
            identity = torch.eye(module.input_size, dtype=dtype)
            put(module_name, kind, module.quant_method.apply(module, identity).t())
    return found


def tensor_digest(tensor: torch.Tensor) -> list[Any]:
    """``[dtype, shape, sha256 of the bytes]``: equal digests, equal tensors bit for bit."""
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), digest]


def served_digests(worker: Any) -> dict[str, list[Any]]:
    """On vLLM's worker: :func:`tensor_digest` of every tensor :func:`served_tensors` reads."""
    return {name: tensor_digest(t) for name, t in sorted(served_tensors(worker).items())}


def partition_tensors(worker: Any) -> dict[str, torch.Tensor]:
    """On vLLM's worker: this engine rank's part of every parameter, under vLLM's names.

    Fused layers stay fused (``qkv_proj``, ``gate_up_proj``), each as this rank's partition;
    a repacked weight is read through its kernel on the identity of the partition's inputs.
    """
    model = worker.model_runner.get_model()
    found: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.numel() > 0:
                found[name] = param.detach().clone()
                continue
            module = model.get_submodule(name.rpartition(".")[0])
            identity = torch.eye(module.input_size_per_partition, dtype=param.dtype)
            found[name] = module.quant_method.apply(module, identity).t().contiguous()
    return found


def partition_digests(worker: Any) -> dict[str, list[Any]]:
    """On vLLM's worker: :func:`tensor_digest` of every tensor :func:`partition_tensors` reads."""
    return {name: tensor_digest(t) for name, t in sorted(partition_tensors(worker).items())}
