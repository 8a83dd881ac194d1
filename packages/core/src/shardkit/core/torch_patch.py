"""``patch_torch``: torch's public FSDP names resolve to shardkit's, until ``unpatch_torch``.

Libraries written for torch (Accelerate, torchtitan, the FSDP2 examples) import
``fully_shard`` and friends from ``torch.distributed.fsdp``; they cannot be told to import from
``shardkit.core`` instead. :func:`patch_torch` sets those names, in the public modules where
libraries import them, to shardkit's objects; :func:`unpatch_torch` puts torch's back.

What it cannot reach: a module that ran ``from torch.distributed.fsdp import fully_shard``
before the patch holds torch's function in its own namespace. ``python -m shardkit.core.run``
patches before the program imports anything, which avoids that. Torch's own modules that bind
FSDP names at import for internal use (DCP's state-dict helpers) are imported before the
patch on purpose, so torch's internals keep torch's objects. (shardkit.legacy's hook is the
exception it chooses: it points the DCP helpers' FSDP1 names at its own wrapper.)

Other packages add names through the entry-point group :data:`ENTRY_POINT_GROUP`: each entry
is a zero-argument callable returning ``{module name: {attribute: object}}`` (shardkit.legacy
adds FSDP1's names that way; the core knows nothing of it). Every replacement is checked
before the first one is made, so a failed patch changes nothing.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from importlib.metadata import entry_points
from types import ModuleType

from shardkit.core.optim.torch_muon import refuse_torch_muon_on_shards

__all__ = [
    "ENTRY_POINT_GROUP",
    "FSDP2_MODULES",
    "REPLICATE_MODULE",
    "Replacements",
    "core_replacements",
    "is_torch_patched",
    "patch_torch",
    "patched_torch",
    "unpatch_torch",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "shardkit.core.torch_patches"

Replacements = Mapping[str, Mapping[str, object]]
"""Module name -> attribute name -> the object that replaces torch's there."""

FSDP2_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
"""Where libraries import torch's FSDP2 names from (the last two are older spellings)."""

REPLICATE_MODULE = "torch.distributed._composable.replicate_with_fsdp"
"""Where torch's ``replicate`` on FSDP's engine lives (torch's pipelining imports it there)."""

# Torch's modules that bind FSDP names at import for their own use: imported before the patch
# so they keep torch's objects (DCP's helpers call FSDP1's class methods on torch's FSDP1).
_TORCH_INTERNAL_USERS = ("torch.distributed.checkpoint.state_dict",)

# (module name, attribute) -> torch's object, for every name replaced; empty when unpatched.
_ORIGINALS: dict[tuple[str, str], object] = {}


def core_replacements() -> dict[str, dict[str, object]]:
    """Shardkit's FSDP2 objects under torch's names, in each of :data:`FSDP2_MODULES`.

    A module gets only the names it has (``torch.distributed._composable.fsdp`` has no
    ``UnshardHandle``, say; torch 2.11 has no ``DataParallelMeshDims``, 2.14 no
    ``GradientReductionHandle``), so the patch never adds a name torch does not define there.
    """
    # From the modules that define them, not the package (whose __init__ imports this
    # module): no circle of imports, even a late one.
    from shardkit.core.api import fully_shard, register_fsdp_forward_method
    from shardkit.core.comm_sharing import share_comm_ctx
    from shardkit.core.fsdp_handles import GradientReductionHandle, UnshardHandle
    from shardkit.core.fsdp_module import FSDPModule
    from shardkit.core.policies import (
        CPUOffloadPolicy,
        DataParallelMeshDims,
        MixedPrecisionPolicy,
        OffloadPolicy,
    )

    ours: dict[str, object] = {
        "CPUOffloadPolicy": CPUOffloadPolicy,
        "DataParallelMeshDims": DataParallelMeshDims,
        "FSDPModule": FSDPModule,
        "GradientReductionHandle": GradientReductionHandle,
        "MixedPrecisionPolicy": MixedPrecisionPolicy,
        "OffloadPolicy": OffloadPolicy,
        "UnshardHandle": UnshardHandle,
        "fully_shard": fully_shard,
        "register_fsdp_forward_method": register_fsdp_forward_method,
        "share_comm_ctx": share_comm_ctx,
    }
    out: dict[str, dict[str, object]] = {}
    for name in FSDP2_MODULES:
        module = importlib.import_module(name)
        out[name] = {attr: obj for attr, obj in ours.items() if hasattr(module, attr)}
    out.update(_replicate_replacements())
    return out


def _replicate_replacements() -> dict[str, dict[str, object]]:
    """Shardkit's ``replicate`` names in :data:`REPLICATE_MODULE`, where torch has it."""
    from shardkit.core.replicate_api import (
        ReplicateModule,
        is_composable_with_replicate,
        replicate,
    )

    try:
        module = importlib.import_module(REPLICATE_MODULE)
    except ImportError:  # a torch without it: nothing to replace
        return {}
    ours: dict[str, object] = {
        "ReplicateModule": ReplicateModule,
        "is_composable_with_replicate": is_composable_with_replicate,
        "replicate": replicate,
    }
    return {REPLICATE_MODULE: {a: obj for a, obj in ours.items() if hasattr(module, a)}}


def is_torch_patched() -> bool:
    """Whether :func:`patch_torch` is in effect."""
    return bool(_ORIGINALS)


def patch_torch() -> None:
    """Make torch's public FSDP names resolve to shardkit's (idempotent).

    ``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``,
    ``OffloadPolicy``, ``UnshardHandle``, ``register_fsdp_forward_method``,
    ``DataParallelMeshDims``, ``share_comm_ctx`` and ``GradientReductionHandle`` in
    :data:`FSDP2_MODULES` (those of them the installed torch has); ``replicate``,
    ``ReplicateModule`` and ``is_composable_with_replicate`` in :data:`REPLICATE_MODULE`;
    plus what the packages registered under :data:`ENTRY_POINT_GROUP` add (FSDP1's names,
    with shardkit-legacy installed). From then on ``torch.optim.Muon`` is refused on sharded
    matrices whichever engine sharded them (``shardkit.core.optim.torch_muon``).

    Raises:
        RuntimeError: a registered patch could not be loaded, names a module that does not
            import or an attribute that module lacks, or two patches disagree on a name.
            Nothing is replaced then.
    """
    if _ORIGINALS:
        return
    # A module that imported torch's fully_shard before the patch still shards with torch's
    # engine: torch's Muon on those shards is refused too, as on shardkit's.
    refuse_torch_muon_on_shards()
    for name in _TORCH_INTERNAL_USERS:
        importlib.import_module(name)
    plan = _plan()
    for (module, attr), (original, new) in plan.items():
        setattr(module, attr, new)
        _ORIGINALS[(module.__name__, attr)] = original
    logger.info("patch_torch: %d torch names now resolve to shardkit's", len(plan))


def unpatch_torch() -> None:
    """Put torch's own objects back under every name :func:`patch_torch` replaced (idempotent)."""
    while _ORIGINALS:
        (name, attr), original = _ORIGINALS.popitem()
        setattr(importlib.import_module(name), attr, original)


@contextmanager
def patched_torch() -> Iterator[None]:
    """Torch's FSDP names are shardkit's inside the ``with`` block.

    If the patch was already in effect on entry, it stays in effect on exit.
    """
    owner = not is_torch_patched()
    patch_torch()
    try:
        yield
    finally:
        if owner:
            unpatch_torch()


def _plan() -> dict[tuple[ModuleType, str], tuple[object, object]]:
    """(module, attribute) -> (torch's object, ours) for every replacement, all checked."""
    sources: list[tuple[str, Callable[[], Replacements]]] = [("shardkit.core", core_replacements)]
    sources += _registered()
    plan: dict[tuple[ModuleType, str], tuple[object, object]] = {}
    claimed: dict[tuple[str, str], str] = {}
    for source, make in sources:
        try:
            replacements = make()
        except Exception as err:
            raise RuntimeError(f"patch_torch: the patch of {source} failed: {err!r}") from err
        for name, names in replacements.items():
            module = _module(name, source)
            for attr, new in names.items():
                if not hasattr(module, attr):
                    raise RuntimeError(
                        f"patch_torch: {source} replaces {name}.{attr}, which torch does not have"
                    )
                other = claimed.setdefault((name, attr), source)
                if other != source and plan[(module, attr)][1] is not new:
                    raise RuntimeError(
                        f"patch_torch: {other} and {source} both replace {name}.{attr}"
                    )
                plan[(module, attr)] = (getattr(module, attr), new)
    return plan


def _module(name: str, source: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise RuntimeError(f"patch_torch: {source} names module {name}: {err}") from err


def _registered() -> list[tuple[str, Callable[[], Replacements]]]:
    """The patches other packages declare under :data:`ENTRY_POINT_GROUP`."""
    found: list[tuple[str, Callable[[], Replacements]]] = []
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            make = entry.load()
        except Exception as err:
            raise RuntimeError(
                f"patch_torch: cannot load the patch {entry.name!r} ({entry.value}): {err!r}"
            ) from err
        found.append((f"{entry.name} ({entry.value})", make))
    return found
