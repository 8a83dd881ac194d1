"""The small models of FSDP1's state-dict scenarios, wrapped by either implementation.

Each builder takes the implementation ("shardkit" or "torch") and returns the model wrapped
as FSDP1's own tests wrap it; the same seed gives both implementations the same values.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tests.legacy.legacy_parity import lib

CPU = torch.device("cpu")
FP16 = {"param_dtype": torch.float16, "reduce_dtype": torch.float16, "buffer_dtype": torch.float16}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """FSDP1's deprecation and CPU warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def fsdp(impl: str, module: nn.Module, **kwargs: Any) -> nn.Module:
    """``FSDP(module, device_id=cpu, **kwargs)`` of ``impl``."""
    with quiet():
        wrapped: nn.Module = lib(impl).FSDP(module, device_id=CPU, **kwargs)
    return wrapped


def wrap_api(impl: str) -> Any:
    """FSDP1's manual wrapping module (``enable_wrap``, ``wrap``) of ``impl``."""
    if impl == "shardkit":
        import shardkit.legacy.wrap as ours

        return ours
    import torch.distributed.fsdp.wrap as theirs

    return theirs


def fp16(impl: str) -> Any:
    """``MixedPrecision`` of fp16 parameters, reductions and buffers, from ``impl``."""
    return lib(impl).MixedPrecision(**FP16)


class SharedDummy(nn.Module):
    """A module reached under two names, and a parameter under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.net1: nn.Module = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.net2: nn.Module = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.net3: nn.Module = self.net2
        self.random_parameter = nn.Parameter(torch.randn(10))
        self.shared_parameter = self.random_parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net3(self.net2(self.net1(x)))
        return out


def shared_dummy(impl: str, seed: int, units: bool) -> nn.Module:
    """``SharedDummy`` under a root unit; with ``units``, net1 and net2 (= net3) units too."""
    torch.manual_seed(seed)
    model = SharedDummy()
    if units:
        model.net1 = fsdp(impl, model.net1)
        model.net2 = model.net3 = fsdp(impl, model.net2)
    return fsdp(impl, model)


def simple(impl: str, **kwargs: Any) -> nn.Module:
    """One linear layer, one unit."""
    return fsdp(impl, nn.Linear(10, 10, bias=False), **kwargs)


def nested(impl: str, **kwargs: Any) -> nn.Module:
    """A root unit over a unit of the first linear and a plain second one."""
    inner = fsdp(impl, nn.Linear(10, 10, bias=False), **kwargs)
    return fsdp(impl, nn.Sequential(inner, nn.Linear(10, 10, bias=False)), **kwargs)


class PlainRoot(nn.Module):
    """A root that is no unit: a plain linear, then two nested models."""

    def __init__(self, impl: str, **kwargs: Any) -> None:
        super().__init__()
        self.non_fsdp_lin = nn.Linear(10, 10, bias=False)
        self.fsdp_1 = nested(impl, **kwargs)
        self.fsdp_2 = nested(impl, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fsdp_2(self.fsdp_1(self.non_fsdp_lin(x)))
        return out


def plain_root(impl: str, **kwargs: Any) -> nn.Module:
    """``PlainRoot`` of ``impl``."""
    return PlainRoot(impl, **kwargs)


BUILDERS = {"plain_root": plain_root, "nested": nested, "simple": simple}


def with_batch_norm(impl: str, mixed: bool, **kwargs: Any) -> nn.Module:
    """Linear (its own unit, fp16 with ``mixed``), BatchNorm (its own unit, fp32), linear."""
    ns = lib(impl)
    fp32 = {"param_dtype": torch.float32, "reduce_dtype": torch.float32}
    lin_mp = fp16(impl) if mixed else None
    bn_mp = ns.MixedPrecision(**fp32, buffer_dtype=torch.float32) if mixed else None
    seq = nn.Sequential(
        fsdp(impl, nn.Linear(10, 10, bias=False), mixed_precision=lin_mp, **kwargs),
        fsdp(impl, nn.BatchNorm1d(10), mixed_precision=bn_mp, **kwargs),
        nn.Linear(10, 10, bias=False),
    )
    return fsdp(impl, seq, **kwargs)


class TwiceInner(nn.Module):
    """FSDP1's state-dict test model: ``inner`` applied twice, then ``outer``."""

    def __init__(self, impl: str | None, buffers: bool = False) -> None:
        super().__init__()
        self.inner: nn.Module = nn.Linear(4, 4)
        if buffers:
            self.inner.register_buffer("buffer", torch.randn(5, 5))
            self.inner.register_buffer("non_persistent_buffer", torch.randn(5, 5), False)
        if impl is not None:
            self.inner = fsdp(impl, self.inner)
        self.outer = nn.Linear(4, 5)
        if buffers:
            self.outer.register_buffer("buffer", torch.randn(5, 5))
            self.outer.register_buffer("non_persistent_buffer", torch.randn(5, 5), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.outer(self.inner(x) + self.inner(x))
        return out


def twice_inner(impl: str | None, buffers: bool = False) -> nn.Module:
    """``TwiceInner`` with seed 0, under a root unit of ``impl`` (plain with None)."""
    torch.manual_seed(0)
    model = TwiceInner(impl, buffers)
    return model if impl is None else fsdp(impl, model)


class NestedLinear(nn.Module):
    def __init__(self, impl: str | None) -> None:
        super().__init__()
        self.nested_linear = nn.Linear(10, 10, bias=False)
        if impl is not None:
            self.nested_linear = wrap_api(impl).wrap(self.nested_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.nested_linear(x)
        return out


class SkipModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x)
        return out


class SkipModel(nn.Module):
    """A linear, a module left out of every unit, and a unit inside a unit."""

    def __init__(self, impl: str | None) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 10, bias=False)
        self.linear_skip = SkipModule()
        inner = NestedLinear(impl)
        self.nested_linear = inner if impl is None else wrap_api(impl).wrap(inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.nested_linear(self.linear_skip(self.linear(x)))
        return out


def skip_model(impl: str | None) -> nn.Module:
    """``SkipModel`` wrapped with ``enable_wrap``, ``linear_skip`` taken out while wrapping.

    FSDP1's skip scenario: the skipped module is put back after wrapping, so no unit holds
    its parameters. With None, the plain model.
    """
    torch.manual_seed(0)
    if impl is None:
        return SkipModel(None)
    api = wrap_api(impl)
    with quiet(), api.enable_wrap(wrapper_cls=lib(impl).FSDP, device_id=CPU):
        module = SkipModel(impl)
        skipped = module.linear_skip
        del module.linear_skip
        wrapped: nn.Module = api.wrap(module)
        module.linear_skip = skipped
    return wrapped
