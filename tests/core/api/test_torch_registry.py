"""Torch's own private helpers see shardkit's calls as torch's: the composable-state registry.

Torch files each ``fully_shard`` call's state in a registry of composable states, and its
helpers ask it which modules another call already manages (``_get_managed_modules`` leaves
them out; torch's own ``test_fully_shard_init.py`` calls it directly). shardkit's view is filed
there and is an instance of torch's ``FSDPState``, serving none of torch's methods it does not
list. A list call's ``_modules_to_run_forward`` reads as torch's through a pass (torch's
``test_modules_to_run_forward_empty_for_single_module``, and the chunked-loss path). Both
engines run here on the fake process group, on models of the same shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_init import (
    _get_managed_modules,
    _get_managed_states,
)
from torch.distributed.fsdp._fully_shard._fsdp_state import (
    FSDPState as TorchFSDPState,
)
from torch.distributed.fsdp._fully_shard._fsdp_state import (
    _get_module_fsdp_state,
)

import shardkit.core
from tests.core.fake_group import fake_mesh
from tests.core.torch_releases import INSTALLED

WORLD = 2
ENGINES = {"torch": torch_fully_shard, "shardkit": shardkit.core.fully_shard}


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with fake_mesh(WORLD) as mesh:
        yield mesh


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("buffer", torch.zeros(8))

    def forward(self, x: Any) -> Any:
        return self.out_proj(self.in_proj(x)) + self.buffer


def _names(model: nn.Module, objects: Any, kind: str) -> list[str]:
    named = dict(getattr(model, f"named_{kind}")())
    by_id = {id(obj): name for name, obj in named.items()}
    return sorted(by_id[id(obj)] for obj in objects)


def _managed(fs: Any, mesh: DeviceMesh) -> dict[str, Any]:
    """What torch's helpers say a call on the root would manage, a block already sharded."""
    model = nn.Sequential(_MLP(), _MLP(), _MLP())
    fs(model[0], mesh=mesh)
    fs([model[2].in_proj, model[2].out_proj], mesh=mesh)
    modules = _get_managed_modules((model,))
    params, buffers = _get_managed_states(modules)
    return {
        "modules": _names(model, modules, "modules"),
        "params": _names(model, params, "parameters"),
        "buffers": _names(model, buffers, "buffers"),
        "filed": [
            _get_module_fsdp_state(m) is fs.state(m)
            for m in (model[0], model.get_submodule("2.in_proj"))
        ],
    }


def test_torchs_managed_modules_leave_out_modules_already_sharded(mesh: DeviceMesh) -> None:
    theirs = _managed(torch_fully_shard, mesh)
    assert theirs["modules"] == ["", "1", "1.in_proj", "1.out_proj", "2"]
    assert theirs["params"] == [
        "1.in_proj.bias", "1.in_proj.weight", "1.out_proj.bias", "1.out_proj.weight"
    ]  # fmt: skip
    assert theirs["buffers"] == ["1.buffer", "2.buffer"] and theirs["filed"] == [True, True]
    assert _managed(shardkit.core.fully_shard, mesh) == theirs


def test_the_view_is_a_torch_state_that_serves_only_its_names(mesh: DeviceMesh) -> None:
    ours: Any = shardkit.core.fully_shard
    model = ours(nn.Linear(4, 4), mesh=mesh)
    view = ours.state(model)
    assert isinstance(view, TorchFSDPState) and _get_module_fsdp_state(model) is view
    # Torch's own methods are not inherited: torch's code would run on fields the view lacks.
    for name in ("_root_pre_forward", "init", "_state_name", "_register_pre_backward_hook"):
        assert not hasattr(view, name), name
    with pytest.raises(AttributeError, match=r"TorchFacingState\.init: shardkit"):
        _ = view.init
    # Its instances have a __dict__ now (torch's class), yet writes stay limited.
    with pytest.raises(AttributeError, match=r"TorchFacingState\._is_root: shardkit"):
        view._is_root = True
    handle = view._pre_forward_hook_handle
    view._pre_forward_hook_handle = handle  # served, as FSDPMemTracker swaps it
    assert view._pre_forward_hook_handle is handle


class _ChunkedHead(nn.Module):
    """Torch's chunked-loss model, small: the root's forward skips ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.norm, self.head = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.body(x))
        return out


def _pending(fs: Any, mesh: DeviceMesh) -> list[tuple[str, list[str]]]:
    """``_modules_to_run_forward`` of each call, named, at each point of a chunked-loss step.

    The root skips ``head`` of the list call ``[norm, head]`` in its forward, then ``head``
    runs alone on the output; single-module calls stay empty throughout.
    """
    torch.manual_seed(0)
    model = _ChunkedHead()
    fs(model.body, mesh=mesh)
    fs([model.norm, model.head], mesh=mesh)
    fs(model, mesh=mesh)
    names = {id(m): n for n, m in model.named_modules()}
    seen: list[tuple[str, list[str]]] = []

    def record(point: str) -> None:
        for label in ("", "body", "norm"):
            state = fs.state(model.get_submodule(label))
            pending = sorted(names[id(m)] for m in state._modules_to_run_forward)
            seen.append((f"{point}:{label}", pending))

    for label in ("body", "norm", "head"):
        model.get_submodule(label).register_forward_pre_hook(
            lambda *_, label=label: record(f"pre-{label}")
        )
    record("init")
    h = model(torch.randn(4, 8))
    record("after-forward")
    chunk = h.detach().requires_grad_(True)
    model.head(chunk).sum().backward()
    record("after-head")
    h.backward(chunk.grad)
    record("after-backward")
    return seen


def test_modules_to_run_forward_reads_as_torchs(mesh: DeviceMesh) -> None:
    try:
        theirs = _pending(torch_fully_shard, mesh)
    except RuntimeError as error:
        if INSTALLED >= (2, 13) or "data is not allocated yet" not in str(error):
            raise
        # The oracle cannot run the program there (its backward reads a freed parameter).
        first = str(error).splitlines()[0]
        pytest.skip(f"torch {torch.__version__}'s own fully_shard fails this program: {first}")
    pending = {point: names for point, names in theirs if names}
    # The list call mid-pass; the standalone head call starts a pass of its own, which the end
    # of backward closes.
    assert pending == {
        "pre-norm:norm": ["head", "norm"],
        "pre-head:norm": ["head", "norm"],
        "after-head:norm": ["norm"],
    }, pending
    assert _pending(shardkit.core.fully_shard, mesh) == theirs
