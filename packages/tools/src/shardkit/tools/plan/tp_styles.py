"""What a tensor-parallel plan does to a model, read from its ParallelStyles, on the meta device.

A TP plan is the dict ``parallelize_module`` takes: module path (``fnmatch`` patterns per path
atom, as torch matches them) -> ParallelStyle. Without running it, this module says

- which parameters become DTensors on the tp axis, with which placement, and so the TP-local
  shape each rank keeps (what the data-parallel axis then shards: the core's layout is asked
  with that shape);
- what each style does at its module's boundary (:class:`StyleRole`): the layouts it gives
  the inputs, the placement the module's computation produces, the output layout it asks for.

The styles' documented behaviour, in torch 2.13: ColwiseParallel shards a Linear's weight and
bias on dim 0 (an Embedding's weight on dim 1), wants a replicated input and produces
``Shard(-1)``; RowwiseParallel shards a Linear's weight on dim 1 and replicates its bias (an
Embedding's weight on dim 0), wants the input sharded on its last dim (an Embedding: replicated)
and produces a partial sum; SequenceParallel replicates the module's parameters, shards input
and output on the sequence dim; PrepareModuleInput only redistributes inputs. Other styles are
refused with the module's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch

import torch
from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "StyleRole",
    "TPPlan",
    "param_placements",
    "check_shardable",
    "resolve_plan",
    "style_role",
    "tp_dims_of",
    "tp_local_shape",
]

TPPlan = Mapping[str, ParallelStyle] | Callable[[nn.Module], Mapping[str, ParallelStyle]]
"""A plan as ``parallelize_module`` takes it, or a function of the model returning one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StyleRole:
    """What one style does at its module's forward boundary, in placements on the tp axis."""

    fqn: str
    """The module's FQN ('' for the root)."""
    inputs: tuple[tuple[Placement | None, Placement | None], ...]
    """Per positional input: (the layout a plain tensor is taken to have, the layout the
    module wants); ``(None, None)`` leaves that input alone."""
    produces: Placement | None
    """The placement of the module's output given its wanted input (None: that input's)."""
    output: Placement | None
    """The layout the output is redistributed to (None: left as produced)."""
    local_output: bool
    """Whether the output leaves as a plain local tensor."""
    input_grad: Placement | None
    """The placement of the gradient the module's backward gives its first input (None:
    none, or, for a style that only prepares inputs, whatever its consumers give)."""
    prepares_only: bool = False
    """PrepareModuleInput: the prepared inputs go on into the module; outputs are left."""


def resolve_plan(model: nn.Module, plan: TPPlan) -> dict[str, tuple[nn.Module, ParallelStyle]]:
    """Module FQN -> (module, style), in module order, as ``parallelize_module`` matches.

    Raises:
        ValueError: a plan key matches no module, or two keys match one module.
        TypeError: the plan is not a mapping of ParallelStyles.
    """
    styles = plan(model) if callable(plan) else plan
    if not isinstance(styles, Mapping):
        raise TypeError(f"shardkit.tools.plan: a TP plan must be a mapping, got {type(styles)}")
    modules = list(model.named_modules())
    found: dict[str, tuple[nn.Module, ParallelStyle]] = {}
    for key, style in styles.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"shardkit.tools.plan: the TP plan's {key!r} is a {type(style).__name__}, "
                "not a ParallelStyle"
            )
        atoms = key.split(".")
        hits = [(n, m) for n, m in modules if _matches(n, atoms)]
        if not hits:
            raise ValueError(f"shardkit.tools.plan: the TP plan's {key!r} matches no module")
        for name, module in hits:
            if name in found:
                raise ValueError(f"shardkit.tools.plan: two TP plan keys match module {name}")
            found[name] = (module, style)
    order = {name: i for i, (name, _) in enumerate(modules)}
    return dict(sorted(found.items(), key=lambda item: order[item[0]]))


def _matches(name: str, atoms: list[str]) -> bool:
    parts = name.split(".") if name else []
    return len(parts) == len(atoms) and all(
        fnmatch(p, a) for p, a in zip(parts, atoms, strict=True)
    )


def param_placements(
    resolved: Mapping[str, tuple[nn.Module, ParallelStyle]],
) -> dict[str, Placement]:
    """Parameter FQN -> its placement on the tp axis, for every parameter a style distributes."""
    placements: dict[str, Placement] = {}
    for fqn, (module, style) in resolved.items():
        for name, placement in _style_params(fqn, module, style).items():
            placements[f"{fqn}.{name}" if fqn else name] = placement
    return placements


def tp_dims_of(model: nn.Module, tp_plan: TPPlan) -> dict[str, int | None]:
    """Parameter FQN -> the tensor dim ``tp_plan`` shards (None: replicated on tp).

    What the export's and the checkpoint's predictions take of a TP plan (``export/``,
    ``checkpoint/``).
    """
    placements = param_placements(resolve_plan(model, tp_plan))
    return {k: p.dim if isinstance(p, Shard) else None for k, p in placements.items()}


def _style_params(fqn: str, module: nn.Module, style: ParallelStyle) -> dict[str, Placement]:
    if isinstance(style, ColwiseParallel | RowwiseParallel):
        colwise = isinstance(style, ColwiseParallel)
        if isinstance(module, nn.Linear):
            weight: Placement = Shard(0) if colwise else Shard(1)
            bias: Placement = Shard(0) if colwise else Replicate()
            return {"weight": weight, **({"bias": bias} if module.bias is not None else {})}
        if isinstance(module, nn.Embedding):
            return {"weight": Shard(1) if colwise else Shard(0)}
        raise ValueError(
            f"shardkit.tools.plan: {type(style).__name__} on {fqn or '<root>'} "
            f"({type(module).__name__}): torch supports it on nn.Linear and nn.Embedding only"
        )
    if isinstance(style, SequenceParallel):
        return {name: Replicate() for name, _ in module.named_parameters()}
    if isinstance(style, PrepareModuleInput):
        return {}
    raise ValueError(
        f"shardkit.tools.plan: {type(style).__name__} on {fqn or '<root>'} is not modelled "
        "(ColwiseParallel, RowwiseParallel, SequenceParallel and PrepareModuleInput are)"
    )


def style_role(fqn: str, module: nn.Module, style: ParallelStyle) -> StyleRole:
    """The boundary behaviour of ``style`` on ``module`` (see :class:`StyleRole`)."""
    _style_params(fqn, module, style)  # refuses what is not modelled
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return StyleRole(
            fqn=fqn,
            inputs=((style.input_layouts[0], Replicate()),),
            produces=Shard(-1),
            output=style.output_layouts[0],
            local_output=style.use_local_output,
            input_grad=None if embedding else Partial(),
        )
    if isinstance(style, RowwiseParallel):
        wanted: Placement = Replicate() if embedding else Shard(-1)
        return StyleRole(
            fqn=fqn,
            inputs=((style.input_layouts[0], wanted),),
            produces=Partial(),
            output=style.output_layouts[0],
            local_output=style.use_local_output,
            input_grad=None if embedding else wanted,
        )
    if isinstance(style, SequenceParallel):
        (sequence,) = style.sequence_sharding
        return StyleRole(
            fqn=fqn,
            inputs=((sequence, sequence),),
            produces=None,
            output=None,
            local_output=style.use_local_output,
            input_grad=sequence,
        )
    assert isinstance(style, PrepareModuleInput)
    if style.with_kwargs:
        raise ValueError(
            f"shardkit.tools.plan: PrepareModuleInput on {fqn or '<root>'} with keyword "
            "layouts is not modelled"
        )
    layouts = tuple(style.input_layouts or ())
    desired = tuple(style.desired_input_layouts or (None,) * len(layouts))
    return StyleRole(
        fqn=fqn,
        inputs=tuple(zip(layouts, desired, strict=True)),
        produces=None,
        output=None,
        local_output=style.use_local_output,
        input_grad=None,
        prepares_only=True,
    )


def check_shardable(
    what: str, shape: tuple[int, ...], placement: Placement, tp_degree: int
) -> None:
    """Refuse a ``Shard`` of a dim smaller than the tp degree.

    DTensor does not run an operator sharded on such a dim (``is_tensor_shardable``): it
    gathers the tensor, or the weights, inside the operator instead, a choice of its own that
    the planner does not model.

    Raises:
        ValueError: naming ``what``, the dim and its size.
    """
    if isinstance(placement, Shard) and shape:
        dim = placement.dim % len(shape)
        if shape[dim] < tp_degree:
            raise ValueError(
                f"shardkit.tools.plan: {what} shards dim {dim} of size {shape[dim]} over "
                f"tp_degree {tp_degree}; DTensor would not run it sharded (it gathers inside "
                "the operator instead), which the planner does not model"
            )


def tp_local_shape(
    shape: tuple[int, ...], placement: Placement, tp_rank: int, tp_degree: int
) -> tuple[int, ...]:
    """The shape of ``tp_rank``'s local tensor of a tensor placed ``placement`` on tp.

    DTensor cuts a ``Shard(dim)`` with ``torch.chunk`` (the last ranks may get less, or
    nothing); torch.chunk on a meta tensor says how, allocating nothing.
    """
    if not isinstance(placement, Shard):
        return shape
    dim = placement.dim % len(shape)
    chunks = torch.empty(shape, device="meta").chunk(tp_degree, dim)
    if tp_rank < len(chunks):
        return tuple(chunks[tp_rank].shape)
    return tuple(0 if i == dim else n for i, n in enumerate(shape))
