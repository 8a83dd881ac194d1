"""Torch's table of composable states, answered for shardkit's modules.

Torch keeps each composable call's state in a table keyed by module
(``torch.distributed._composable_state``), and its helpers look a module up there: torch's
private ``_get_managed_modules`` (what a ``fully_shard`` or ``replicate`` call on a parent
would manage) leaves out a module whose lookup finds a state of the API's kind, torch's
``FSDPState`` (``_ReplicateState`` for ``replicate``). A shardkit module is entered there with
a stand-in of that kind: an instance of torch's class on which every attribute is the
torch-facing view's, so a caller that goes on to use it reaches the names the view serves, and
any other fails by name (none of torch's state code runs). See [Note: torch-facing view].
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed._composable_state import _insert_module_state, _module_state_mapping
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState as _TorchFSDPState

try:  # torch's replicate on FSDP's engine has a state class of its own
    from torch.distributed._composable.replicate_with_fsdp import (
        _ReplicateState as _TorchReplicateState,
    )
except ImportError:  # a torch without it: replicate's modules stand as FSDP states
    _TorchReplicateState = _TorchFSDPState  # type: ignore[assignment,misc]

__all__ = ["enter_torch_state"]

# Where the stand-in is kept on the module: torch's table holds it weakly.
_STAND_IN_KEY = "_shardkit_torch_state"


class _ViewStandIn:
    """Every attribute read or written is the view's (dunders aside)."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "__dict__")["view"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "__dict__")["view"], name, value)


class _FSDPStateStandIn(_ViewStandIn, _TorchFSDPState):
    """A ``fully_shard`` module's entry: an instance of torch's ``FSDPState``."""


class _ReplicateStateStandIn(_ViewStandIn, _TorchReplicateState):
    """A ``replicate`` module's entry: an instance of torch's ``_ReplicateState`` too."""


_STAND_INS: dict[str, type[_FSDPStateStandIn | _ReplicateStateStandIn]] = {
    "fully_shard": _FSDPStateStandIn,
    "replicate": _ReplicateStateStandIn,
}


def enter_torch_state(module: nn.Module, view: object, api: str) -> None:
    """Enter ``module`` in torch's table with a stand-in for ``view`` (once per module).

    ``api``: ``"fully_shard"`` or ``"replicate"``, the kind of torch state it stands for.
    """
    if module in _module_state_mapping:
        return  # a list call's modules share one view; a module is entered once
    # Built without torch's __init__: the stand-in holds nothing of torch's state.
    stand_in = object.__new__(_STAND_INS[api])
    object.__getattribute__(stand_in, "__dict__")["view"] = view
    module.__dict__[_STAND_IN_KEY] = stand_in
    _insert_module_state(module, stand_in)
