"""The one module of the core that uses torch.compile's private API: dynamo's frame actions.

The engine's forward hooks unshard and reshard through collectives and storage resizes, so
under torch.compile they run as Python, never traced, as torch's FSDP hooks do. The hooks meet
dynamo in two ways, and :func:`eager_hook` handles both. torch has no public name for the
first: ``torch.compiler.disable(fn, recursive=False)`` skips only ``fn``'s own frame (the hook
it calls would be traced), and ``recursive=True`` is a wrapper whose cost on every call the
engine avoids. See [Note: compiled hooks].
"""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType
from typing import ParamSpec, TypeVar

import torch

__all__ = ["eager_hook"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def eager_hook(hook: Callable[_P, _R]) -> Callable[_P, _R]:
    """``hook``, run eagerly when torch.compile compiles the module it is registered on.

    - A module compiled by itself (``block.compile()``, before or after ``fully_shard``):
      dynamo skips ``nn.Module``'s call (torch's own code) and meets each hook as a frame of
      its own. The wrapper's code is marked to be skipped with everything it calls, so the
      hook runs as Python and dynamo traces the module's ``forward`` alone: no graph break,
      which ``fullgraph=True`` would refuse.
    - A module called inside a traced frame (the model compiled whole): dynamo inlines the
      call and the wrapper, reads ``is_compiling()`` as True and reaches the
      ``torch.compiler.disable``d hook, where the graph breaks, as at torch's hooks.

    Outside torch.compile the wrapper calls the hook after one ``is_compiling()`` check: a
    ``torch.compiler.disable`` wrapper on every call costs about 8% of a step on a model of
    many small layers, and the mark is read by dynamo's frame evaluation only.
    """
    disabled: Callable[_P, _R] = torch.compiler.disable(hook)

    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return hook(*args, **kwargs)

    _skip_with_callees(run.__code__)  # one code object for every hook: marked again, unchanged
    return run


def _skip_with_callees(code: CodeType) -> None:
    """Have dynamo run ``code``'s frames, and every frame they call, as plain Python.

    Dynamo's frame action (skip this frame, skip its callees), which its frame evaluation reads
    before it would trace a frame. It lives on the code object, survives
    ``torch._dynamo.reset()`` (which clears only code that dynamo has met) and is in every
    torch of the tested range, 2.10 to 2.15, under these names.
    """
    # Imported here: torch.compiler.disable has loaded dynamo by now; ``import shardkit.core``
    # does not pay for it.
    from torch._C._dynamo.eval_frame import (
        _FrameAction,
        _FrameExecStrategy,
        set_code_exec_strategy,
    )

    skip = _FrameAction.SKIP
    set_code_exec_strategy(code, _FrameExecStrategy(skip, skip))
