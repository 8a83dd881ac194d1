"""FSDP1's auto-wrap policies, and which submodules they give an FSDP unit of their own.

Two kinds, as in FSDP1. Policy objects (:class:`ModuleWrapPolicy`, :class:`CustomPolicy`)
name their targets directly. Policy functions (``transformer_auto_wrap_policy``...) are asked
twice per module, ``recurse=True`` (look inside it?) and ``recurse=False`` (wrap it, given the
parameters its wrapped children do not already hold?), exactly as FSDP1 asks them; any
function of that signature works, torch's own included. Torch's policy objects are accepted
too. The root is never a target: the wrapper the user builds is its unit.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardkit.legacy.torch_compat import is_torch_policy, map_tensors, torch_policy_targets

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "Targets",
    "WrapPolicy",
    "always_wrap_policy",
    "auto_wrap_targets",
    "enable_wrap",
    "keep_full_precision",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

Targets = dict[nn.Module, dict[str, Any]]
"""The modules to wrap, each with the constructor arguments of its wrapper."""


class WrapPolicy(ABC):
    """A policy object: it names the modules to wrap and their wrappers' arguments."""

    @abstractmethod
    def targets(
        self, root: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> Targets:
        """The modules under ``root`` (``root`` included) to wrap, with their arguments."""


class ModuleWrapPolicy(WrapPolicy):
    """Wrap every module of the given classes (FSDP1's ``ModuleWrapPolicy``).

    Args:
        module_classes: the classes, transformer blocks typically.
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self._module_classes = tuple(set(module_classes))

    def targets(
        self, root: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> Targets:
        """Every module of the classes, not ignored, with the root's arguments."""
        return {
            m: dict(root_kwargs)
            for m in root.modules()
            if m not in ignored_modules and isinstance(m, self._module_classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        """The same policy as a function: look everywhere, wrap the classes."""
        return recurse or isinstance(module, self._module_classes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({set(self._module_classes)})"


class CustomPolicy(WrapPolicy):
    """Wrap the modules a function picks, optionally with arguments of their own.

    Args:
        lambda_fn: called with each module; returns False (not wrapped), True (wrapped with
            the root's arguments) or a dict of arguments that override the root's.
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        self._lambda_fn = lambda_fn

    def targets(
        self, root: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> Targets:
        """The modules ``lambda_fn`` picks.

        Raises:
            ValueError: ``lambda_fn`` returned something other than a bool or a dict.
        """
        found: Targets = {}
        for module in root.modules():
            if module in ignored_modules:
                continue
            choice = self._lambda_fn(module)
            if not isinstance(choice, dict | bool):
                raise ValueError(
                    "The lambda_fn passed to CustomPolicy should return False/True or a kwarg "
                    f"dict, but it returned {choice!r} for {type(module).__name__}"
                )
            if choice:
                found[module] = dict(root_kwargs, **(choice if isinstance(choice, dict) else {}))
        return found


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every module."""
    return True


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[..., bool]
) -> bool:
    """Look everywhere; wrap the modules for which ``lambda_fn(module)`` is true."""
    return recurse or bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: set[type[nn.Module]],
) -> bool:
    """Look everywhere; wrap the modules of the transformer layer classes."""
    return recurse or isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module once the parameters not yet wrapped below it reach ``min_num_params``.

    ``force_leaf_modules`` are not looked into and ``exclude_wrap_modules`` never wrapped;
    their defaults are the function's attributes ``FORCE_LEAF_MODULES``
    (``nn.MultiheadAttention``) and ``EXCLUDE_WRAP_MODULES`` (``nn.ModuleList``,
    ``nn.ModuleDict``), which FSDP1 code may change.
    """
    leaves = size_based_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    excluded = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
    leaves = leaves if force_leaf_modules is None else force_leaf_modules
    excluded = excluded if exclude_wrap_modules is None else exclude_wrap_modules
    if nonwrapped_numel < min_num_params:
        return False
    return not isinstance(module, tuple(leaves if recurse else excluded))


# FSDP1's public attributes of the function: code reads and changes them.
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class _ManualWrap:
    """What ``wrap`` does inside ``enable_wrap``: the wrapper class and its arguments."""

    wrapper_cls: Callable[..., nn.Module]
    kwargs: dict[str, Any] = field(default_factory=dict)


# A context variable rather than a global: threads (ranks as threads) do not see each
# other's contexts.
_MANUAL_WRAP: ContextVar[_ManualWrap | None] = ContextVar("shardkit_manual_wrap", default=None)


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Generator[None, None, None]:
    """Within the block, :func:`wrap` wraps modules with ``wrapper_cls(module, **kwargs)``.

    FSDP1's manual wrapping: build a model with ``wrap(layer)`` around the layers that should
    be units of their own; outside the block the same code builds the plain model.

    Args:
        wrapper_cls: the wrapper, ``FullyShardedDataParallel`` typically.
        **wrapper_kwargs: the wrapper's arguments for every ``wrap`` in the block.

    Raises:
        NotImplementedError: the block is inside another one (FSDP1 does not nest them).
    """
    if _MANUAL_WRAP.get() is not None:
        raise NotImplementedError(
            "enable_wrap is already active: nested enable_wrap blocks are not supported (as in "
            "FSDP1); pass different arguments to wrap() instead"
        )
    token = _MANUAL_WRAP.set(_ManualWrap(wrapper_cls, dict(wrapper_kwargs)))
    try:
        yield
    finally:
        _MANUAL_WRAP.reset(token)


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """``module`` wrapped as :func:`enable_wrap` says, or ``module`` itself outside of it.

    Args:
        module: the module to make a unit of its own.
        **wrap_overrides: arguments that replace ``enable_wrap``'s for this module.
    """
    manual = _MANUAL_WRAP.get()
    if manual is None:
        return module
    return manual.wrapper_cls(module, **{**manual.kwargs, **wrap_overrides})


def auto_wrap_targets(
    root: nn.Module,
    policy: object,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    root_kwargs: dict[str, Any],
) -> Targets:
    """The submodules of ``root`` that ``policy`` gives a unit of their own (never ``root``).

    With mixed precision, modules of ``mixed_precision._module_classes_to_ignore`` (batch
    norms by default) are also targets, in full precision, as in FSDP1.

    Raises:
        TypeError: ``policy`` is neither a policy object nor a function.
    """
    if isinstance(policy, WrapPolicy):
        found = policy.targets(root, ignored_modules, root_kwargs)
    elif is_torch_policy(policy):
        found = torch_policy_targets(policy, root, ignored_modules, root_kwargs)
    elif callable(policy):
        found = {}
        _ask_function(root, policy, ignored_modules, ignored_params, root_kwargs, found, True)
    else:
        raise TypeError(
            "auto_wrap_policy must be a policy object (ModuleWrapPolicy, CustomPolicy) or a "
            f"function (module, recurse, nonwrapped_numel) -> bool, got {type(policy).__name__}"
        )
    found.pop(root, None)
    for module in keep_full_precision(root, root_kwargs.get("mixed_precision"), ignored_modules):
        found[module] = dict(found.get(module, root_kwargs), mixed_precision=None)
    return found


def _ask_function(
    module: nn.Module,
    policy: Callable[..., bool],
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    root_kwargs: dict[str, Any],
    found: Targets,
    is_root: bool,
) -> int:
    """FSDP1's recursive walk: returns the parameters under ``module`` that got a unit."""
    numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    if not policy(module=module, recurse=True, nonwrapped_numel=numel):
        return 0
    wrapped = sum(
        _ask_function(child, policy, ignored_modules, ignored_params, root_kwargs, found, False)
        for child in module.children()
        if child not in ignored_modules
    )
    if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
        found[module] = dict(root_kwargs)
        return numel
    return wrapped


def keep_full_precision(
    root: nn.Module, mixed_precision: Any, ignored_modules: set[nn.Module]
) -> list[nn.Module]:
    """The modules that mixed precision leaves in full precision (batch norms by default).

    Each gets forward hooks that give it float32 inputs and give its outputs back in the
    inputs' dtype, so the modules around it still compute in low precision (FSDP1 does so).
    """
    classes = tuple(getattr(mixed_precision, "_module_classes_to_ignore", ()) or ())
    if mixed_precision is None or not classes:
        return []
    modules = [m for m in root.modules() if isinstance(m, classes) and m not in ignored_modules]
    for module in modules:
        module.register_forward_pre_hook(_to_float32, with_kwargs=True)
        module.register_forward_hook(_back_to_input_dtype, with_kwargs=True)
    return modules


# The dtype each full-precision module's floating inputs had, for its outputs.
_INPUT_DTYPES: dict[int, torch.dtype] = {}


def _to_float32(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == torch.float32:
            return t
        _INPUT_DTYPES[id(module)] = t.dtype
        return t.float()

    cast_args: tuple[tuple[Any, ...], dict[str, Any]] = map_tensors(cast, (args, kwargs))
    return cast_args


def _back_to_input_dtype(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    dtype = _INPUT_DTYPES.pop(id(module), None)
    if dtype is None:
        return output
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, output)
