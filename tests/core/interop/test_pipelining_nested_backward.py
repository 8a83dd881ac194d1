"""A chunked loss's backward inside a step, over a list group: torch's ``fully_shard`` the oracle.

torchtitan's chunked loss calls ``lm_head``, one module of the list group
``fully_shard([norm, lm_head])``, on chunks of the hidden states after the model's forward, and
runs each chunk's ``backward()`` there, before the step's own backward. Torch's engine treats
each such call as a partial call of the group (no pre-backward hook on its output; gradients
queue nothing), so that small backward leaves every other group as forward left it. Under the
zero-bubble V schedule this matters: its input step lists the stage's parameters before autograd
runs, and a block resharded by an end-of-backward callback in the chunks' backward would lose its
weight gradient. Here a model of blocks and a ``[norm, head]`` list group trains with such a loss
(written for this test, the way torchtitan's works), pipelined under ZBV (pp=2, W=2) and plainly
data parallel (W=2), with both engines; losses, gradients and parameters must agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor

import shardkit.core as sk
from harness.pipelines import stage_indices
from harness.pool import run_on_ranks
from shardkit.core.torch_release import release_of

PP = 2
MICROBATCHES = 4
HIDDEN = 8
SEQ = 4  # chunked along this dim: one chunk per position
BATCH = 8
STEPS = 2

Trace = dict[str, list[torch.Tensor]]


class _Stage(nn.Module):
    """A block; the last stage also holds ``norm`` and ``head`` (the loss applies ``head``)."""

    def __init__(self, index: int, last: bool) -> None:
        super().__init__()
        torch.manual_seed(100 + index)  # the same weights on every rank, for both engines
        self.block = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.norm = nn.LayerNorm(HIDDEN) if last else None
        self.head = nn.Linear(HIDDEN, HIDDEN) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.block(x)
        return h if self.norm is None else self.norm(h)


class _AccumulatedGrad(torch.autograd.Function):
    """The chunks' summed loss, whose backward hands ``grad`` to the hidden states."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, grad: torch.Tensor, loss: torch.Tensor) -> Any:
        ctx.save_for_backward(grad)
        out: torch.Tensor = loss.clone()
        return out

    @staticmethod
    def backward(ctx: Any, upstream: torch.Tensor) -> Any:
        (grad,) = ctx.saved_tensors
        return grad * upstream, None, None


def _chunked_loss(head: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A loss that applies ``head`` per chunk and runs each chunk's backward at once.

    As torchtitan's chunked loss does with FSDP: the head stays gathered across the chunks
    (no reshard after forward or backward, one gradient sync at the last chunk).
    """

    def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        fsdp: Any = head
        fsdp.set_reshard_after_forward(False)
        fsdp.set_reshard_after_backward(False)
        fsdp.set_requires_gradient_sync(False, recurse=False)
        fsdp.unshard()
        chunks = [c.detach().requires_grad_() for c in hidden.split(1, dim=1)]
        grads, total = [], hidden.new_zeros(())
        for i, (chunk, want) in enumerate(zip(chunks, target.split(1, dim=1), strict=True)):
            if i == len(chunks) - 1:
                fsdp.set_requires_gradient_sync(True, recurse=False)
            loss = F.mse_loss(head(chunk).float(), want) / len(chunks)
            total = total + loss.detach()
            loss.backward()
            assert chunk.grad is not None
            grads.append(chunk.grad)
        fsdp.set_reshard_after_forward(True)
        fsdp.set_reshard_after_backward(True)
        fsdp.reshard()
        apply: Any = _AccumulatedGrad.apply
        out: torch.Tensor = apply(hidden, torch.cat(grads, dim=1), total)
        return out

    return loss_fn


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def _shard(engine: str, stage: _Stage, mesh: DeviceMesh) -> None:
    fs: Callable[..., Any] = sk.fully_shard if engine == "shardkit" else torch_fully_shard
    # As torchtitan under pipeline parallelism: the zero-bubble input step needs the weights.
    fs(stage.block, mesh=mesh, reshard_after_forward=False)
    if stage.norm is not None:
        fs([stage.norm, stage.head], mesh=mesh, reshard_after_forward=False)
    fs(stage, mesh=mesh, reshard_after_forward=False)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _grad(p: torch.Tensor) -> torch.Tensor:
    return _full(p.grad) if p.grad is not None else torch.empty(0)


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.Generator().manual_seed(1000 * step + rank)
    x, target = torch.randn(2, BATCH, SEQ, HIDDEN, generator=data).unbind(0)
    return x, target


def _train_pipelined(engine: str, mesh: DeviceMesh) -> Trace:
    """STEPS ZBV steps over this rank's two stages: losses, gradients, parameters."""
    pp_rank = mesh.get_local_rank("pp")
    indices = stage_indices("zbv_zero_bubble", pp_rank, PP)
    n_stages = 2 * PP
    modules = [_Stage(i, last=i == n_stages - 1) for i in indices]
    for module in modules:
        _shard(engine, module, mesh["dp"])
    last = next((m for m in modules if m.head is not None), None)
    stages: list[Any] = [
        PipelineStage(m, i, n_stages, torch.device("cpu"), group=mesh.get_group("pp"))
        for m, i in zip(modules, indices, strict=True)
    ]
    # Only the last stage's rank computes a loss; the schedule wants one on every rank.
    loss_fn = _chunked_loss(last.head) if last is not None and last.head is not None else _mse
    schedule = schedules.ScheduleZBVZeroBubble(
        list(stages), n_microbatches=MICROBATCHES, loss_fn=loss_fn
    )
    params = [p for m in modules for p in m.parameters()]
    optim = torch.optim.SGD(params, lr=0.1)
    trace: Trace = {"losses": [], "grads": [], "params": []}
    for step in range(STEPS):
        x, target = _data(step, mesh.get_local_rank("dp"))
        losses: list[torch.Tensor] = []
        # ZBV: pipeline rank 0 holds the first stage and the last.
        schedule.step(x, target=target, losses=losses) if pp_rank == 0 else schedule.step()
        trace["losses"] += [loss.detach().clone() for loss in losses]
        trace["grads"] += [_grad(p) for p in params]
        optim.step()
        optim.zero_grad()
    trace["params"] = [_full(p) for p in params]
    return trace


def _train_plain(engine: str, mesh: DeviceMesh) -> Trace:
    """STEPS data-parallel steps of one model (two blocks, norm, head), the same loss."""
    first, last = _Stage(0, last=False), _Stage(3, last=True)
    model = nn.Sequential(first, last)
    _shard(engine, first, mesh)
    _shard(engine, last, mesh)
    fs: Callable[..., Any] = sk.fully_shard if engine == "shardkit" else torch_fully_shard
    fs(model, mesh=mesh)
    assert last.head is not None
    loss_fn = _chunked_loss(last.head)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    trace: Trace = {"losses": [], "grads": [], "params": []}
    for step in range(STEPS):
        x, target = _data(step, mesh.get_local_rank())
        loss = loss_fn(model(x), target)
        loss.backward()
        trace["losses"].append(loss.detach().clone())
        trace["grads"] += [_grad(p) for p in model.parameters()]
        optim.step()
        optim.zero_grad()
    trace["params"] = [_full(p) for p in model.parameters()]
    return trace


def _compare(ours: Trace, theirs: Trace) -> dict[str, Any]:
    out: dict[str, Any] = {
        key: [torch.equal(a, b) for a, b in zip(ours[key], theirs[key], strict=True)]
        for key in ("losses", "grads", "params")
    }
    out["n_losses"] = len(ours["losses"])
    out["n_grads"] = (len(ours["grads"]), len(theirs["grads"]))
    return out


def _pipelined_body(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (PP, world_size // PP), mesh_dim_names=("pp", "dp"))
    theirs = _train_pipelined("torch", mesh)
    ours = _train_pipelined("shardkit", mesh)
    return _compare(ours, theirs)


def _plain_body(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return _compare(_train_plain("shardkit", mesh), _train_plain("torch", mesh))


def _assert_same(result: dict[str, Any], where: str, n_losses: int) -> None:
    assert result["n_losses"] == n_losses, where
    assert result["n_grads"][0] == result["n_grads"][1] > 0, where
    for key in ("losses", "grads", "params"):
        assert all(result[key]), f"{where}: {key} {result[key]}"


def _skip_unless_torch_has_the_partial_path() -> None:
    """The oracle needs torch's partial path for list groups (torch 2.10 has none).

    Without it, torch's own ``fully_shard`` fails this loss in backward ("The tensor has a
    non-zero number of elements, but its data is not allocated yet"): its first chunk's call
    reshards the list group that the step's backward then reads.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    if not hasattr(FSDPState, "_force_complete_incomplete_states"):
        pytest.skip(f"torch {torch.__version__}'s fully_shard fails a chunked loss itself")


def test_a_chunked_loss_under_zero_bubble_v_trains_as_with_torchs_fully_shard() -> None:
    _skip_unless_torch_has_the_partial_path()
    if (release_of(torch.__version__) or (0, 0)) < (2, 11):
        pytest.skip(f"torch {torch.__version__}'s own zero-bubble V schedule fails on gloo")
    results = run_on_ranks(2, _pipelined_body, timeout_s=300)
    for rank, result in enumerate(results):
        # Pipeline rank 0 holds the last stage: it alone computes losses.
        _assert_same(result, f"rank {rank}", STEPS * MICROBATCHES if rank == 0 else 0)


def test_a_chunked_loss_without_pipelining_trains_as_with_torchs_fully_shard() -> None:
    _skip_unless_torch_has_the_partial_path()
    for rank, result in enumerate(run_on_ranks(2, _plain_body, timeout_s=300)):
        _assert_same(result, f"rank {rank}", STEPS)
