"""What a vLLM engine serves, read back tensor by tensor under the checkpoint's names.

vLLM's CPU build packs each linear layer's weight into its kernel after loading and leaves an
empty tensor in its place, so the weights cannot be read as tensors. They are read through the
kernel instead: the layer's own GEMM applied to an identity matrix, without the bias, gives
back ``W^T`` exactly (each output is one weight times one, summed with zeros). Fused layers are
cut back into their checkpoint parts (q, k and v; gate and up); tensors the engine keeps as
they are (embeddings, norms, biases) are read as they are, in the checkpoint's dtype.
"""

from __future__ import annotations

from typing import Any

import torch

_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def model_of(llm: Any) -> torch.nn.Module:
    """The model of ``llm``, an engine whose core runs in this process."""
    worker = llm.llm_engine.model_executor.driver_worker
    runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
    model: torch.nn.Module = runner.get_model()
    return model


def _split(name: str, module: Any, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """``value`` (the fused layer's outputs along dim 0) by the checkpoint's names."""
    prefix, _, last = name.rpartition(".")
    parts = _FUSED.get(last)
    if parts is None:
        return {name: value}
    if last == "qkv_proj":
        head = module.head_size
        sizes = [module.num_heads * head, module.num_kv_heads * head, module.num_kv_heads * head]
    else:
        sizes = list(module.output_sizes)
    pieces = torch.split(value, sizes, dim=0)
    return {f"{prefix}.{part}": piece for part, piece in zip(parts, pieces, strict=True)}


def served_weights(llm: Any, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every weight ``llm`` serves now, by checkpoint name, in ``dtype``."""
    model = model_of(llm)
    found: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "cpu_linear"):
                size = module.input_size_per_partition
                eye = torch.eye(size, dtype=dtype)
                weight = module.cpu_linear(eye, module.weight, None).t().contiguous()
                for key, part in _split(name, module, weight).items():
                    found[f"{key}.weight"] = part.to(dtype)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    for key, part in _split(name, module, bias.detach()).items():
                        found[f"{key}.bias"] = part.to(dtype)
                continue
            for local, tensor in module.named_parameters(recurse=False):
                if tensor.numel():
                    found[f"{name}.{local}"] = tensor.detach().to(dtype).clone()
    return found
