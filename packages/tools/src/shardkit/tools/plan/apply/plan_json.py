"""A sharding plan as JSON: what ``shardkit-plan --fit`` writes and ``apply_plan`` reads.

The file is input from elsewhere, so reading it trusts nothing: a size cap, strict JSON (no
NaN or Infinity, no key twice), every key known, every value's type checked, dtypes by name
from a short list, and the records built through their own validating constructors. Each
error names the JSON path of the value at fault (``units[3].reshard_after_forward``). Nothing
is ever unpickled or imported.

The document, version 1::

    {"schema": "shardkit.sharding_plan", "version": 1,
     "units": [{"modules": ["blocks.0"], "reshard_after_forward": true}, ...],
     "prefetch": 1, "checkpoint": [{"module": "blocks.0", "mode": "full"}, ...],
     "offload": false, "param_dtype": "bfloat16", "reduce_dtype": "float32",
     "reduce_precision": null or {"wire_dtype": "bfloat16", "seed": 0, ...},
     "conditional": ["vision.tower", ...]}

``schema``, ``version`` and ``units`` are required; the others default as ``ShardingPlan``'s
fields do. ``reduce_precision`` holds ``ReducePrecision``'s fields by name; ``conditional``
the FQNs of the units' modules marked conditional (``ShardingPlan.conditional``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from shardkit.core import ReducePrecision
from shardkit.tools.plan.sharding_plan import CheckpointMode, ShardingPlan, Unit

__all__ = [
    "DTYPES",
    "MAX_BYTES",
    "SCHEMA",
    "VERSION",
    "PlanFormatError",
    "dump_plan",
    "load_plan",
    "plan_document",
]

SCHEMA = "shardkit.sharding_plan"
"""The ``schema`` every plan document names."""
VERSION = 1
"""The document version this module writes and reads."""
MAX_BYTES = 4 * 1024 * 1024
"""The largest document read: a plan of thousands of units is well under 1 MiB."""
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
"""The dtypes a plan may name for ``param_dtype`` and ``reduce_dtype``, by name."""

_TOP_KEYS = (
    "schema",
    "version",
    "units",
    "prefetch",
    "checkpoint",
    "offload",
    "param_dtype",
    "reduce_dtype",
    "reduce_precision",
    "conditional",
)
_UNIT_KEYS = ("modules", "reshard_after_forward")
_CHECKPOINT_KEYS = ("module", "mode")
_PRECISION_FIELDS = tuple(f.name for f in dataclasses.fields(ReducePrecision))


class PlanFormatError(ValueError):
    """A plan document that is not a valid plan; the message names the JSON path at fault."""


def dump_plan(plan: ShardingPlan) -> str:
    """``plan`` as a JSON document (indented, keys in a fixed order) that :func:`load_plan` reads.

    Raises:
        ValueError: a dtype outside :data:`DTYPES`, which no reader would accept.
    """
    return json.dumps(plan_document(plan), indent=2, allow_nan=False) + "\n"


def plan_document(plan: ShardingPlan) -> dict[str, Any]:
    """``plan`` as the JSON-ready dict that :func:`dump_plan` writes.

    ``shardkit-plan --fit --json`` nests it whole, under ``plan``.

    Raises:
        ValueError: a dtype outside :data:`DTYPES`, which no reader would accept.
    """
    precision = plan.reduce_precision
    document: dict[str, Any] = {
        "schema": SCHEMA,
        "version": VERSION,
        "units": [
            {"modules": list(unit.modules), "reshard_after_forward": unit.reshard_after_forward}
            for unit in plan.units
        ],
        "prefetch": plan.prefetch,
        "checkpoint": [{"module": fqn, "mode": mode} for fqn, mode in plan.checkpoint],
        "offload": plan.offload,
        "param_dtype": _dtype_name(plan.param_dtype, "param_dtype"),
        "reduce_dtype": _dtype_name(plan.reduce_dtype, "reduce_dtype"),
        "reduce_precision": None if precision is None else _precision_fields(precision),
        "conditional": list(plan.conditional),
    }
    return document


def _dtype_name(dtype: torch.dtype | None, field: str) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise ValueError(f"dump_plan: {field} {dtype} is not one of {sorted(DTYPES)}")
    return name


def _precision_fields(precision: ReducePrecision) -> dict[str, Any]:
    fields = {name: getattr(precision, name) for name in _PRECISION_FIELDS}
    wire = fields["wire_dtype"]
    fields["wire_dtype"] = None if wire is None else str(wire).removeprefix("torch.")
    return fields


def load_plan(text_or_path: str | os.PathLike[str]) -> ShardingPlan:
    """The plan in a JSON document: its text, or the path of a file holding it.

    A ``str`` whose first non-blank character is ``{`` or ``[`` is the document itself; any
    other ``str`` or path-like is a file's path.

    Raises:
        PlanFormatError: (a ValueError) a document over :data:`MAX_BYTES`, not strict JSON,
            or not a valid plan; the message names the JSON path at fault.
        OSError: the file cannot be read.
    """
    if isinstance(text_or_path, str) and text_or_path.lstrip().startswith(("{", "[")):
        text = text_or_path
        if len(text) > MAX_BYTES:
            raise PlanFormatError(f"plan JSON: {len(text)} characters, over {MAX_BYTES}")
    else:
        path = Path(text_or_path)
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise PlanFormatError(f"plan JSON {str(path)!r}: {size} bytes, over {MAX_BYTES}")
        text = path.read_text(encoding="utf-8")
    return _plan(_parse(text))


def _parse(text: str) -> Any:
    """Strict JSON: no NaN or Infinity, no key twice in one object, no deep nesting."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_no_repeats)
    except json.JSONDecodeError as error:
        raise PlanFormatError(f"plan JSON: not valid JSON: {error}") from None
    except RecursionError:
        raise PlanFormatError("plan JSON: nested too deeply") from None


def _refuse_constant(name: str) -> Any:
    raise PlanFormatError(f"plan JSON: {name} is not allowed (strict JSON)")


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise PlanFormatError(f"plan JSON: key {key!r} appears twice in one object")
        found[key] = value
    return found


def _fail(path: str, message: str) -> PlanFormatError:
    return PlanFormatError(f"plan JSON: {path}: {message}")


def _object(
    value: Any, path: str, known: tuple[str, ...], required: tuple[str, ...]
) -> dict[str, Any]:
    """``value`` as a JSON object holding only ``known`` keys and every ``required`` one."""
    if not isinstance(value, dict):
        raise _fail(path, f"must be an object, got {_kind(value)}")
    unknown = [key for key in value if key not in known]
    if unknown:
        raise _fail(path, f"unknown key(s) {unknown}; known: {list(known)}")
    missing = [key for key in required if key not in value]
    if missing:
        raise _fail(path, f"missing key(s) {missing}")
    return value


def _kind(value: Any) -> str:
    """How a JSON value is named in errors: its JSON type and a short repr."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    kind = names.get(type(value), "a number")
    text = repr(value)
    return kind if len(text) > 40 else f"{kind} ({text})"


_INT_MAX = 2**63 - 1  # what torch's generators and C++ code take


def _int(value: Any, path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= _INT_MAX:
        raise _fail(path, f"must be an integer from {minimum} to 2**63-1, got {_kind(value)}")
    return value


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, f"must be true or false, got {_kind(value)}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise _fail(path, f"must be a string, got {_kind(value)}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(path, f"must be an array, got {_kind(value)}")
    return value


def _dtype(value: Any, path: str) -> torch.dtype | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in DTYPES:
        raise _fail(path, f"must be null or one of {sorted(DTYPES)}, got {_kind(value)}")
    return DTYPES[value]


def _plan(document: Any) -> ShardingPlan:
    top = _object(document, "$", _TOP_KEYS, ("schema", "version", "units"))
    if top["schema"] != SCHEMA:
        raise _fail("schema", f"must be {SCHEMA!r}, got {_kind(top['schema'])}")
    if _int(top["version"], "version", 1) != VERSION:
        raise _fail("version", f"this shardkit reads version {VERSION}, got {top['version']}")
    units = _list(top["units"], "units")
    if not units:
        raise _fail("units", "must hold at least one unit")
    checkpoint = _list(top.get("checkpoint", []), "checkpoint")
    conditional = _list(top.get("conditional", []), "conditional")
    precision = top.get("reduce_precision")
    fields: dict[str, Any] = {
        "units": tuple(_unit(value, f"units[{i}]") for i, value in enumerate(units)),
        "prefetch": _int(top.get("prefetch", 1), "prefetch", 1),
        "checkpoint": tuple(_checkpoint(v, f"checkpoint[{i}]") for i, v in enumerate(checkpoint)),
        "offload": _bool(top.get("offload", False), "offload"),
        "param_dtype": _dtype(top.get("param_dtype"), "param_dtype"),
        "reduce_dtype": _dtype(top.get("reduce_dtype"), "reduce_dtype"),
        "reduce_precision": None if precision is None else _precision(precision),
        "conditional": tuple(_str(v, f"conditional[{i}]") for i, v in enumerate(conditional)),
    }
    try:
        return ShardingPlan(**fields)
    except (TypeError, ValueError) as error:
        raise _fail("$", str(error)) from None


def _unit(value: Any, path: str) -> Unit:
    record = _object(value, path, _UNIT_KEYS, ("modules",))
    modules = _list(record["modules"], f"{path}.modules")
    names = tuple(_str(m, f"{path}.modules[{i}]") for i, m in enumerate(modules))
    reshard = record.get("reshard_after_forward", True)
    if not isinstance(reshard, bool):
        reshard = _int(reshard, f"{path}.reshard_after_forward", 1)
    try:
        return Unit(modules=names, reshard_after_forward=reshard)
    except (TypeError, ValueError) as error:
        raise _fail(path, str(error)) from None


def _checkpoint(value: Any, path: str) -> tuple[str, CheckpointMode]:
    record = _object(value, path, _CHECKPOINT_KEYS, _CHECKPOINT_KEYS)
    module = _str(record["module"], f"{path}.module")
    mode = record["mode"]
    if mode == "full" or mode == "selective":
        return module, mode
    raise _fail(f"{path}.mode", f"must be 'full' or 'selective', got {_kind(mode)}")


def _precision(value: Any) -> ReducePrecision:
    path = "reduce_precision"
    record = _object(value, path, _PRECISION_FIELDS, ())
    fields: dict[str, Any] = {}
    for name, item in record.items():
        where = f"{path}.{name}"
        if name == "wire_dtype":
            fields[name] = None if item is None else _str(item, where)
        elif name in ("stochastic_rounding", "error_feedback"):
            fields[name] = _bool(item, where)
        elif name == "check_tolerance":
            if (
                isinstance(item, bool)
                or not isinstance(item, int | float)
                or not math.isfinite(item)
            ):
                raise _fail(where, f"must be a finite number, got {_kind(item)}")
            fields[name] = float(item)
        elif name == "check_action":
            fields[name] = _str(item, where)
        elif name in ("seed", "block_size", "check_every"):
            fields[name] = _int(item, where, 0)
        else:  # a field added to ReducePrecision that this reader does not know yet
            raise _fail(where, "is not readable from JSON by this shardkit")
    try:
        return ReducePrecision(**fields)
    except (TypeError, ValueError) as error:
        raise _fail(path, str(error)) from None
