"""FSDP's hooks as tools replace them: a state's forward hooks, a group's backward steps.

torch's ``FSDPMemTracker`` (``torch.distributed._tools``; torchtitan's memory estimation runs
it) instruments torch's ``fully_shard`` through its private objects: it removes each state's
forward hooks by their handles and registers wrappers of the same functions in their place,
and it replaces each group's ``pre_backward`` and ``post_backward`` with wrappers that call
the originals. On exit it undoes both. The torch-facing view serves those names on shardkit's
engine (``torch_view``); this module holds what they act on:

- :class:`ForwardHooks`: the two functions a state registers on each of its modules, and
  handles that remove them.
- :class:`ReplacedSteps`: a group's backward steps as a tool replaced them. The step driver
  runs each through :meth:`ReplacedSteps.run`; with no replacement that is one dictionary
  lookup. A replacement is called instead of the step, and the step is done when it calls
  the original (the view's own method), as with torch's objects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ForwardHooks", "ReplacedSteps"]

Hook = Callable[..., Any]


class _Handles:
    """One handle for the hooks of a list call's modules (``remove`` removes them all)."""

    __slots__ = ("_handles",)

    def __init__(self, handles: Sequence[RemovableHandle]) -> None:
        self._handles = tuple(handles)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


HookHandle = RemovableHandle | _Handles


def _one_handle(handles: Sequence[RemovableHandle]) -> HookHandle:
    return handles[0] if len(handles) == 1 else _Handles(handles)


class ForwardHooks:
    """A state's forward hooks, registered on its modules as torch registers its own.

    ``pre`` runs first among a module's forward pre-hooks and takes keyword arguments; ``post``
    runs after the module's other forward hooks. The handles are settable: a tool that
    re-registers the hooks keeps its handles here, where the next one finds them.
    """

    __slots__ = ("post", "post_handle", "pre", "pre_handle")

    def __init__(self, modules: Sequence[nn.Module], pre: Hook, post: Hook) -> None:
        self.pre = pre
        self.post = post
        self.pre_handle: object = _one_handle(
            [m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True) for m in modules]
        )
        self.post_handle: object = _one_handle(
            [m.register_forward_hook(post, prepend=False) for m in modules]
        )


class ReplacedSteps:
    """A group's ``pre_backward`` / ``post_backward`` as a tool replaced them (none at first)."""

    __slots__ = ("_by_name", "_running")

    def __init__(self) -> None:
        self._by_name: dict[str, Hook] = {}
        # The step a replacement is running for, by name; None while the step runs.
        self._running: dict[str, Callable[[], None] | None] = {}

    def replacement(self, name: str) -> Hook | None:
        """What replaces the step ``name``, if anything does."""
        return self._by_name.get(name)

    def replace(self, name: str, replacement: Hook | None) -> None:
        """Have ``replacement`` called for the step ``name`` (None: the step itself again)."""
        if replacement is None:
            self._by_name.pop(name, None)
        else:
            self._by_name[name] = replacement

    def run(self, name: str, step: Callable[[], None], *args: object) -> None:
        """Do ``step``, or call its replacement with ``args`` (torch's arguments for it)."""
        replacement = self._by_name.get(name)
        if replacement is None or name in self._running:  # none, or inside the original
            step()
            return
        self._running[name] = step
        try:
            replacement(*args)
        finally:
            del self._running[name]

    def run_original(self, name: str, direct: Callable[[], None]) -> None:
        """The original step, as the view's own method does it.

        Called by a replacement the engine is running: the step it stands for. Called
        otherwise (a pipeline schedule ending a stage's backward): ``direct``, with the
        replacement bypassed, as calling torch's own method directly runs only that method.
        """
        step = self._running.get(name)
        if step is not None:
            self._running[name] = None
            step()
            return
        if name in self._running:  # called again by the same replacement: the step is done
            direct()
            return
        self._running[name] = None
        try:
            direct()
        finally:
            del self._running[name]
