"""How ``fully_shard`` and ``replicate`` take over their modules, once the engine built them.

Each API checks its own arguments and picks its mesh, then calls the shared builder
(``engine/build.py``). What comes after is the same for both and written here once
(:meth:`ComposableApi.adopt`): each module gets the call's torch-facing view (where torch's
``<api>.state`` looks) and the API's name in torch's composable registry, and its class is
swapped for the API's (``FSDP<Cls>`` or ``Replicate<Cls>``, which the API makes); the call
returns what it was given, one module or a list. So does torch's ``<api>.state(module)``
(:meth:`ComposableApi.state`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from torch import nn

from shardkit.core.engine.fsdp_state import FSDPState
from shardkit.core.engine.state_registry import is_managed
from shardkit.core.fsdp_module import FSDPModule
from shardkit.core.torch_facing.composable_registry import record_api
from shardkit.core.torch_facing.view import TorchFacingState, api_view, attach_view

__all__ = ["ComposableApi", "modules_of"]

M = TypeVar("M", bound=FSDPModule)


def modules_of(given: nn.Module | list[nn.Module]) -> tuple[nn.Module, ...]:
    """The modules of one call: the list given, or the one module."""
    return tuple(given) if isinstance(given, list) else (given,)


@dataclass(frozen=True, slots=True)
class ComposableApi(Generic[M]):
    """``fully_shard`` or ``replicate``, as it takes over the modules the builder sharded."""

    name: Literal["fully_shard", "replicate"]
    """The API's name, as torch's registry and its ``<api>.state`` know it."""
    kind: type[M]
    """What every module it manages becomes an instance of (``FSDPModule`` or a subclass)."""
    class_for: Callable[[type[nn.Module]], type[nn.Module]]
    """The class that a module of a given class is swapped to."""

    def adopt(self, given: nn.Module | list[nn.Module], state: FSDPState) -> M | list[M]:
        """Take over ``state``'s modules (those of ``given``): view, registry, class.

        Returns:
            The same module(s), in the shape given: one module, or a list.
        """
        for m in state.modules:
            attach_view(m, state, self.name)
            record_api(m, self.name)
            m.__class__ = self.class_for(type(m))
        # Each is a ``kind`` now: as objects, since the checker cannot see a module as ``M``.
        swapped: tuple[object, ...] = state.modules
        adopted = [m for m in swapped if isinstance(m, self.kind)]
        return adopted if isinstance(given, list) else adopted[0]

    def state(self, module: nn.Module) -> TorchFacingState | None:
        """The torch-facing view of this API's call that manages ``module`` itself, else None."""
        return api_view(module, self.name) if is_managed(module) else None
