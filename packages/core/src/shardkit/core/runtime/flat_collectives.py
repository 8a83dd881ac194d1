"""The flat-buffer collectives under the name the installed torch gives them.

torch 2.13 names them ``all_gather_single`` and ``reduce_scatter_single`` and deprecates the
older names (a FutureWarning on every call); 2.10 to 2.12 have only the older
``all_gather_into_tensor`` and ``reduce_scatter_tensor``, which do the same. Chosen once, at
import, by what torch has; the older name is looked up only where the newer is missing, since a
later torch may drop it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single: Callable[..., dist.Work | None] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
"""Gather every rank's flat input into one flat output, in rank order."""

reduce_scatter_single: Callable[..., dist.Work | None] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)
"""Reduce a flat input across ranks; each rank keeps its own equal slice."""
