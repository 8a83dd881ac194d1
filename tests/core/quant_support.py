"""A tensor subclass that FSDP all-gathers through its hooks, and models that use it.

``QuantTensor`` holds fp32 data. ``fsdp_pre_all_gather`` quantizes its shard to int8 rows
with one fp32 scale per row (two all-gather inputs of different dtypes, so FSDP gathers
bytes); ``fsdp_post_all_gather`` dequantizes them. The single-process reference applies the
same round trip to its plain weights in forward (``fake_quant``), with the gradient passed
straight through, so it trains like the sharded models.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map_only

# How often each hook ran in this process, by kind ("pre", "post", "post_out"): tests read it.
CALLS: Counter[str] = Counter()
# Per parameter, what the first post hook returned and the all-gather outputs it was given.
GATHERED: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []


def reset_records() -> None:
    """Forget the calls and tensors recorded so far."""
    CALLS.clear()
    GATHERED.clear()


def all_freed() -> bool:
    """Whether the memory of every recorded post-hook tensor and all-gather output is freed."""
    tensors = [t for values, outputs in GATHERED for t in (values, *outputs)]
    return bool(tensors) and all(t.untyped_storage().size() == 0 for t in tensors)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _record_refill(out: torch.Tensor, outputs: tuple[torch.Tensor, ...]) -> None:
    """Count an ``out=`` call, and whether it got the first call's outputs back (as NF4
    checks), re-allocated."""
    CALLS["post_out"] += 1
    for values, first in GATHERED:
        if _same_storage(values, out):
            same = all(_same_storage(a, b) for a, b in zip(first, outputs, strict=True))
            CALLS["post_out_same_outputs"] += same


def quantize_rows(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows and their fp32 scales (rows, 1): x ~ q * scale."""
    scale = data.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    q = torch.round(data / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 values of int8 rows, in ``dtype``."""
    return (q.to(torch.float32) * scale).to(dtype)


def fake_quant(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` through the int8 round trip, with the gradient passed straight through."""
    q, scale = quantize_rows(weight.detach())
    return weight + (dequantize_rows(q, scale, weight.dtype) - weight).detach()


class QuantData(torch.Tensor):
    """fp32 data in a wrapper subclass, without all-gather hooks.

    Every operator runs on the inner data; tensor results are wrapped again (in-place ones
    return ``self``), so chunking, padding and the optimizer's updates keep the subclass.
    """

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> QuantData:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=False,
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:  # type: ignore[override]  # torch's has extra keywords
        return f"{type(self).__name__}({self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], meta: None, size: Any, stride: Any
    ) -> QuantData:
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch declares a plain function
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        unwrapped_args, unwrapped_kwargs = tree_map_only(
            QuantData, lambda t: t._data, (args, kwargs or {})
        )
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if func._schema.is_mutable and args and isinstance(args[0], QuantData):
            return args[0]
        return tree_map_only(torch.Tensor, cls, out)

    def plain(self) -> torch.Tensor:
        """A plain copy of the data."""
        return self._data.clone()

    def quantized(self, padded_rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This shard's int8 rows and scales, zero rows added up to ``padded_rows``."""
        data = self._data
        if padded_rows is not None and data.size(0) < padded_rows:
            pad = data.new_zeros(padded_rows - data.size(0), *data.shape[1:])
            data = torch.cat([data, pad])
        return quantize_rows(data)


class QuantTensor(QuantData):
    """Gathered as int8 rows plus one fp32 scale per row (the five-argument pre hook)."""

    # Whether the scales are sent at the shard's full size (one per element), so that every
    # input has the padded shard size that torch demands of an unevenly sharded parameter.
    full_scales = False

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        CALLS["pre"] += 1
        # An uneven shard is padded to the size every rank sends (that of rank 0's).
        q, scale = self.quantized(-(-outer_size[0] // mesh.size()))
        if self.full_scales:
            scale = scale.expand_as(q).contiguous()
        return (q, scale), None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        q, scale = all_gather_outputs  # scales: one per row, or one per element
        values = dequantize_rows(q, scale, param_dtype)
        if out is not None:
            _record_refill(out, all_gather_outputs)
            # Write the values in place without bumping the parameter's version: autograd
            # saved it in forward, and backward must see the re-gathered values.
            out.data.copy_(values.view(-1)[: out.numel()].view(out.shape))
            return None
        CALLS["post"] += 1
        GATHERED.append((values, all_gather_outputs))
        return values, (values,)


class FullScaleQuantTensor(QuantTensor):
    """Sends its scales one per element: torch accepts such inputs for uneven shards."""

    full_scales = True


class ChunkOnlyQuantTensor(QuantTensor):
    """Refuses a slice of part of a dim, as torchao's NF4 does: only ``torch.chunk`` /
    ``split`` (what torch's fully_shard cuts shards with) and whole-dim slices work."""

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch declares a plain function
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.ops.aten.slice.Tensor:
            tensor, dim, start, end = [*args, 0, None, None][:4]
            size = tensor.shape[dim]
            if (start or 0) != 0 or (end is not None and min(end, size) != size):
                raise NotImplementedError(f"aten.slice({cls.__name__}) with end={end}")
        return super().__torch_dispatch__(func, types, args, kwargs)


class LegacyQuantTensor(QuantTensor):
    """The one-argument ``fsdp_pre_all_gather(mesh)`` of older torch."""

    def fsdp_pre_all_gather(  # type: ignore[override]  # the older signature on purpose
        self, mesh: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        CALLS["pre_legacy"] += 1
        return self.quantized(None), None


class PreOnlyTensor(QuantData):
    """Defines ``fsdp_pre_all_gather`` alone (a user error)."""

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        return self.quantized(None), None


class TwoArgumentTensor(QuantTensor):
    """A pre-all-gather hook of neither accepted signature (a user error)."""

    def fsdp_pre_all_gather(  # type: ignore[override]  # wrong on purpose
        self, mesh: Any, module: nn.Module
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        return self.quantized(None), None


class PostOnlyTensor(QuantData):
    """Defines ``fsdp_post_all_gather`` alone (a user error)."""

    def fsdp_post_all_gather(
        self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        q, scale = all_gather_outputs
        values = dequantize_rows(q, scale, param_dtype)
        return values, (values,)


class ReleasingQuantTensor(QuantTensor):
    """Declares that its post hook's values do not view the all-gather outputs (they are
    dequantized anew), so FSDP may free the outputs right after it (torch 2.15's hook)."""

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
        return True


class KeepingQuantTensor(QuantTensor):
    """Defines the release hook and answers False: the outputs stay until reshard."""

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
        return False


class NonBoolReleaseTensor(QuantTensor):
    """A release hook that answers something other than a bool (a user error)."""

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> Any:
        return 1


class ReleaseOnlyTensor(QuantData):
    """Defines the release hook without the all-gather hooks it is about (a user error)."""

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
        return True


class QuantLinear(nn.Linear):
    """A Linear whose weight is fake-quantized in forward when ``fake_quant`` is set.

    The single process sets it; sharded models leave it off, since their weight arrives from
    ``fsdp_post_all_gather`` already dequantized.
    """

    fake_quant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = fake_quant(self.weight) if self.fake_quant else self.weight
        return F.linear(x, weight, self.bias)


class QuantBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = QuantLinear(dim, hidden)
        self.fc2 = QuantLinear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, x + self.fc2(F.gelu(self.fc1(x))))


class QuantNet(nn.Module):
    """Input projection, blocks of quantized Linears and a head; plain biases and norm."""

    def __init__(self, dim: int = 16, hidden: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(7, dim)
        self.blocks = nn.ModuleList(QuantBlock(dim, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = QuantLinear(dim, 3)  # 3 rows: uneven at W=2 and W=4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return cast(torch.Tensor, self.head(self.norm(h)))


def build(
    kind: str, *, uneven: bool = False, tensor_cls: type[QuantData] = QuantTensor
) -> QuantNet:
    """The test model, the same weights for every ``kind``.

    Args:
        kind: "local" fake-quantizes in forward; anything else holds ``tensor_cls`` weights,
            to be sharded.
        uneven: also quantize the 3-row head (a dim-0 size no even world size divides).
        tensor_cls: the subclass of the quantized weights.
    """
    torch.manual_seed(0)
    model = QuantNet()
    for module in model.modules():
        if isinstance(module, QuantLinear) and (uneven or module is not model.head):
            if kind == "local":
                module.fake_quant = True
            else:
                module.weight = nn.Parameter(tensor_cls(module.weight.detach().clone()))
    return model
