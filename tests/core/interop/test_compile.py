"""torch.compile on sharded models: every order of compiling and sharding a block, and the model.

Orders (``where``):

- ``blocks``: ``block.compile()``, then ``fully_shard(block)`` (torchtitan's order, with
  ``fullgraph=True``);
- ``blocks_after``: ``fully_shard(block)``, then ``block.compile()``;
- ``wrapped``: ``fully_shard(torch.compile(block))`` (older torchtitan's order): the block in
  the model is replaced by torch's ``OptimizedModule``, whose parameters are named
  ``_orig_mod.*``;
- ``wrapped_after``: ``torch.compile(fully_shard(block))``, replacing the block likewise;
- ``model``: the sharded model compiled whole.

With ``fullgraph=True`` (``blocks`` and ``blocks_after``), dynamo must trace each block's
forward as one graph: the FSDP hooks around it run as Python, with no graph break (see
docs/notes/016-compiled-hooks.md).

Most cases compile with aot_eager: dynamo traces the model and AOTAutograd builds the forward
and backward graphs, which is where an FSDP's hooks matter (they must run eagerly: they unshard
through collectives); the fullgraph cases also with the eager backend (dynamo alone). Two small
cases compile with inductor's C++ backend, on one rank (a first compile takes about 20 s of CPU
here; inductor's on-disk cache makes later runs quick).
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from tests.core import models
from tests.core.parity import _policy_for, full_params, fully_shard_of, global_loss, rank_batch

BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def _shard_and_compile(
    impl: str, model: Any, case: dict[str, Any], backend: CompileCounterWithBackend
) -> Any:
    """Apply ``impl``'s fully_shard and torch.compile in the order ``case["where"]`` names."""
    blocks: nn.ModuleList = model.blocks
    where, mp = case["where"], case["mp"]
    fullgraph = case.get("fullgraph", False)
    kwargs: dict[str, Any] = {}
    if impl != "local":
        kwargs["mesh"] = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        if mp:
            from shardkit.core import MixedPrecisionPolicy

            kwargs["mp_policy"] = _policy_for(impl, MixedPrecisionPolicy(**mp))

    def shard(module: nn.Module) -> None:
        if impl != "local":
            fully_shard_of(impl)(module, **kwargs)

    for i, block in enumerate(blocks):
        if where == "blocks":
            block.compile(backend=backend, fullgraph=fullgraph)
            shard(block)
        elif where == "blocks_after":
            shard(block)
            block.compile(backend=backend, fullgraph=fullgraph)
        elif where == "wrapped":
            blocks[i] = cast(nn.Module, torch.compile(block, backend=backend))
            shard(blocks[i])
        elif where == "wrapped_after":
            shard(block)
            blocks[i] = cast(nn.Module, torch.compile(block, backend=backend))
        else:
            shard(block)
    shard(model)
    return torch.compile(model, backend=backend) if where == "model" else model


def _train(impl: str, rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    torch._dynamo.reset()  # each implementation compiles afresh
    counter = CompileCounterWithBackend(case["backend"])
    name = case["model"]
    model = models.build(name)
    run = _shard_and_compile(impl, model, case, counter)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(case["steps"]):
        x, y = rank_batch(name, step, rank, world_size, impl)
        loss = models.loss_of(name, run(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, impl, world_size))
    return {
        "losses": losses,
        "frames": counter.frame_count,  # graphs compiled: 0 would mean nothing was compiled
        "names": [name for name, _ in model.named_parameters()],
        "keys": list(model.state_dict()),
        "params": full_params(model),
    }


def _body(rank: int, world_size: int, **case: Any) -> dict[str, dict[str, Any]]:
    inductor = case["backend"] == "inductor"
    impls = ("shardkit", "torch") if case["mp"] or inductor else ("shardkit", "torch", "local")
    if inductor:
        # One compile worker, in the rank's own process: no pool of compile processes to start.
        torch._inductor.config.compile_threads = 1
    return {impl: _train(impl, rank, world_size, case) for impl in impls}


def _check(traces: dict[str, dict[str, Any]]) -> None:
    ours, torch_ = traces["shardkit"], traces["torch"]
    assert ours["frames"] > 0 and torch_["frames"] > 0
    assert ours["losses"] == torch_["losses"]
    # Parameter names and state-dict keys as torch's (``_orig_mod.`` where it keeps one).
    assert ours["names"] == torch_["names"]
    assert ours["keys"] == torch_["keys"]
    for name, value in torch_["params"].items():
        assert torch.equal(ours["params"][name], value), name
    if "local" in traces:
        local = traces["local"]
        assert local["names"] == ours["names"]
        torch.testing.assert_close(ours["losses"], local["losses"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("where", "mp"),
    [
        ("blocks", {}),
        ("blocks_after", {}),
        ("blocks_after", BF16),
        ("wrapped", {}),
        ("wrapped", BF16),
        ("wrapped_after", {}),
        ("model", {}),
    ],
    ids=lambda v: "bf16" if v == BF16 else ("fp32" if v == {} else v),
)
def test_compiled_training_matches_torch(where: str, mp: dict[str, Any]) -> None:
    case: dict[str, Any] = {
        "where": where,
        "backend": "aot_eager",
        "mp": mp,
        "steps": 3,
        "model": "gpt",
    }
    traces = run_on_ranks(2, _body, **case)[0]
    _check(traces)
    if where.startswith("wrapped"):
        assert any("._orig_mod." in name for name in traces["shardkit"]["names"])


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("mp", [{}, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("where", ["blocks", "blocks_after"])
def test_fullgraph_compiled_blocks_match_torch(
    where: str, mp: dict[str, Any], backend: str
) -> None:
    # block.compile(fullgraph=True) before fully_shard (torchtitan's) and after it: a graph
    # break at shardkit's hooks would raise. The small MLP, two steps: compiling is the cost.
    case: dict[str, Any] = {
        "where": where,
        "backend": backend,
        "mp": mp,
        "steps": 2,
        "model": "mlp",
        "fullgraph": True,
    }
    traces = run_on_ranks(2, _body, **case)[0]
    _check(traces)
    # As many graphs as torch's: no extra frame, no recompile.
    assert traces["shardkit"]["frames"] == traces["torch"]["frames"]


@pytest.mark.parametrize(
    ("where", "fullgraph"), [("wrapped", False), ("blocks", True)], ids=["wrapped", "fullgraph"]
)
def test_inductor_compiled_blocks_match_torch(where: str, fullgraph: bool) -> None:
    # Inductor's C++ kernels, on the small MLP (fewer kernels than the GPT's to compile): blocks
    # wrapped before sharding, and torchtitan's block.compile(fullgraph=True) before it. Two
    # steps: the compile is the cost, so on one rank (one compile, not one per rank; the cases
    # above run the hooks' collectives on two ranks).
    case: dict[str, Any] = {
        "where": where,
        "backend": "inductor",
        "mp": {},
        "steps": 2,
        "model": "mlp",
        "fullgraph": fullgraph,
    }
    traces = run_on_ranks(1, _body, timeout_s=600, **case)[0]
    _check(traces)
    if fullgraph:
        assert traces["shardkit"]["frames"] == traces["torch"]["frames"]
