"""Libraries written for torch's FSDP2 run on shardkit under ``patch_torch``, as on torch's.

Hugging Face ``transformers`` (a Llama decoder built from a config, sharded layer by layer
with torch's names) and Accelerate's FSDP2 path (``Accelerator.prepare``, which imports
``fully_shard``, ``FSDPModule`` and ``MixedPrecisionPolicy`` from ``torch.distributed.fsdp``
when it runs). Neither is a dependency of shardkit's packages; both are pinned test
dependencies (``make setup`` and the hatch environments install them, so CI runs these
tests). An environment made otherwise skips each test, with the reason, where its library is
missing.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardkit.core as sk
from harness.pool import run_on_ranks
from tests.core.interop.hf_models import tiny_llama

WORLD_SIZE = 2
STEPS = 3

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (not a dependency of shardkit)",
)
needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None
    or importlib.util.find_spec("transformers") is None,
    reason="accelerate and transformers are not installed (not dependencies of shardkit)",
)


def _batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 64, (2 * world_size, 12), generator=gen)
    return tokens.chunk(world_size)[rank]


def _global(loss: torch.Tensor, world_size: int) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world_size


def _hf_body(rank: int, world_size: int, patched: bool) -> dict[str, Any]:
    with sk.patched_torch() if patched else _unpatched():
        from torch.distributed.fsdp import FSDPModule, fully_shard

        model = tiny_llama()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        engine = type(model).__module__
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            x = _batch(step, rank, world_size)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(_global(loss, world_size))
        return {"losses": losses, "engine": engine, "fsdp": isinstance(model, FSDPModule)}


class _unpatched:
    """A no-op context that checks no patch leaked in from another test."""

    def __enter__(self) -> None:
        assert not sk.is_torch_patched()

    def __exit__(self, *exc: object) -> None:
        return None


@needs_transformers
def test_a_transformers_decoder_patched_trains_as_on_torch() -> None:
    ours = run_on_ranks(WORLD_SIZE, _hf_body, patched=True)[0]
    theirs = run_on_ranks(WORLD_SIZE, _hf_body, patched=False)[0]
    assert ours["engine"] == "shardkit.core.api" and ours["fsdp"]
    assert theirs["engine"].startswith("torch.") and theirs["fsdp"]
    assert ours["losses"] == theirs["losses"]


def _accelerate_body(rank: int, world_size: int, patched: bool) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    with sk.patched_torch() if patched else _unpatched():
        from torch.distributed.fsdp import FSDPModule

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        )
        accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
        # Accelerate selects FSDP for accelerators only (multi-CPU runs become DDP); its FSDP2
        # code itself has nothing device-specific, so the test selects it as on a GPU.
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        try:
            model = tiny_llama()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, opt = accelerator.prepare(model, opt)
            wrapped = [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]
            losses = []
            for step in range(STEPS):
                x = _batch(step, rank, world_size)
                loss = model(input_ids=x, labels=x).loss
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(_global(loss, world_size))
            return {"losses": losses, "engine": type(model).__module__, "wrapped": wrapped}
        finally:
            # Accelerate keeps its state in class attributes: the next task starts afresh.
            AcceleratorState._reset_state(True)


@needs_accelerate
def test_accelerates_fsdp2_path_patched_trains_as_on_torch() -> None:
    ours = run_on_ranks(WORLD_SIZE, _accelerate_body, patched=True)[0]
    theirs = run_on_ranks(WORLD_SIZE, _accelerate_body, patched=False)[0]
    assert ours["engine"] == "shardkit.core.api"
    assert theirs["engine"].startswith("torch.")
    # The same modules sharded (the decoder layers by the policy, and what Accelerate adds).
    assert ours["wrapped"] == theirs["wrapped"]
    assert ours["wrapped"].count("FSDPLlamaDecoderLayer") == 2
    assert ours["losses"] == theirs["losses"]
