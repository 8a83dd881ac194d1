"""``parallelize_source``: a :class:`ShardingPlan` written out as a ``parallelize`` function.

The function makes the calls :func:`~shardkit.tools.plan.apply.apply.apply_plan` makes, in the
same order, as plain code a user can paste into a training script and edit: modules reached
by attribute and index (``model.blocks[3].attn``), and a ``for`` loop where consecutive units
repeat over the items of one container (every block, or every block's attention and MLP).
Loops are found from the plan's names alone (``source_loops``); digits index a
``ModuleList`` or ``Sequential``, and a ``ModuleDict`` keyed by digits is indexed by string
when the model is given.
"""

from __future__ import annotations

import dataclasses
import keyword

import torch
from torch import nn

from shardkit.core import ReducePrecision
from shardkit.tools.plan.apply.apply import SELECTIVE_SAVED_OPS
from shardkit.tools.plan.apply.source_loops import Item, Loop, runs
from shardkit.tools.plan.sharding_plan import ROOT, ShardingPlan

__all__ = ["parallelize_source"]

_WIDTH = 100  # the house line length: the source should pass ruff as written


class _Paths:
    """Python expressions for modules: ``model.blocks[3].attn``."""

    def __init__(self, model: nn.Module | None) -> None:
        modules = dict(model.named_modules()) if model is not None else {}
        self.dicts = {name for name, m in modules.items() if isinstance(m, nn.ModuleDict)}
        self.lengths = {name: len(m) for name, m in modules.items() if isinstance(m, nn.ModuleList)}

    def access(self, fqn: str, base: str = "model", parent: str = "") -> str:
        """The expression for ``fqn`` (relative to ``parent``, reached as ``base``)."""
        expr = base
        for segment in fqn.split(".") if fqn else []:
            if parent in self.dicts:
                expr += f"[{_quote(segment)}]"
            elif segment.isdigit():
                expr += f"[{segment}]"
            elif segment.isidentifier() and not keyword.iskeyword(segment):
                expr += f".{segment}"
            else:  # a name no attribute access can spell
                expr += f".get_submodule({_quote(segment)})"
            parent = f"{parent}.{segment}" if parent else segment
        return expr

    def item(self, loop: Loop, offset: int) -> tuple[str, str]:
        """``container[i + offset]`` for the loop's index ``i``, and its FQN on the first pass."""
        index = "i" if offset == 0 else f"i {'+' if offset > 0 else '-'} {abs(offset)}"
        key = f"str({index})" if loop.container in self.dicts else index
        inner = f"{loop.container}.{loop.start + offset}".lstrip(".")
        return f"{self.access(loop.container)}[{key}]", inner

    def in_loop(self, loop: Loop, offset: int, tail: str) -> str:
        """``container[i + offset]tail`` for the loop's index ``i``."""
        return self.access(tail.lstrip("."), *self.item(loop, offset))

    def assignment(self, fqn: str, base: str = "model", parent: str = "") -> tuple[str, str]:
        """How to replace the module at ``fqn``.

        (target, "") to assign to, or (parent expression, quoted name) for ``setattr`` where
        no expression can be assigned to.
        """
        head, _, last = fqn.rpartition(".")
        owner = self.access(head, base, parent)
        owner_fqn = ".".join(part for part in (parent, head) if part)
        target = self.access(last, owner, owner_fqn)
        return (target, "") if not target.endswith(")") else (owner, _quote(last))

    def loop_head(self, loop: Loop) -> tuple[str, str] | None:
        """``for block in model.blocks[a:b]:`` and the name, when the loop is that simple."""
        (modules, _), *more = loop.body
        if more or len(modules) != 1 or modules[0] != (0, "") or loop.step != 1:
            return None
        if loop.container in self.dicts:
            return None
        name = loop.container.rpartition(".")[2]
        name = name[:-1] if len(name) > 1 and name.endswith("s") else "module"
        if not name.isidentifier() or keyword.iskeyword(name) or name in ("model", "mesh", "i"):
            name = "module"
        container = self.access(loop.container)
        whole = self.lengths.get(loop.container) == loop.stop and loop.start == 0
        span = "" if whole else f"[{loop.start or ''}:{loop.stop}]"
        return f"for {name} in {container}{span}:", name


def _call(indent: str, head: str, args: list[str], tail: str = ")") -> list[str]:
    """``head`` + args + ``tail`` on one line, or wrapped as ruff format would."""
    line = f"{indent}{head}{', '.join(args)}{tail}"
    if len(line) <= _WIDTH:
        return [line]
    inner = f"{indent}    {', '.join(args)}"
    if len(inner) <= _WIDTH:
        return [f"{indent}{head}", inner, f"{indent}{tail}"]
    return [f"{indent}{head}", *(f"{indent}    {a}," for a in args), f"{indent}{tail}"]


def _quote(text: str) -> str:
    """A string literal in double quotes where it can be, as ruff format writes it."""
    literal = repr(text)
    return f'"{text}"' if literal == f"'{text}'" and '"' not in text else literal


def _dtype(dtype: torch.dtype) -> str:
    return f"torch.{str(dtype).removeprefix('torch.')}"


class _Writer:
    """The function's lines, and the names they need imported."""

    def __init__(self, plan: ShardingPlan, engine: str, paths: _Paths) -> None:
        self.plan, self.paths = plan, paths
        self.engine_module = "shardkit.core" if engine == "shardkit" else "torch.distributed.fsdp"
        self.names: dict[str, set[str]] = {
            "torch": {"nn"},
            "torch.distributed.device_mesh": {"DeviceMesh"},
        }
        self.plain: set[str] = set()
        self.lines: list[str] = []

    def need(self, module: str, name: str) -> None:
        self.names.setdefault(module, set()).add(name)

    def checkpoints(self) -> None:
        """Wrap the checkpointed modules in their parents.

        Inner ones first: a wrapper does not pass attribute assignment on to the module it
        wraps, so an outer wrapper would hide the inner module's parent.
        """
        entries = sorted(self.plan.checkpoint, key=lambda e: -e[0].count("."))
        if not entries:
            return
        self.need("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl")
        self.need(
            "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"
        )
        if any(mode == "selective" for _, mode in entries):
            self.plain.add("functools")
            self.need("torch.utils.checkpoint", "create_selective_checkpoint_contexts")
            self.lines.append(
                "    selective = functools.partial(create_selective_checkpoint_contexts, SAVED_OPS)"
            )
        for run in runs([Item((fqn,), mode) for fqn, mode in entries]):
            if isinstance(run, Item):
                fqn = run.modules[0]
                self._wrap("    ", self.paths.access(fqn), self.paths.assignment(fqn), run.extra)
                continue
            self.lines.append(f"    for i in {_range(run)}:")
            for ((offset, tail),), mode in run.body:
                module = self.paths.in_loop(run, offset, tail)
                if tail:
                    where = self.paths.assignment(tail.lstrip("."), *self.paths.item(run, offset))
                else:
                    where = (module, "")
                self._wrap("        ", module, where, mode)

    def _wrap(self, indent: str, module: str, where: tuple[str, str], mode: object) -> None:
        args = [module, "checkpoint_impl=CheckpointImpl.NO_REENTRANT"]
        if mode == "selective":
            args.append("context_fn=selective")
        target, name = where
        if not name:
            self.lines += _call(indent, f"{target} = checkpoint_wrapper(", args)
        else:  # get_submodule(...) cannot be assigned to: set the parent's attribute
            self.lines += _call(
                indent, f"setattr({target}, {name}, checkpoint_wrapper(", args, "))"
            )

    def units(self) -> None:
        """One ``fully_shard`` call per unit, in plan order."""
        plan, shared = self.plan, ["mesh=mesh"]
        self.need(self.engine_module, "fully_shard")
        if plan.param_dtype is not None or plan.reduce_dtype is not None:
            self.need(self.engine_module, "MixedPrecisionPolicy")
            dtypes = [
                f"{name}={_dtype(value)}"
                for name, value in (
                    ("param_dtype", plan.param_dtype),
                    ("reduce_dtype", plan.reduce_dtype),
                )
                if value is not None
            ]
            self.lines += _call("    ", "mp_policy = MixedPrecisionPolicy(", dtypes)
            shared.append("mp_policy=mp_policy")
        if plan.offload:
            self.need(self.engine_module, "CPUOffloadPolicy")
            self.lines.append("    offload_policy = CPUOffloadPolicy()")
            shared.append("offload_policy=offload_policy")
        items = [Item(unit.modules, unit.reshard_after_forward) for unit in plan.units]
        for run in runs(items):
            if isinstance(run, Item):
                targets = [self.paths.access(m) for m in run.modules]
                self._shard("    ", targets, run.extra, shared)
                continue
            simple = self.paths.loop_head(run)
            if simple is not None:
                self.lines.append(f"    {simple[0]}")
                self._shard("        ", [simple[1]], run.body[0][1], shared)
                continue
            self.lines.append(f"    for i in {_range(run)}:")
            for modules, reshard in run.body:
                targets = [self.paths.in_loop(run, *m) for m in modules]
                self._shard("        ", targets, reshard, shared)

    def _shard(self, indent: str, targets: list[str], reshard: object, shared: list[str]) -> None:
        target = targets[0] if len(targets) == 1 else f"[{', '.join(targets)}]"
        args = [target, *shared, f"reshard_after_forward={reshard}"]
        self.lines += _call(indent, "fully_shard(", args)

    def unit_list(self) -> None:
        """``units``: each non-root unit's first module, in forward order (the setters' list)."""
        parts: list[str] = []
        non_root = [Item(u.modules, None) for u in self.plan.units if u.modules != (ROOT,)]
        for run in runs(non_root):
            if isinstance(run, Item):
                parts.append(self.paths.access(run.modules[0]))
                continue
            simple = self.paths.loop_head(run)
            if simple is not None:
                parts.append("*" + simple[0].split(" in ", 1)[1].removesuffix(":"))
                continue
            firsts = [self.paths.in_loop(run, *modules[0]) for modules, _ in run.body]
            if len(firsts) == 1:
                parts.append(f"*[{firsts[0]} for i in {_range(run)}]")
            else:
                parts.append(f"*[m for i in {_range(run)} for m in ({', '.join(firsts)})]")
        self.lines += _call("    ", "units = [", parts, "]")

    def prefetch(self) -> None:
        k = self.plan.prefetch
        self.lines += [
            "    for i, unit in enumerate(units):",
            f"        if units[i + 1 : i + {k + 1}]:",
            f"            unit.set_modules_to_forward_prefetch(units[i + 1 : i + {k + 1}])",
            "        if i > 0:",
            f"            unit.set_modules_to_backward_prefetch(units[max(0, i - {k}) : i][::-1])",
        ]

    def reduce_precision(self, policy: ReducePrecision) -> None:
        self.need(self.engine_module, "ReducePrecision")
        default = ReducePrecision()
        args = []
        for field in dataclasses.fields(ReducePrecision):
            value = getattr(policy, field.name)
            if value != getattr(default, field.name):
                text = _dtype(value) if isinstance(value, torch.dtype) else repr(value)
                args.append(f"{field.name}={text}")
        self.lines += _call("    ", "reduce_precision = ReducePrecision(", args)
        everyone = "[*units, model]" if self.plan.units[-1].modules == (ROOT,) else "units"
        self.lines += [
            f"    for unit in {everyone}:",
            "        unit.set_reduce_precision(reduce_precision, recurse=False)",
        ]

    def source(self) -> str:
        """The whole file: imports, the saved ops of selective checkpointing, the function."""
        selective = any(mode == "selective" for _, mode in self.plan.checkpoint)
        if selective or any("torch." in line for line in self.lines):
            self.plain.add("torch")
        out = [
            "# Written by shardkit.tools.plan.apply.parallelize_source: the calls apply_plan"
            " makes.",
            "",
        ]
        if "functools" in self.plain:
            out += ["import functools", ""]
        if "torch" in self.plain:
            out.append("import torch")
        for module in sorted(self.names):
            names = ", ".join(sorted(self.names[module], key=_name_order))
            line = f"from {module} import {names}"
            if len(line) <= _WIDTH:
                out.append(line)
            else:
                out += [f"from {module} import (", *(f"    {n}," for n in names.split(", ")), ")"]
        if selective:
            ops = [f"torch.ops.aten.{name}.default" for name in _saved_op_names()]
            out += ["", "# Outputs a selective checkpoint saves; it recomputes the rest."]
            out += ["SAVED_OPS = ["] + [f"    {op}," for op in ops] + ["]"]
        out += [
            "",
            "",
            "def parallelize(model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:",
            '    """Shard ``model`` as its sharding plan says."""',
            *self.lines,
            "    return model",
        ]
        return "\n".join(out) + "\n"


def _name_order(name: str) -> tuple[int, str]:
    """The order of names in one import, as isort keeps it: constants, classes, the rest."""
    if name.isupper():
        return (0, name)
    return (1, name) if name[0].isupper() else (2, name)


def _saved_op_names() -> list[str]:
    return [name for name in SELECTIVE_SAVED_OPS if hasattr(torch.ops.aten, name)]


def _range(loop: Loop) -> str:
    if loop.step != 1:
        return f"range({loop.start}, {loop.stop}, {loop.step})"
    return f"range({loop.stop})" if loop.start == 0 else f"range({loop.start}, {loop.stop})"


def parallelize_source(
    plan: ShardingPlan, *, engine: str = "shardkit", model: nn.Module | None = None
) -> str:
    """``plan`` as the source of ``def parallelize(model, mesh=None) -> nn.Module``.

    The function makes :func:`~shardkit.tools.plan.apply.apply.apply_plan`'s calls in its order,
    as plain code: checkpoint wrappers, one ``fully_shard`` per unit (a loop where units
    repeat over a container's items), the prefetch lists and the reduce precision. It
    checks nothing: run ``apply_plan`` on the model once to have the plan checked.

    Args:
        plan: the plan to write out.
        engine: ``"shardkit"`` (``shardkit.core``'s ``fully_shard`` and policies) or
            ``"torch"`` (``torch.distributed.fsdp``'s).
        model: optional; given, a ``ModuleDict`` is indexed by string keys and a loop over
            a whole ``ModuleList`` iterates it without a slice.

    Returns:
        A Python module's source: the imports, and the function.

    Raises:
        ValueError: an unknown engine, or ``reduce_precision`` with torch's engine.
    """
    if engine not in ("shardkit", "torch"):
        raise ValueError(
            f"parallelize_source: engine must be 'shardkit' or 'torch', got {engine!r}"
        )
    if plan.reduce_precision is not None and engine != "shardkit":
        raise ValueError(
            "parallelize_source: the plan sets reduce_precision, which only shardkit's engine has"
        )
    writer = _Writer(plan, engine, _Paths(model))
    writer.checkpoints()
    writer.units()
    if plan.prefetch > 1 or plan.reduce_precision is not None:
        writer.unit_list()
    if plan.prefetch > 1:
        writer.prefetch()
    if plan.reduce_precision is not None:
        writer.reduce_precision(plan.reduce_precision)
    return writer.source()
