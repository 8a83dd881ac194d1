"""shardkit.core's public signatures against torch.distributed.fsdp's, by ``inspect.signature``.

Code written for torch's ``fully_shard`` calls ours with the same arguments, positional ones
included, so each public function, class and ``FSDPModule`` method must take the same
parameters in the same order, of the same kinds, with the same defaults. Annotations are not
compared: ours name shardkit's types (or ``Any`` where torch's is a CUDA type) and torch's are
strings. A parameter shardkit adds must be keyword-only, after all of torch's.

The comparison is with the installed torch, whichever release of the tested range it is:
shardkit has the newest release's names on every release, and ``torch_releases`` lists those an
older torch lacks (each must then be missing from torch, and present from its release on).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import shardkit.core
from tests.core.torch_releases import ADDED_IN, INSTALLED, added_under, torch_has

_FREE_NAMES = [
    "fully_shard",
    "register_fsdp_forward_method",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
]
_NEWER = "torch {} has no {} (torch {}.{} added it)"

# Public callables ours has and torch's FSDPModule does not, each with the reason.
_OURS_ONLY_METHODS = {
    # nn.Module's own method, overridden to check every key before writing any; its
    # signature is compared with nn.Module's below.
    "load_state_dict": nn.Module.load_state_dict,
}
# shardkit's own settings, which torch's FSDPModule has no counterpart of.
_SHARDKIT_SETTINGS = {"set_reduce_precision", "set_custom_all_reduce", "set_conditional"}
# torch's Joinable protocol (torch.distributed.algorithms.join), for uneven inputs under Join
# (its join_device and join_process_group are properties).
_JOINABLE = {"join_hook"}


def _default(value: Any) -> Any:
    """A default as compared: a policy is our class on one side and torch's on the other,
    equal when the class names are and so are the fields set away from their defaults (a
    field a newer torch added, left at its default, is then no difference)."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return repr(value)
    changed = {
        f.name: repr(getattr(value, f.name))
        for f in dataclasses.fields(value)
        if getattr(value, f.name) != f.default
    }
    return (type(value).__name__, changed)


def _params(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind, _default(p.default)) for p in sig.parameters.values()]


def _problems(ours: Callable[..., Any], theirs: Callable[..., Any]) -> list[str]:
    """How ``ours`` differs from ``theirs`` beyond keyword-only additions at the end."""
    mine, torchs = _params(ours), _params(theirs)
    problems = [
        f"parameter {i}: ours {m}, torch's {t}"
        for i, (m, t) in enumerate(zip(mine, torchs, strict=False))
        if m != t
    ]
    if len(mine) < len(torchs):
        problems.append(f"ours lacks {[t[0] for t in torchs[len(mine) :]]}")
    for name, kind, default in mine[len(torchs) :]:
        if kind is not inspect.Parameter.KEYWORD_ONLY or default == _default(
            inspect.Parameter.empty
        ):
            problems.append(f"added parameter {name} must be keyword-only with a default")
    return problems


@pytest.mark.parametrize("name", _FREE_NAMES)
def test_functions_and_classes_match_torch(name: str) -> None:
    if not torch_has(name):
        pytest.skip(_NEWER.format(torch.__version__, name, *ADDED_IN[name]))
    ours, theirs = getattr(shardkit.core, name), getattr(torch_fsdp, name)
    assert _problems(ours, theirs) == [], name


@pytest.mark.parametrize("name", sorted(n for n in ADDED_IN if "." not in n))
def test_names_of_newer_torches_are_there_from_their_release_on(name: str) -> None:
    assert hasattr(shardkit.core, name)
    assert hasattr(torch_fsdp, name) == (ADDED_IN[name] <= INSTALLED), name


def _public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    return {
        n: v
        for n, v in vars(cls).items()
        if not n.startswith("_") and callable(v) and not isinstance(v, type)
    }


def test_fsdp_module_has_torchs_methods_and_no_others() -> None:
    ours = set(_public_methods(shardkit.core.FSDPModule))
    theirs = set(_public_methods(torch_fsdp.FSDPModule))
    newer = {name for name in added_under("FSDPModule") if not torch_has(f"FSDPModule.{name}")}
    assert sorted(theirs - ours) == []
    expected = {*_OURS_ONLY_METHODS, *_SHARDKIT_SETTINGS, *_JOINABLE, *newer}
    assert sorted(ours - theirs) == sorted(expected)
    assert theirs & newer == set(), "torch_releases.ADDED_IN gives a later release"


@pytest.mark.parametrize("name", sorted(_public_methods(torch_fsdp.FSDPModule)))
def test_fsdp_module_methods_match_torch(name: str) -> None:
    ours = getattr(shardkit.core.FSDPModule, name)
    assert _problems(ours, getattr(torch_fsdp.FSDPModule, name)) == [], name


@pytest.mark.parametrize("name", sorted(_OURS_ONLY_METHODS))
def test_overridden_module_methods_keep_nn_modules_signature(name: str) -> None:
    ours = getattr(shardkit.core.FSDPModule, name)
    assert _problems(ours, _OURS_ONLY_METHODS[name]) == [], name


def test_unshard_handle_wait_matches_torch() -> None:
    # Users only receive handles (from unshard(async_op=True)), so only the methods count:
    # torch's public UnshardHandle has no constructor of its own and ours takes the group.
    assert set(_public_methods(shardkit.core.UnshardHandle)) == set(
        _public_methods(torch_fsdp.UnshardHandle)
    )
    assert _problems(shardkit.core.UnshardHandle.wait, torch_fsdp.UnshardHandle.wait) == []


def test_gradient_reduction_handle_wait_matches_torch() -> None:
    if not torch_has("GradientReductionHandle"):
        pytest.skip(_NEWER.format(torch.__version__, "GradientReductionHandle", 2, 15))
    # vars: the torch that mypy reads (constraints.txt's) may be older than 2.15.
    theirs = vars(torch_fsdp)["GradientReductionHandle"]
    ours = shardkit.core.GradientReductionHandle
    assert set(_public_methods(ours)) == set(_public_methods(theirs))
    assert _problems(ours.wait, theirs.wait) == []


def test_policies_take_positional_arguments_as_torchs_do() -> None:
    ours = shardkit.core.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    theirs = torch_fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
    assert shardkit.core.CPUOffloadPolicy(False).pin_memory is False
    assert shardkit.core.DataParallelMeshDims("dp", "rep").replicate == "rep"


def test_policies_stay_frozen() -> None:
    policy = shardkit.core.MixedPrecisionPolicy(torch.bfloat16)
    with pytest.raises(AttributeError):
        policy.param_dtype = torch.float32  # type: ignore[misc]


def test_replicate_matches_torchs_replicate_with_fsdp() -> None:
    """``replicate``'s signature and its module class's public methods are torch's."""
    from torch.distributed._composable import replicate_with_fsdp as torchs

    from shardkit.core.replicate_api import is_composable_with_replicate

    assert _problems(shardkit.core.replicate, torchs.replicate) == []
    assert _problems(is_composable_with_replicate, torchs.is_composable_with_replicate) == []
    # torch's ReplicateModule adds no public method to its FSDPModule; neither does ours.
    assert _public_methods(torchs.ReplicateModule) == {}
    assert _public_methods(shardkit.core.ReplicateModule) == {}
    assert issubclass(shardkit.core.ReplicateModule, shardkit.core.FSDPModule)
