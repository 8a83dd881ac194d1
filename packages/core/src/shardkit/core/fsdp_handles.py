"""What ``FSDPModule``'s asynchronous calls return: ``UnshardHandle``, ``GradientReductionHandle``.

Each ``wait()`` finishes the work its call started, once; later calls return at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from shardkit.core.torch_facing.fsdp_classes import TorchUnshardHandle

if TYPE_CHECKING:
    from shardkit.core.engine.group.param_group import FSDPParamGroup

__all__ = ["GradientReductionHandle", "UnshardHandle"]


class UnshardHandle(TorchUnshardHandle):
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard.

    A subclass of torch's ``UnshardHandle`` (a base with a no-op ``wait``), so code that
    checks a handle against torch's class accepts it.
    """

    def __init__(self, groups: tuple[FSDPParamGroup, ...]) -> None:
        self._groups = groups

    def wait(self) -> None:
        """Block until the full parameters are gathered and registered."""
        groups, self._groups = self._groups, ()
        for group in groups:
            group.wait_for_unshard()


class GradientReductionHandle:
    """Returned by ``FSDPModule.finalize_backward(async_op=True)`` (torch 2.15's API).

    ``wait()`` finishes the reductions ``finalize_backward`` started and assigns the sharded
    gradients. A class of shardkit's own, as torch's exists only from 2.15 on; ``patch_torch``
    puts it under torch's name where torch has one.
    """

    def __init__(self, finish: Callable[[], None] | None = None) -> None:
        self._finish = finish

    def wait(self) -> None:
        """Finish the gradient reductions (once; later calls return at once)."""
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
