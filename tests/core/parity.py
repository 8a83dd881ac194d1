"""The differential oracle: train shardkit, torch's fully_shard and a single process alike.

Every implementation starts from the same seed and sees the same global batch each step;
distributed runs take their rank's slice. A body returns, per implementation, the global loss
of every step and every parameter (full tensors) after the last step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from tests.core import models

Trace = dict[str, Any]  # {"losses": list[float], "params": dict[str, Tensor]}


@dataclass(kw_only=True)
class Run:
    """One differential experiment."""

    model: str = "mlp"
    steps: int = 5
    wrap: str = "blocks"  # "blocks": each block, then the root; "root": the root only
    shard_kwargs: dict[str, Any] = field(default_factory=dict)  # for every fully_shard call
    root_kwargs: dict[str, Any] = field(default_factory=dict)  # for the root call only
    hsdp: tuple[int, int] | None = None  # (replicate, shard) mesh shape
    impls: tuple[str, ...] = ("shardkit", "torch", "local")
    lr: float = 0.05
    per_rank_batch: int = 2
    loop: str = "plain"  # "plain", "accumulate", "multi_forward"
    prepare: str | None = None  # name of a function in tests.core.prepare run before sharding
    ignored: tuple[str, ...] = ()  # parameter names passed as ignored_params
    setup: str | None = None  # name of a function in tests.core.prepare run after sharding
    eval_each_step: bool = False  # also record a no_grad eval loss after every step
    local_lr_scale: float = 1.0  # the single process's lr multiplier (divide-factor tests)


def fully_shard_of(impl: str) -> Callable[..., Any]:
    """The ``fully_shard`` of an implementation."""
    if impl == "shardkit":
        from shardkit.core import fully_shard

        return fully_shard
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return torch_fully_shard


def make_mesh(run: Run, world_size: int) -> DeviceMesh:
    if run.hsdp is None:
        return init_device_mesh("cpu", (world_size,))
    return init_device_mesh("cpu", run.hsdp, mesh_dim_names=("replicate", "shard"))


def apply(impl: str, model: nn.Module, mesh: DeviceMesh, run: Run) -> None:
    """Shard ``model`` the way ``run.wrap`` says."""
    fs = fully_shard_of(impl)
    kwargs = _policies_for(impl, dict(run.shard_kwargs, mesh=mesh))
    if run.ignored:
        named = dict(model.named_parameters())
        kwargs["ignored_params"] = {named[name] for name in run.ignored}
    blocks = getattr(model, "blocks", [])
    if run.wrap in ("blocks", "grouped"):
        for block in blocks:
            fs(block, **kwargs)
    if run.wrap == "grouped":
        # The final norm and the head as one group (one all-gather for both).
        fs([model.ln_f, model.head], **kwargs)
    fs(model, **dict(kwargs, **_policies_for(impl, run.root_kwargs)))


def _policies_for(impl: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    # Torch 2.15's fully_shard calls a private method of its own policy class: give it torch's.
    return {k: (_policy_for(impl, v) if k.endswith("_policy") else v) for k, v in kwargs.items()}


def _policy_for(impl: str, policy: Any) -> Any:
    return policy if impl == "shardkit" else torch_policy(policy)


def torch_policy(policy: Any) -> Any:
    """torch's policy object of the same class and field values as shardkit's ``policy``.

    The fields are torch's class's: shardkit's policies have those of the newest tested torch
    (``param_dtype_override_fn``, 2.15), left at their defaults here.
    """
    import torch.distributed.fsdp as tfsdp

    cls = getattr(tfsdp, type(policy).__name__)
    return cls(**{name: getattr(policy, name) for name in cls.__dataclass_fields__})


def rank_batch(
    model: str, step: int, rank: int, world_size: int, impl: str, per_rank: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, or this rank's slice of it for a distributed ``impl``."""
    x, y = models.batch(model, step, world_size * per_rank)
    if impl == "local":
        return x, y
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def global_loss(loss: torch.Tensor, impl: str, world_size: int) -> float:
    """The mean of every rank's loss (the loss itself for the single process)."""
    loss = loss.detach()
    if impl != "local":
        loss = loss.clone()
        dist.all_reduce(loss)
        loss /= world_size
    return loss.item()


def train(impl: str, run: Run, rank: int, world_size: int) -> Trace:
    """Train one implementation and return its trace."""
    model = models.build(run.model)
    if run.prepare is not None:
        from tests.core import prepare

        getattr(prepare, run.prepare)(model)
    distributed = impl != "local"
    if distributed:
        apply(impl, model, make_mesh(run, world_size), run)
        if run.setup is not None:
            from tests.core import prepare

            getattr(prepare, run.setup)(model)
    lr = run.lr if distributed else run.lr * run.local_lr_scale
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    losses: list[float] = []
    for step in range(run.steps):
        x, y = rank_batch(run.model, step, rank, world_size, impl, run.per_rank_batch)
        loss = _step(model, run, x, y)
        opt.step()
        opt.zero_grad()
        losses.append(global_loss(loss, impl, world_size))
        if run.eval_each_step:
            losses.append(_eval_loss(model, run, rank, world_size, distributed))
    return {"losses": losses, "params": full_params(model)}


def _eval_loss(model: nn.Module, run: Run, rank: int, world_size: int, distributed: bool) -> float:
    x, y = models.batch(run.model, 10_000, world_size * run.per_rank_batch)
    if distributed:
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    model.eval()
    with torch.no_grad():
        loss = models.loss_of(run.model, model(x), y)
    model.train()
    if distributed:
        dist.all_reduce(loss)
        loss /= world_size
    return loss.item()


def _step(model: Any, run: Run, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward and backward of one step; returns the (detached) loss of this rank's data."""
    if run.loop == "plain":
        loss = models.loss_of(run.model, model(x), y)
        loss.backward()
        return loss.detach()
    if run.loop == "explicit_unshard":
        # Gather every block up front, asynchronously; forward waits where it needs them.
        handles = [
            b.unshard(async_op=True) for b in getattr(model, "blocks", []) if hasattr(b, "unshard")
        ]
        assert all(h is not None for h in handles)
        loss = models.loss_of(run.model, model(x), y)
        loss.backward()
        return loss.detach()
    if run.loop in (
        "accumulate",
        "multi_forward",
        "accumulate_keep",
        "accumulate_hsdp",
        "last_backward",
    ):
        # Two microbatches: split each rank's rows in two halves.
        xs, ys = x.chunk(2), y.chunk(2)
        if run.loop == "multi_forward":
            total = (
                sum(models.loss_of(run.model, model(a), b) for a, b in zip(xs, ys, strict=True)) / 2
            )
            assert isinstance(total, torch.Tensor)
            total.backward()
            return total.detach()
        total_loss = torch.zeros(())
        for micro, (a, b) in enumerate(zip(xs, ys, strict=True)):
            last = micro == len(xs) - 1
            _set_microbatch_switches(model, run.loop, last)
            loss = models.loss_of(run.model, model(a), b) / 2
            loss.backward()
            total_loss += loss.detach()
        return total_loss
    raise ValueError(run.loop)


@torch.no_grad()
def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full, plain tensor.

    Without autograd: a ``full_tensor()`` of a parameter that requires grad leaves a
    ``_ToTorchTensorBackward`` node on its result, and releasing one was where a full run under
    glibc's checks caught a double free inside torch (note 002).
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = value.detach().clone().float()
    return out


def parity_body(rank: int, world_size: int, run: Run) -> dict[str, Trace]:
    """Runs on every rank: all implementations of ``run``, one after another."""
    return {impl: train(impl, run, rank, world_size) for impl in run.impls}


def assert_parity(
    results: list[dict[str, Trace]],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    ignored: tuple[str, ...] = (),
) -> None:
    """Rank 0's shardkit trace equals torch's and the single process's within tolerance."""
    traces = results[0]
    ours = traces["shardkit"]
    for peer in [k for k in traces if k != "shardkit"]:
        theirs = traces[peer]
        _close(ours["losses"], theirs["losses"], rtol, atol, f"losses differ from {peer}")
        assert ours["params"].keys() == theirs["params"].keys()
        for name, value in ours["params"].items():
            _close(value, theirs["params"][name], rtol, atol, f"{name} differs from {peer}")
    # Every rank must agree on the full parameters (ignored ones are each rank's own).
    for other in results[1:]:
        for name, value in ours["params"].items():
            if name in ignored:
                continue
            torch.testing.assert_close(value, other["shardkit"]["params"][name], rtol=0, atol=0)


def _set_microbatch_switches(model: Any, loop: str, last: bool) -> None:
    """The FSDP switches a microbatch loop flips (the single process has none)."""
    if not hasattr(model, "set_requires_gradient_sync"):
        return
    if loop == "accumulate":
        model.set_requires_gradient_sync(last)
    elif loop == "accumulate_keep":
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
    elif loop == "accumulate_hsdp":
        model.set_requires_all_reduce(last)
    elif loop == "last_backward":
        model.set_is_last_backward(last)


def _close(ours: Any, theirs: Any, rtol: float, atol: float, what: str) -> None:
    try:
        torch.testing.assert_close(
            torch.as_tensor(ours), torch.as_tensor(theirs), rtol=rtol, atol=atol
        )
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None
