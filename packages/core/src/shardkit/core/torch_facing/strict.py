"""Strictness of the torch-facing view: a name it does not serve fails by name.

Code written for torch's FSDP2 that reaches a private name shardkit does not serve gets an
``AttributeError`` naming the object, the name and where the served names are listed, never
a silent ``None`` or a write that changes nothing. See [Note: torch-facing view].
"""

from __future__ import annotations

import types
from typing import Any, ClassVar

__all__ = ["ShadowsTorchClass", "Strict", "not_served"]


def not_served(owner: str, name: str) -> AttributeError:
    """The error for a private torch name ``owner`` does not serve."""
    return AttributeError(
        f"{owner}.{name}: shardkit's fully_shard serves only the private torch FSDP names "
        "listed in its torch-facing view (docs/notes/018-torch-facing-view.md); use "
        "FSDPModule's public methods (or shardkit.core.register_fsdp_forward_method)"
    )


class Strict:
    """Any attribute the view does not serve fails by name (``hasattr`` reads False)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names no slot, property or method answers.
        if name.startswith("__"):
            raise AttributeError(name)  # copy, pickle and friends probe dunders
        raise not_served(type(self).__name__, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Slots and settable properties only: a write torch's objects would take but shardkit
        # would ignore fails by name instead.
        try:
            object.__setattr__(self, name, value)
        except AttributeError:
            raise not_served(type(self).__name__, name) from None


class ShadowsTorchClass(Strict):
    """Strict, for a view that also subclasses one of torch's classes.

    Torch's code tells its objects apart with ``isinstance`` (``_get_module_fsdp_state`` asks
    whether a module's state is an ``FSDPState``), so a view may need torch's class among its
    bases. What that class defines and the view does not serve must still fail by name, not
    run torch's code on a view that lacks torch's fields; and as torch's class gives instances
    a ``__dict__``, writes are limited here to the view's slots and settable properties.
    """

    __slots__ = ()

    # Set per subclass: torch's names it does not serve, and the names it takes writes to.
    _torch_only: ClassVar[frozenset[str]] = frozenset()
    _writable: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        ours: dict[str, object] = {}
        theirs: set[str] = set()
        for klass in reversed(cls.__mro__):
            if klass is object:
                continue
            if issubclass(klass, Strict):
                ours.update(vars(klass))
            else:
                theirs.update(vars(klass))
        cls._torch_only = frozenset(n for n in theirs - ours.keys() if not n.startswith("__"))
        cls._writable = frozenset(
            name
            for name, attr in ours.items()
            if isinstance(attr, types.MemberDescriptorType)
            or (isinstance(attr, property) and attr.fset is not None)
        )

    def __getattribute__(self, name: str) -> Any:
        if name in type(self)._torch_only:
            raise not_served(type(self).__name__, name)
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in type(self)._writable:
            raise not_served(type(self).__name__, name)
        object.__setattr__(self, name, value)
