"""The check before launch: one rank of a sharding plan's step, run here, against the plan.

The planner predicts a rank's memory and collectives from shapes alone. Before a job is
launched on W ranks, :func:`check_plan` runs one rank of it in this process and measures
what the planner predicts: torch's fake process group stands for the other ranks (every
collective returns at once and moves nothing, as in torchtitan's dry runs), the model is built
on the meta device, sharded by ``apply_plan`` and materialized at 1/W of its size, and a few
training steps run (forward, loss, backward, the optimizer's step, ``zero_grad``). The last
step is measured:

- the peak of live tensor bytes (:class:`~shardkit.tools.track.live_peak.LivePeak`), the
  figure of the plan's ``memory.peak.total``;
- every collective, in issue order, with its kind and bytes (:class:`CommTracker`), against
  the plan's schedule;
- the operators dispatched (:class:`OpCounter`): on a GPU, at least one kernel launch each.

A model too large for this machine's memory runs on fake tensors (``FakeTensorMode``): shapes,
dtypes and storage sizes without data, so an 8B model at 64 ranks checks in seconds. The fake
group runs the engine's native collectives, as NCCL does, so the plan is made for NCCL's
buffers; the optimizer uses ``foreach`` kernels, as on GPUs, for the same reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from shardkit.core import FSDPModule
from shardkit.core.optim import Muon
from shardkit.tools.plan.apply.apply import apply_plan
from shardkit.tools.plan.backward import unit_loss
from shardkit.tools.plan.muon_step import takes_muon
from shardkit.tools.plan.options import PlanOptions, loss_takes_model, options_for
from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.planner import plan
from shardkit.tools.plan.sharding_plan import ShardingPlan
from shardkit.tools.records import Phase
from shardkit.tools.track.comm import CommTracker
from shardkit.tools.track.live_peak import LivePeak
from shardkit.tools.track.ops import OpCounter
from shardkit.tools.units import format_bytes

__all__ = ["FAKE_TENSORS_ABOVE_BYTES", "PlanCheck", "check_plan"]

FAKE_TENSORS_ABOVE_BYTES = 2 * 2**30
"""A predicted peak above this runs on fake tensors unless told otherwise."""

Call = tuple[str, int, int]  # (kind, input bytes, sent bytes) of one collective


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanCheck:
    """What one rank's step measured against what its plan predicted."""

    world_size: int
    """Ranks the fake group stood for."""
    fake_tensors: bool
    """Whether the step ran on fake tensors (no data: memory and collectives only)."""
    predicted_peak: int
    """The plan's peak of live tensor bytes (``Plan.memory.peak.total``)."""
    measured_peak: int
    """The measured step's peak of live tensor bytes."""
    planned_calls: tuple[Call, ...]
    """The plan's collectives of a step (the step check's too on real tensors)."""
    measured_calls: tuple[Call, ...]
    """The measured step's collectives, in issue order."""
    ops: int
    """Operators the measured step dispatched."""
    launches: int
    """Of which launch a kernel on a GPU (not views, allocations or bookkeeping)."""
    seconds: float
    """Wall time of the whole check, the plan included."""

    @property
    def ratio(self) -> float:
        """Measured peak over predicted (1.0: exact)."""
        return self.measured_peak / self.predicted_peak if self.predicted_peak else float("nan")

    @property
    def collectives_match(self) -> bool:
        """Whether every collective matched the plan's in kind, bytes and order."""
        return self.measured_calls == self.planned_calls

    @property
    def first_mismatch(self) -> str | None:
        """The first collective that differs from the plan, in words; None if all match."""
        pairs = zip(self.planned_calls, self.measured_calls, strict=False)
        for i, (planned, measured) in enumerate(pairs):
            if planned != measured:
                return f"collective {i}: planned {planned}, measured {measured}"
        if len(self.planned_calls) != len(self.measured_calls):
            return f"{len(self.planned_calls)} collectives planned, {len(self.measured_calls)} run"
        return None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the peaks, the collectives (counted, and whether they match)."""
        return {
            "world_size": self.world_size,
            "fake_tensors": self.fake_tensors,
            "predicted_peak_bytes": self.predicted_peak,
            "measured_peak_bytes": self.measured_peak,
            "peak_ratio": self.ratio if self.predicted_peak else None,
            "collectives": len(self.measured_calls),
            "collectives_match": self.collectives_match,
            "first_mismatch": self.first_mismatch,
            "ops": self.ops,
            "launches": self.launches,
            "seconds": self.seconds,
        }

    def summary(self) -> str:
        """A few lines: the peaks, the collectives, the operators and the time taken."""
        tensors = "fake tensors" if self.fake_tensors else "real tensors"
        calls = "as planned" if self.collectives_match else f"differ ({self.first_mismatch})"
        sent = sum(c[2] for c in self.measured_calls)
        return "\n".join(
            [
                f"launch check: rank 0 of {self.world_size} on the fake group, {tensors}, "
                f"{self.seconds:.1f} s",
                f"  peak: measured {format_bytes(self.measured_peak)}, predicted "
                f"{format_bytes(self.predicted_peak)} (ratio {self.ratio:.3f})",
                f"  collectives: {len(self.measured_calls)} ({format_bytes(sent)} sent), {calls}",
                f"  operators: {self.ops:,} ({self.launches:,} kernel launches on a GPU)",
            ]
        )


def check_plan(
    model_factory: Callable[[], nn.Module],
    sharding: ShardingPlan,
    *,
    world_size: int,
    inputs: Callable[[], Any],
    loss: Callable[..., torch.Tensor] | None = None,
    base_options: PlanOptions | None = None,
    steps: int = 2,
    fake_tensors: bool | None = None,
    predicted: Plan | None = None,
) -> PlanCheck:
    """Run rank 0 of ``sharding``'s training step on the fake group and compare with its plan.

    Args:
        model_factory: Builds the model (called under ``torch.device("meta")``).
        sharding: The plan to check; applied with ``apply_plan``.
        world_size: Ranks the fake group stands for.
        inputs: Returns one rank's inputs as meta tensors, as ``PlanOptions.inputs``; the
            step gets zeros of the same shapes and dtypes.
        loss: As ``PlanOptions.loss``, making its targets on the output's device so that
            one function serves the plan (meta) and the step; None backpropagates ones.
        base_options: The rest of the plan's options (optimizer, HSDP ``mesh_shape``).
        steps: Steps run in all; the last is measured (the plan is a steady-state step).
        fake_tensors: Run on fake tensors; None: when the predicted peak is above
            :data:`FAKE_TENSORS_ABOVE_BYTES`.
        predicted: The plan of ``sharding`` when the caller has it (``shardkit-plan --fit``
            does): planned for rank 0 on NCCL's buffers, as the fake group runs; None plans
            it here.

    Returns:
        The check.

    Raises:
        ValueError: ``steps`` below 2.
        NotImplementedError: the planner does not model a choice of ``sharding`` (offload).
        RuntimeError: a process group other than a fake one of ``world_size`` is initialized.
    """
    if steps < 2:
        raise ValueError(f"check_plan: steps must be at least 2 (one warm-up), got {steps}")
    started = time.perf_counter()
    if predicted is None:
        predicted = _predict(model_factory, sharding, world_size, inputs, loss, base_options)
    elif predicted.options.backend != "nccl" or predicted.options.rank != 0:
        raise ValueError("check_plan: a given prediction must be rank 0's on nccl buffers")
    if fake_tensors is None:
        fake_tensors = predicted.memory.peak.total > FAKE_TENSORS_ABOVE_BYTES
    with _fake_group(world_size):
        # Sharding stays outside fake mode: the mesh's set-up reads values.
        model = _sharded(model_factory, sharding, predicted.options, world_size)
        with _tensor_mode(fake_tensors):
            _materialize(model, fake_tensors)
            optimizers = _optimizers(model, predicted.options)
            batch = tree_map(_zeros_like_meta, inputs())
            for _ in range(steps - 1):
                _train_step(model, optimizers, batch, loss)
            with (
                LivePeak(model, optimizers=optimizers) as live,
                CommTracker() as comm,
                OpCounter() as ops,
            ):
                _train_step(model, optimizers, batch, loss)
            measured = tuple((r.kind, r.input_bytes, r.sent_bytes) for r in comm.records)
            del model, optimizers
    gc.collect()
    # The engine skips its step check on fake tensors: there are no bytes to compare. It runs
    # where backward ends, before the optimizer's step and its collectives (Muon's exchange).
    stepping = [c for c in predicted.schedule if c.phase is Phase.OPTIMIZER]
    calls = [
        *(c for c in predicted.schedule if c.phase is not Phase.OPTIMIZER),
        *(() if fake_tensors else predicted.step_check),
        *stepping,
    ]
    return PlanCheck(
        world_size=world_size,
        fake_tensors=fake_tensors,
        predicted_peak=predicted.memory.peak.total,
        measured_peak=live.peak,
        planned_calls=tuple((c.kind, c.input_bytes, c.sent_bytes) for c in calls),
        measured_calls=measured,
        ops=ops.total,
        launches=ops.launches,
        seconds=time.perf_counter() - started,
    )


def _predict(
    model_factory: Callable[[], nn.Module],
    sharding: ShardingPlan,
    world_size: int,
    inputs: Callable[[], Any],
    loss: Callable[..., torch.Tensor] | None,
    base_options: PlanOptions | None,
) -> Plan:
    base = base_options if base_options is not None else PlanOptions()
    # The fake group runs the engine's native collectives, whose buffers are NCCL's.
    base = dataclasses.replace(base, inputs=inputs, loss=loss, backend="nccl", rank=0)
    return plan(model_factory, world_size=world_size, options=options_for(sharding, base))


@contextlib.contextmanager
def _fake_group(world_size: int) -> Iterator[None]:
    """The default group, for the block: torch's fake one of ``world_size`` ranks."""
    if dist.is_initialized():
        if dist.get_backend() != "fake" or dist.get_world_size() != world_size:
            raise RuntimeError(
                "check_plan: a process group is initialized already; the check needs a fake "
                f"one of {world_size} ranks (or none, and it makes its own)"
            )
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tensor_mode(fake: bool) -> contextlib.AbstractContextManager[Any]:
    if not fake:
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Real tensors made before the mode (the meta model's buffers copied in) are allowed in.
    return FakeTensorMode(allow_non_fake_inputs=True)


def _sharded(
    model_factory: Callable[[], nn.Module],
    sharding: ShardingPlan,
    options: PlanOptions,
    world_size: int,
) -> nn.Module:
    """The model on the meta device, sharded by the plan."""
    from torch.distributed.device_mesh import init_device_mesh

    if options.mesh_shape is None:
        mesh = init_device_mesh("cpu", (world_size,))
    else:
        mesh = init_device_mesh("cpu", options.mesh_shape, mesh_dim_names=_HSDP_AXES)
    with torch.device("meta"):
        model = model_factory()
    return apply_plan(model, sharding, mesh=mesh)


def _materialize(model: nn.Module, fake: bool) -> None:
    """Storage for this rank's shards (fake under fake mode), and values for real ones."""
    model.to_empty(device="cpu")
    if fake:
        return
    # The values matter little (memory and collectives do not depend on them); small ones
    # keep the step free of overflows.
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.normal_(0.0, 0.02)
        for buffer in model.buffers():
            buffer.fill_(1.0)


_HSDP_AXES = ("dp_replicate", "dp_shard")


def _optimizers(model: nn.Module, options: PlanOptions) -> list[torch.optim.Optimizer]:
    """The planned optimizers, with foreach kernels as on GPUs (the plan is made for NCCL).

    ``optimizer="muon"``: shardkit's Muon on the 2-D parameters outside the root's group,
    AdamW on the rest, as the plan has them (``muon_step.takes_muon``).
    """
    params = list(model.parameters())
    if options.optimizer == "adamw":
        return [torch.optim.AdamW(params, lr=1e-4, foreach=True)]
    if options.optimizer == "adam":
        return [torch.optim.Adam(params, lr=1e-4, foreach=True)]
    if options.optimizer == "muon":
        units = [m for m in model.modules() if m is not model and isinstance(m, FSDPModule)]
        below = {id(p) for unit in units for p in unit.parameters()}  # not the root's
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        matrices = [(n, p) for n, p in named if takes_muon(p.shape, id(p) not in below)]
        taken = {id(p) for _, p in matrices}
        others = [p for _, p in named if id(p) not in taken]
        return [Muon(matrices, lr=1e-4), torch.optim.AdamW(others, lr=1e-4, foreach=True)]
    momentum = 0.9 if options.optimizer == "sgd_momentum" else 0.0
    return [torch.optim.SGD(params, lr=1e-4, momentum=momentum, foreach=True)]


def _zeros_like_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype)
    return value


def _train_step(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    batch: Any,
    loss: Callable[..., torch.Tensor] | None,
) -> None:
    """Forward, loss, backward, each optimizer's step and ``zero_grad``."""
    _loss_of_forward(model, batch, loss).backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _loss_of_forward(
    model: nn.Module, batch: Any, loss: Callable[..., torch.Tensor] | None
) -> torch.Tensor:
    """Forward and the loss, the model's output dropped on return.

    The plan has the step's caller drop the output once the loss is made (as in
    ``loss_fn(model(x), y).backward()``); a step that kept it through backward would hold one
    more output (the logits: 4 GiB for the 8B Llama at 8192 tokens) than the plan.
    """
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, tuple):
        out = model(*batch)
    else:
        out = model(batch)
    if loss is None:
        # The plan's stand-in loss itself: its ones gradients are made in backward and
        # dropped once used, where seeds passed to ``backward`` would live through it.
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        return unit_loss(outputs)
    value: torch.Tensor = loss(out, model) if loss_takes_model(loss) else loss(out)
    return value
