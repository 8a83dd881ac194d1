"""The planner's FSDP groups: which modules are sharded, and the engine's buffer arithmetic.

Everything here reproduces shardkit.core's sizes from parameter shapes alone (no process group,
no allocation), so that a plan's bytes equal what the engine reports:

- each parameter is cut along dim 0 into W chunks of ``ceil(dim0 / W)`` rows (torch.chunk),
  the last ones zero padded: a padded shard has ``chunk * prod(shape[1:])`` elements;
- a group keeps its padded shards in one flat buffer whose slots start at 16-byte aligned
  offsets, total rounded up to 16 bytes; the all-gather sends that flat buffer (in
  ``param_dtype`` when one is set) and the unsharded buffer holds W padded shards per
  parameter, laid out the same way;
- the reduce-scatter output is one rank's padded shards of the trainable parameters back to
  back, with no alignment, in the reduce dtype.

See docs/notes/001-flat-group-buffers.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardkit.tools.plan.options import PlanOptions, WrapPolicy

__all__ = ["GroupSpec", "ParamSpec", "build_groups", "flat_nbytes", "select_group_modules"]

_ALIGN_BYTES = 16  # shardkit.core.runtime.buffers aligns every slot to 16 bytes


def flat_nbytes(numels: Sequence[int], dtypes: Sequence[torch.dtype]) -> int:
    """Bytes of a flat buffer holding these tensors at 16-byte aligned offsets."""
    cursor = 0
    for numel, dtype in zip(numels, dtypes, strict=True):
        cursor = -(-cursor // _ALIGN_BYTES) * _ALIGN_BYTES
        cursor += numel * dtype.itemsize
    return -(-cursor // _ALIGN_BYTES) * _ALIGN_BYTES


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamSpec:
    """One parameter as the engine shards it."""

    fqn: str
    """Its name in the model."""
    shape: tuple[int, ...]
    """The full shape."""
    dtype: torch.dtype
    """Its own dtype: what the sharded parameter, its gradient and optimizer state use."""
    comm_dtype: torch.dtype
    """dtype of the unsharded parameter and the all-gather (``param_dtype`` for floats)."""
    requires_grad: bool
    """Whether it is trained (reduce-scattered, with optimizer state)."""
    world: int
    """Shard count."""

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return math.prod(self.shape)

    @property
    def chunk(self) -> int:
        """Rows of dim 0 in every padded shard."""
        return -(-self.shape[0] // self.world)

    @property
    def shard_numel(self) -> int:
        """Elements of one padded shard (what every rank sends)."""
        return self.chunk * math.prod(self.shape[1:])

    def local_numel(self, rank: int) -> int:
        """Elements of ``rank``'s unpadded shard (what the DTensor's local tensor holds)."""
        rows = max(0, min(self.chunk, self.shape[0] - rank * self.chunk))
        return rows * math.prod(self.shape[1:])


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSpec:
    """The parameters of one ``fully_shard`` call and the sizes of its buffers."""

    fqn: str
    """The module's FQN, '<root>' for the root (as the engine names groups)."""
    module: nn.Module
    """The sharded module."""
    params: tuple[ParamSpec, ...]
    """Its parameters, in the engine's order (module tree pre-order)."""
    reduce_dtype: torch.dtype
    """dtype of the gradient reduce-scatter."""

    @property
    def world(self) -> int:
        """Shard count."""
        return self.params[0].world

    @property
    def trainable(self) -> tuple[ParamSpec, ...]:
        """Parameters that get gradients."""
        return tuple(p for p in self.params if p.requires_grad)

    @property
    def param_count(self) -> int:
        """Elements of all parameters, unsharded and unpadded."""
        return sum(p.numel for p in self.params)

    @property
    def storage_nbytes(self) -> int:
        """The flat sharded buffer (padded shards in their own dtypes)."""
        return flat_nbytes([p.shard_numel for p in self.params], [p.dtype for p in self.params])

    @property
    def comm_nbytes(self) -> int:
        """What one rank contributes to the all-gather (padded shards in the gather dtype)."""
        return flat_nbytes(
            [p.shard_numel for p in self.params], [p.comm_dtype for p in self.params]
        )

    @property
    def unsharded_nbytes(self) -> int:
        """The flat unsharded buffer (W padded shards per parameter, gather dtype)."""
        return flat_nbytes(
            [p.world * p.shard_numel for p in self.params], [p.comm_dtype for p in self.params]
        )

    @property
    def needs_staging(self) -> bool:
        """Whether the gather input is a separate cast copy of the sharded buffer."""
        return any(p.comm_dtype != p.dtype for p in self.params)

    @property
    def reduce_numel(self) -> int:
        """Elements of one rank's reduce-scatter output (trainable padded shards)."""
        return sum(p.shard_numel for p in self.trainable)

    @property
    def reduce_nbytes(self) -> int:
        """Bytes of one rank's reduce-scatter output."""
        return self.reduce_numel * self.reduce_dtype.itemsize

    @property
    def grad_dtype(self) -> torch.dtype:
        """The sharded gradients' dtype: the first trainable parameter's own."""
        trainable = self.trainable
        return trainable[0].dtype if trainable else torch.float32

    @property
    def sharded_grad_nbytes(self) -> int:
        """The sharded gradients: the reduce output, in the parameters' own dtype."""
        return self.reduce_numel * self.grad_dtype.itemsize


def select_group_modules(model: nn.Module, wrap: WrapPolicy | None) -> list[tuple[str, nn.Module]]:
    """The (FQN, module) pairs that get a ``fully_shard`` call, root last.

    Raises:
        ValueError: a selected module has no forward of its own (a container), which
            ``fully_shard`` refuses.
    """
    chosen: list[tuple[str, nn.Module]] = []
    if wrap is None:
        chosen = _module_list_elements(model)
    else:
        for name, module in model.named_modules():
            if module is model:
                continue
            hit = wrap(name, module) if callable(wrap) else type(module).__name__ in wrap
            if hit:
                chosen.append((name, module))
    for name, module in chosen:
        if type(module).forward is nn.Module.forward:
            raise ValueError(
                f"shardkit.tools.plan: module {name} ({type(module).__name__}) has no forward "
                "(a container), which fully_shard refuses; select the modules inside it"
            )
    return [*chosen, ("", model)]


def _module_list_elements(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Elements of ``nn.ModuleList``s, outermost only (a block's own lists stay inside it)."""
    found: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        name, module = stack.pop()
        for child_name, child in reversed(list(module.named_children())):
            fqn = f"{name}.{child_name}" if name else child_name
            if isinstance(module, nn.ModuleList):
                found.append((fqn, child))  # an element: sharded whole, not entered
            else:
                stack.append((fqn, child))
    # The stack visits children in registration order; keep that order (forward order).
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(found, key=lambda item: order[id(item[1])])


def build_groups(model: nn.Module, options: PlanOptions, shard_size: int) -> list[GroupSpec]:
    """One GroupSpec per selected module that manages parameters, root last.

    A module's group holds the parameters in its tree that no selected submodule holds, as
    when ``fully_shard`` is applied bottom-up.

    Raises:
        ValueError: a parameter is shared by two groups, or is 0-dim; the trainable
            parameters of a group have different gather dtypes and no ``reduce_dtype`` is
            set (the engine refuses all three).
    """
    selected = select_group_modules(model, options.wrap)
    is_group = {id(m) for _, m in selected}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    owner: dict[int, str] = {}
    groups: list[GroupSpec] = []
    for name, module in selected:
        fqn = name or "<root>"
        params: list[ParamSpec] = []
        for param in _own_params(module, is_group):
            pname = names.get(id(param), "?")
            if id(param) in owner:
                raise ValueError(
                    f"shardkit.tools.plan: parameter {pname} is shared by the groups "
                    f"{owner[id(param)]} and {fqn}; fully_shard needs it in one group"
                )
            owner[id(param)] = fqn
            params.append(_param_spec(pname, param, options, shard_size))
        if params:
            groups.append(
                GroupSpec(
                    fqn=fqn,
                    module=module,
                    params=tuple(params),
                    reduce_dtype=_reduce(fqn, params, options),
                )
            )
    return groups


def _own_params(module: nn.Module, is_group: set[int]) -> list[nn.Parameter]:
    """Parameters under ``module`` not under another group module, each once, pre-order."""
    seen: set[int] = set()
    found: list[nn.Parameter] = []
    stack = [module]
    while stack:
        current = stack.pop()
        for param in current._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                found.append(param)
        stack.extend(c for c in reversed(list(current.children())) if id(c) not in is_group)
    return found


def _param_spec(name: str, param: nn.Parameter, options: PlanOptions, shard_size: int) -> ParamSpec:
    if param.dim() == 0:
        raise ValueError(
            f"shardkit.tools.plan: parameter {name} is 0-dim, which fully_shard cannot shard"
        )
    if not param.is_meta:
        raise ValueError(
            f"shardkit.tools.plan: parameter {name} is on {param.device}; build the model "
            "under torch.device('meta') so that planning allocates nothing"
        )
    comm = param.dtype
    if options.param_dtype is not None and param.dtype.is_floating_point:
        comm = options.param_dtype
    return ParamSpec(
        fqn=name,
        shape=tuple(param.shape),
        dtype=param.dtype,
        comm_dtype=comm,
        requires_grad=param.requires_grad,
        world=shard_size,
    )


def _reduce(fqn: str, params: list[ParamSpec], options: PlanOptions) -> torch.dtype:
    if options.reduce_dtype is not None:
        return options.reduce_dtype
    dtypes = {p.comm_dtype for p in params if p.requires_grad}
    if len(dtypes) > 1:
        listed = ", ".join(f"{p.fqn}: {p.comm_dtype}" for p in params if p.requires_grad)
        raise ValueError(
            f"shardkit.tools.plan: group {fqn} has trainable parameters of several dtypes "
            f"({listed}); fully_shard needs one, so set param_dtype or reduce_dtype"
        )
    return dtypes.pop() if dtypes else torch.float32
