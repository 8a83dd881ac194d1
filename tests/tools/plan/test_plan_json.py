"""Plans as JSON: every plan survives ``dump_plan`` and ``load_plan``; bad documents are refused.

The document comes from elsewhere, so each way it can be wrong (not strict JSON, an unknown
key, a value of the wrong type, a dtype off the list, a ``ReducePrecision`` its constructor
refuses, a plan ``ShardingPlan`` refuses, too big) raises ``PlanFormatError`` naming the JSON
path of the value at fault.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shardkit.core import ReducePrecision
from shardkit.tools.plan.apply.plan_json import MAX_BYTES, PlanFormatError, dump_plan, load_plan
from shardkit.tools.plan.sharding_plan import ROOT, ShardingPlan, Unit
from tests.tools.plan import plan_runs

_VARIED = {
    **plan_runs.PLANS,
    "defaults": ShardingPlan(units=(Unit(modules=(ROOT,)),)),
    "everything": ShardingPlan(
        units=(Unit(modules=("a", "b"), reshard_after_forward=4), Unit(modules=(ROOT,))),
        prefetch=3,
        checkpoint=(("a", "selective"), ("b.c", "full")),
        offload=True,
        param_dtype=torch.float16,
        reduce_dtype=torch.float64,
        reduce_precision=ReducePrecision(
            wire_dtype=torch.int8,
            stochastic_rounding=True,
            seed=7,
            block_size=64,
            error_feedback=True,
            check_every=10,
            check_tolerance=0.5,
            check_action="raise",
        ),
        conditional=("b",),
    ),
    "bf16_wire": ShardingPlan(
        units=(Unit(modules=("x",), reshard_after_forward=False),),
        reduce_precision=ReducePrecision(wire_dtype=torch.bfloat16),
    ),
}


@pytest.mark.parametrize("name", list(_VARIED))
def test_every_plan_survives_the_round_trip(name: str, tmp_path: Path) -> None:
    plan = _VARIED[name]
    text = dump_plan(plan)
    assert load_plan(text) == plan
    path = tmp_path / "plan.json"
    path.write_text(text)
    assert load_plan(path) == plan
    assert load_plan(str(path)) == plan
    assert dump_plan(load_plan(text)) == text


def test_left_out_keys_take_the_plans_defaults() -> None:
    text = json.dumps(
        {"schema": "shardkit.sharding_plan", "version": 1, "units": [{"modules": ["a"]}]}
    )
    assert load_plan(text) == ShardingPlan(units=(Unit(modules=("a",)),))


def test_a_dtype_no_reader_accepts_is_not_written() -> None:
    with pytest.raises(ValueError, match=r"param_dtype torch\.float8_e4m3fn is not one of"):
        dump_plan(ShardingPlan(units=(Unit(modules=("a",)),), param_dtype=torch.float8_e4m3fn))


def _document(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = json.loads(dump_plan(_VARIED["everything"]))
    for key, value in changes.items():
        if value is _DROP:
            del base[key]
        else:
            base[key] = value
    return base


_DROP = object()
_RP = json.loads(dump_plan(_VARIED["everything"]))["reduce_precision"]

# name: (the document, or its text, and the words the error must contain)
_MALFORMED: dict[str, tuple[Any, str]] = {
    "not_json": ("{units: []}", "not valid JSON"),
    "nan": (
        json.dumps(_document()).replace('"check_tolerance": 0.5', '"check_tolerance": NaN'),
        "NaN is not allowed",
    ),
    "infinity": ('{"prefetch": Infinity}', "Infinity is not allowed"),
    "repeated_key": ('{"version": 1, "version": 1}', "key 'version' appears twice"),
    "nested": ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    "array": ("[1, 2]", "$: must be an object"),
    "unknown_key": (_document(prefetch_k=2), "$: unknown key(s) ['prefetch_k']"),
    "no_schema": (_document(schema=_DROP), "$: missing key(s) ['schema']"),
    "schema": (_document(schema="other"), "schema: must be 'shardkit.sharding_plan'"),
    "version": (_document(version=2), "version: this shardkit reads version 1, got 2"),
    "no_units": (_document(units=[]), "units: must hold at least one unit"),
    "units_type": (_document(units={"a": 1}), "units: must be an array, got an object"),
    "unit_key": (
        _document(units=[{"modules": ["a"], "reshard": True}]),
        "units[0]: unknown key(s) ['reshard']",
    ),
    "reshard_type": (
        _document(units=[{"modules": ["a"]}, {"modules": ["b"], "reshard_after_forward": "yes"}]),
        "units[1].reshard_after_forward: must be an integer from 1 to 2**63-1, got a string",
    ),
    "reshard_zero": (
        _document(units=[{"modules": ["a"], "reshard_after_forward": 0}]),
        "units[0].reshard_after_forward: must be an integer from 1",
    ),
    "module_type": (
        _document(units=[{"modules": ["a", 3]}]),
        "units[0].modules[1]: must be a string, got a number (3)",
    ),
    "empty_unit": (_document(units=[{"modules": []}]), "units[0]: Unit.modules must be"),
    "module_twice": (
        _document(units=[{"modules": ["a"]}, {"modules": ["a"]}], checkpoint=[]),
        "$: ShardingPlan: module 'a' is in two units",
    ),
    "checkpoint_mode": (
        _document(checkpoint=[{"module": "a", "mode": "partial"}]),
        "checkpoint[0].mode: must be 'full' or 'selective', got a string ('partial')",
    ),
    "checkpoint_key": (
        _document(checkpoint=[{"module": "a"}]),
        "checkpoint[0]: missing key(s) ['mode']",
    ),
    "prefetch_bool": (_document(prefetch=True), "prefetch: must be an integer"),
    "offload_type": (_document(offload="yes"), "offload: must be true or false"),
    "dtype_name": (_document(param_dtype="int8"), "param_dtype: must be null or one of"),
    "dtype_prefix": (_document(reduce_dtype="torch.float32"), "reduce_dtype: must be null"),
    "wire_dtype": (
        _document(reduce_precision=dict(_RP, wire_dtype="float16")),
        "reduce_precision: ReducePrecision.wire_dtype must be one of",
    ),
    "block_size": (
        _document(reduce_precision=dict(_RP, block_size=0)),
        "reduce_precision: ReducePrecision.block_size must be positive",
    ),
    "seed_huge": (
        _document(reduce_precision=dict(_RP, seed=2**70)),
        "reduce_precision.seed: must be an integer from 0 to 2**63-1",
    ),
    "tolerance_type": (
        _document(reduce_precision=dict(_RP, check_tolerance="0.1")),
        "reduce_precision.check_tolerance: must be a finite number",
    ),
    "precision_key": (
        _document(reduce_precision=dict(_RP, wire="int8")),
        "reduce_precision: unknown key(s) ['wire']",
    ),
    "conditional_type": (
        _document(conditional=["b", 3]),
        "conditional[1]: must be a string, got a number (3)",
    ),
    "conditional_root": (
        _document(conditional=[""]),
        "$: ShardingPlan.conditional: the root cannot be conditional",
    ),
    "conditional_no_unit": (
        _document(conditional=["b.c"]),
        "$: ShardingPlan.conditional: module 'b.c' is in no unit",
    ),
    "too_big": ('{"units": []' + " " * MAX_BYTES + "}", f"over {MAX_BYTES}"),
}


@pytest.mark.parametrize("name", list(_MALFORMED))
def test_a_malformed_document_is_refused_naming_where(name: str) -> None:
    document, words = _MALFORMED[name]
    text = document if isinstance(document, str) else json.dumps(document)
    with pytest.raises(PlanFormatError) as raised:
        load_plan(text)
    assert words in str(raised.value)


def test_a_file_over_the_cap_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    with path.open("wb") as file:
        file.truncate(MAX_BYTES + 1)
    with pytest.raises(PlanFormatError, match="bytes, over"):
        load_plan(path)


def test_drawn_plans_survive_the_round_trip() -> None:
    for seed in range(50):
        plan = plan_runs.random_plan(seed)
        assert load_plan(dump_plan(plan)) == plan, seed
