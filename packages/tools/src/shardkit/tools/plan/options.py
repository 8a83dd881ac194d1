"""What the planner is asked to plan: the fully_shard options, the optimizer and the inputs.

The options mirror ``shardkit.core.fully_shard``'s (``reshard_after_forward``, and
``MixedPrecisionPolicy``'s ``param_dtype``, ``reduce_dtype`` and ``param_dtype_override_fn``)
so a plan describes the same training step the engine will run; with tensor parallelism,
the TP degree and the plan ``parallelize_module`` is given before ``fully_shard``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from shardkit.core import ReducePrecision
from shardkit.tools.plan.sharding_plan import (
    CheckpointMode,
    ShardingPlan,
    Unit,
    check_conditional,
)
from shardkit.tools.plan.tp_styles import TPPlan
from shardkit.tools.units import DEFAULT_BANDWIDTH_GBPS

__all__ = [
    "OPTIMIZER_STATES",
    "ModelSource",
    "PlanOptions",
    "WrapPolicy",
    "loss_takes_model",
    "options_for",
]

ModelSource = nn.Module | Callable[[], nn.Module]
"""A model on the meta device, or a factory that returns one."""

WrapPolicy = Collection[str] | Callable[[str, nn.Module], bool]
"""Which modules get their own ``fully_shard`` call: class names, or ``(fqn, module) -> bool``."""

OPTIMIZER_STATES: dict[str, int] = {
    "adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0, "muon": 1,
}  # fmt: skip
"""Tensors of optimizer state per parameter, each shaped like the local shard ("muon": its
matrices'; the parameters it leaves to AdamW keep two, as the step counts them)."""

_BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """How the model is sharded and trained, for :func:`shardkit.tools.plan`."""

    mesh_shape: tuple[int, int] | None = None
    """HSDP: (replicas, shard). Parameters are sharded over ``shard`` ranks and gradients
    all-reduced across ``replicas``; their product must be the data-parallel size (the world
    size over ``tp_degree``). None is 1-D FSDP."""
    tp_degree: int = 1
    """Ranks of the tensor-parallel axis, the innermost of the mesh (torchtitan's layout:
    (dp_replicate, dp_shard, tp), so a rank's tp index is ``rank % tp_degree``)."""
    tp_plan: TPPlan | None = None
    """What ``parallelize_module`` is given on the tp axis before ``fully_shard``: module
    path -> ParallelStyle (Colwise, Rowwise, SequenceParallel, PrepareModuleInput), or a
    function of the model returning that. Needs ``inputs``: tp collectives move activations."""
    wrap: WrapPolicy | None = None
    """Modules sharded on their own (the root is always one more). None: every element of an
    ``nn.ModuleList`` that is not inside another such element (torchtitan's per-block wrap).
    A collection of class names selects modules by ``type(m).__name__``; a callable gets each
    module's FQN and the module."""
    reshard_after_forward: bool | None = None
    """As for fully_shard on every module: True frees parameters after forward (the root too),
    False keeps them until after backward, None is True except for the root, which keeps its
    parameters because backward needs them first."""
    keep_unsharded_storage: bool = False
    """As ``FSDPModule.set_keep_unsharded_storage(True)`` on every module: reshards keep the
    full parameters' memory, so every group's unsharded buffer is held all step."""
    param_dtype: torch.dtype | None = None
    """dtype of the all-gathered parameters (MixedPrecisionPolicy.param_dtype)."""
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = None
    """MixedPrecisionPolicy.param_dtype_override_fn: called on each parameter of the meta
    model (so it must decide from the parameter itself, its dtype or shape, not from which
    object it is); its own dtype keeps that parameter out of ``param_dtype``."""
    reduce_dtype: torch.dtype | None = None
    """dtype of the gradient reduce-scatter (MixedPrecisionPolicy.reduce_dtype); None: the
    gathered parameters' dtype."""
    reduce_precision: ReducePrecision | None = None
    """How gradients travel (``FSDPModule.set_reduce_precision`` on every module): with a wire
    dtype, reductions send its rows (bfloat16, int8 or float8 with block scales) and HSDP's
    all-reduce becomes a compressed reduce-scatter and an all-gather of the encoded sums."""
    optimizer: Literal["adamw", "adam", "sgd", "sgd_momentum", "muon"] = "adamw"
    """Optimizer whose state is counted: Adam/AdamW keep two tensors per parameter plus a
    float32 ``step`` scalar, SGD with momentum one, plain SGD none. "muon":
    ``shardkit.core.optim.Muon`` on the 2-D parameters outside the root's group (one buffer
    each, and the step's whole matrices on their owners: ``plan/muon_step.py``), AdamW on the
    rest."""
    inputs: Callable[[], Any] | None = None
    """Returns one rank's example inputs as meta tensors: a tensor, a tuple of positional
    arguments or a dict of keyword arguments. With it the planner runs forward on the meta
    device to measure activations and the order modules run in; without it activations are
    not counted and modules are assumed to run in registration order."""
    loss: Callable[..., torch.Tensor] | None = None
    """Maps the model's output to the scalar loss, on the meta device (make targets there with
    ``device="meta"``); its saved tensors and backward count too. One that takes two
    positional parameters is called as ``loss(output, model)``: a loss that runs the model's
    own modules after its forward (a chunked cross-entropy through a separately sharded output
    head), whose all-gathers, gradients and reductions are then planned as the engine runs
    them. None: a loss whose gradient
    is a ones tensor per output (the logits' gradient, but none of a real loss's own memory,
    such as cross-entropy's float32 log-softmax). Only used with ``inputs``."""
    bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS
    """Per-rank bandwidth in GB/s (1e9 bytes per second) for the communication time."""
    backend: Literal["nccl", "gloo"] = "nccl"
    """Process-group backend: sizes of the engine's receive buffers differ (NCCL gathers into
    a W-row buffer, gloo into W-1 rows plus a scratch for reduce-scatters), and so does the
    optimizer's scratch (foreach on GPUs, per-tensor on the CPU)."""
    rank: int = 0
    """Whose memory to report. Rank 0 holds the largest unpadded shards when dims do not
    divide evenly, which only changes the optimizer state."""
    units: tuple[Unit, ...] | None = None
    """The ``fully_shard`` calls, in call order (a ``ShardingPlan``'s units): when set, they
    replace ``wrap`` and ``reshard_after_forward``. One group per unit (several modules
    make one group, as ``fully_shard([m1, m2])``), each with its own
    ``reshard_after_forward``; the root unit (``ROOT``) is required and comes last."""
    prefetch: int = 1
    """Units gathered ahead. 1: the engine's own prefetch (the next group); k > 1: every
    unit's ``set_modules_to_forward_prefetch`` and ``set_modules_to_backward_prefetch`` get
    the next k units (``ShardingPlan.prefetch_lists``). Needs ``units``."""
    checkpoint: tuple[tuple[str, Literal["full", "selective"]], ...] = ()
    """(FQN, mode) of the modules wrapped with torch's non-reentrant ``checkpoint_wrapper``
    before ``fully_shard``: they keep only their inputs (``full``) or also their matrix
    multiplies' and attention's outputs (``selective``), and recompute in backward."""
    offload: bool = False
    """``CPUOffloadPolicy()`` on every unit: sharded parameters, gradients and optimizer
    state in host memory."""
    conditional: tuple[str, ...] = ()
    """FQNs of sharded modules marked ``set_conditional(True, recurse=False)``: each names a
    module of a group (a unit's, or one ``wrap`` selects), not the root. The planned rank runs
    them as the trace does; their anchors issue their collectives (``ShardingPlan``)."""

    def __post_init__(self) -> None:
        if self.mesh_shape is not None:
            shape = self.mesh_shape
            if (
                not isinstance(shape, tuple)
                or len(shape) != 2
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape)
                or min(shape) < 1
            ):
                raise ValueError(
                    f"PlanOptions.mesh_shape must be (replicas, shard) positive ints, got {shape!r}"
                )
        if self.reshard_after_forward is not None and not isinstance(
            self.reshard_after_forward, bool
        ):
            raise TypeError(
                "PlanOptions.reshard_after_forward must be a bool or None, got "
                f"{self.reshard_after_forward!r}"
            )
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(f"PlanOptions.{name} must be a torch.dtype or None, got {value!r}")
            if value is not None and not value.is_floating_point:
                raise ValueError(f"PlanOptions.{name} must be a floating dtype, got {value}")
        if self.optimizer not in OPTIMIZER_STATES:
            known = ", ".join(OPTIMIZER_STATES)
            raise ValueError(f"PlanOptions.optimizer must be one of {known}: {self.optimizer!r}")
        if self.inputs is not None and not callable(self.inputs):
            raise TypeError("PlanOptions.inputs must be a callable returning meta tensors")
        if self.loss is not None and not callable(self.loss):
            raise TypeError("PlanOptions.loss must be a callable mapping the output to a loss")
        if self.wrap is not None and not callable(self.wrap) and isinstance(self.wrap, str):
            raise TypeError("PlanOptions.wrap must be a collection of class names, not one str")
        if isinstance(self.bandwidth_gbps, bool) or not isinstance(
            self.bandwidth_gbps, int | float
        ):
            raise TypeError(f"PlanOptions.bandwidth_gbps must be a number: {self.bandwidth_gbps!r}")
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"PlanOptions.bandwidth_gbps must be positive: {self.bandwidth_gbps}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"PlanOptions.backend must be 'nccl' or 'gloo': {self.backend!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"PlanOptions.rank must be a non-negative int: {self.rank!r}")
        self._check_tp()
        self._check_units()

    def _check_units(self) -> None:
        units = self.units
        if units is not None:
            if not isinstance(units, tuple) or not units:
                raise TypeError("PlanOptions.units must be a non-empty tuple of Unit, or None")
            for unit in units:
                if not isinstance(unit, Unit):
                    raise TypeError(f"PlanOptions.units holds {unit!r}, not a Unit")
            # The plan's own checks: each module in one unit, the root last.
            ShardingPlan(units=units, prefetch=1)
            if self.wrap is not None or self.reshard_after_forward is not None:
                raise ValueError(
                    "PlanOptions.units replaces wrap and reshard_after_forward: set only units"
                )
        prefetch = self.prefetch
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"PlanOptions.prefetch must be a positive int, got {prefetch!r}")
        if prefetch > 1 and units is None:
            raise ValueError(
                "PlanOptions.prefetch > 1 sets each unit's prefetch lists: it needs units"
            )
        check_conditional(self.conditional, "PlanOptions.conditional")
        if not isinstance(self.checkpoint, tuple):
            raise TypeError("PlanOptions.checkpoint must be a tuple of (FQN, mode) pairs")
        if self.checkpoint:  # the plan's own checks of the entries
            ShardingPlan(units=(Unit(modules=("",)),), checkpoint=self.checkpoint)
        if not isinstance(self.offload, bool):
            raise TypeError(f"PlanOptions.offload must be a bool, got {self.offload!r}")

    @property
    def checkpointed(self) -> dict[str, CheckpointMode]:
        """FQN -> recomputation mode, for the modules ``checkpoint`` wraps."""
        return dict(self.checkpoint)

    def _check_tp(self) -> None:
        degree = self.tp_degree
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(f"PlanOptions.tp_degree must be a positive int: {degree!r}")
        if self.tp_plan is None:
            if degree > 1:
                raise ValueError(
                    f"PlanOptions.tp_degree is {degree} but no tp_plan says what to shard"
                )
            return
        if not callable(self.tp_plan) and not isinstance(self.tp_plan, Mapping):
            raise TypeError(
                "PlanOptions.tp_plan must be a dict of ParallelStyles or a function of the "
                f"model returning one, got {type(self.tp_plan).__name__}"
            )
        if self.inputs is None:
            raise ValueError(
                "PlanOptions.tp_plan needs inputs: the tensor-parallel collectives move "
                "activations, whose sizes come from a forward on the meta device"
            )

    @property
    def num_states(self) -> int:
        """Optimizer state tensors per parameter."""
        return OPTIMIZER_STATES[self.optimizer]

    @property
    def on_cuda(self) -> bool:
        """Whether the plan is for GPUs: NCCL runs on CUDA only; gloo plans are a CPU's.

        On CUDA torch's caching allocator holds segments beyond the live tensors
        (``caching_allocator``), and ``--fit`` budgets those; a CPU's allocator returns
        memory as it goes, so there the live bytes are what must fit.
        """
        return self.backend == "nccl"


def loss_takes_model(loss: Callable[..., Any]) -> bool:
    """Whether ``PlanOptions.loss`` is called with the model too.

    Two required positional parameters: ``loss(output, model)``; anything else gets the
    output alone.
    """
    try:
        parameters = inspect.signature(loss).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the output alone
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in parameters if p.kind in positional and p.default is p.empty]
    return len(required) >= 2


def options_for(sharding: ShardingPlan, base: PlanOptions | None = None) -> PlanOptions:
    """The planner's options for ``sharding``: its choices, everything else from ``base``.

    The units, prefetch, checkpoint, offload, precision and conditional fields come from the
    plan (so ``base``'s ``wrap`` and ``reshard_after_forward`` are dropped: the units replace them);
    the inputs, loss, optimizer, mesh, backend and rank from ``base`` (default
    ``PlanOptions()``).
    """
    if not isinstance(sharding, ShardingPlan):
        raise TypeError(f"options_for expects a ShardingPlan, got {type(sharding).__name__}")
    base = base if base is not None else PlanOptions()
    return dataclasses.replace(
        base,
        wrap=None,
        reshard_after_forward=None,
        units=sharding.units,
        prefetch=sharding.prefetch,
        checkpoint=sharding.checkpoint,
        offload=sharding.offload,
        param_dtype=sharding.param_dtype,
        reduce_dtype=sharding.reduce_dtype,
        reduce_precision=sharding.reduce_precision,
        conditional=sharding.conditional,
    )
