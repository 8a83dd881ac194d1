"""``parallelize_source``: the generated ``parallelize`` does what ``apply_plan`` does.

At W=2 on gloo, the function written for each plan (both engines, with and without the model
at hand, and with prefetch, offload-free reduce precision and sub-module loops) trains bit
for bit as ``apply_plan`` does. The source is plain: loops where units repeat, lines that
pass ``ruff check`` and ``ruff format --check`` as written. Twelve drawn plans (units whole,
split, paired, embeddings and head in units or not, any reshard, checkpoint, prefetch and
precision) train alike applied and written out, on both engines.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.pool import run_on_ranks
from shardkit.core import ReducePrecision
from shardkit.tools.plan.apply.parallelize_source import parallelize_source
from shardkit.tools.plan.sharding_plan import ROOT, ShardingPlan, Unit
from tests.tools.plan import plan_runs

WORLD_SIZE = 2

_WIRE = dataclasses.replace(
    plan_runs.PLANS["parts"],
    prefetch=3,
    reduce_precision=ReducePrecision(wire_dtype=torch.bfloat16),
)


@pytest.mark.parametrize("plan_name", list(plan_runs.PLANS))
def test_the_written_function_trains_as_apply_plan(plan_name: str) -> None:
    hows = ("shardkit", "source_shardkit", "source_shardkit_model", "torch", "source_torch")
    for traces in run_on_ranks(WORLD_SIZE, plan_runs.train_body, plan_name=plan_name, hows=hows):
        plan_runs.assert_bitwise(traces, oracle="shardkit")


def test_the_written_reduce_precision_trains_as_apply_plan() -> None:
    hows = ("shardkit", "source_shardkit", "source_shardkit_model")
    for traces in run_on_ranks(WORLD_SIZE, plan_runs.train_body, plan_name=_WIRE, hows=hows):
        plan_runs.assert_bitwise(traces, oracle="shardkit")


def _blocks(n: int) -> ShardingPlan:
    units = tuple(Unit(modules=(f"layers.{i}",)) for i in range(n))
    return ShardingPlan(units=(*units, Unit(modules=(ROOT,))))


def test_units_that_repeat_over_a_container_are_a_loop() -> None:
    source = parallelize_source(_blocks(32))
    assert "    for layer in model.layers[:32]:\n        fully_shard(layer, " in source
    assert source.count("fully_shard(") == 2  # the loop's and the root's
    pairs = ShardingPlan(
        units=tuple(Unit(modules=(f"h.{i}", f"h.{i + 1}")) for i in range(0, 8, 2)),
        checkpoint=tuple((f"h.{i}.mlp", "full") for i in range(8)),
    )
    source = parallelize_source(pairs)
    assert (
        "    for i in range(0, 8, 2):\n        fully_shard([model.h[i], model.h[i + 1]]" in source
    )
    assert "    for i in range(8):\n        model.h[i].mlp = checkpoint_wrapper(" in source


def test_a_gap_or_a_change_breaks_the_loop() -> None:
    units = [Unit(modules=(f"blocks.{i}",)) for i in (0, 1, 2, 4, 5, 6)]
    units[5] = Unit(modules=("blocks.6",), reshard_after_forward=False)
    source = parallelize_source(ShardingPlan(units=tuple(units)))
    assert "for block in model.blocks[:3]:" in source
    for line in ("model.blocks[4], ", "model.blocks[5], ", "model.blocks[6], "):
        assert line in source


def test_the_whole_container_is_iterated_when_the_model_is_given() -> None:
    model = plan_runs.build()
    source = parallelize_source(plan_runs.PLANS["blocks"], model=model)
    assert "for block in model.blocks[:3]:" in source  # three of four
    source = parallelize_source(_blocks_of("blocks", 4), model=model)
    assert "for block in model.blocks:" in source


def _blocks_of(container: str, n: int) -> ShardingPlan:
    units = tuple(Unit(modules=(f"{container}.{i}",)) for i in range(n))
    return ShardingPlan(units=(*units, Unit(modules=(ROOT,))))


def test_a_module_dict_is_indexed_by_key() -> None:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(2, 2) for i in range(4)})
    source = parallelize_source(_blocks_of("layers", 4), model=model)
    assert "    for i in range(4):\n        fully_shard(model.layers[str(i)], " in source


def test_reduce_precision_is_refused_for_torchs_engine() -> None:
    with pytest.raises(ValueError, match="only shardkit's engine"):
        parallelize_source(_WIRE, engine="torch")
    with pytest.raises(ValueError, match="engine must be"):
        parallelize_source(_WIRE, engine="deepspeed")


def _ruff() -> str | None:
    found = Path(sys.executable).with_name("ruff")
    return str(found) if found.exists() else shutil.which("ruff")


@pytest.mark.parametrize("engine", ["shardkit", "torch"])
def test_the_source_passes_ruff_as_written(engine: str, tmp_path: Path) -> None:
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed")
    plans = {**plan_runs.PLANS, "blocks32": _blocks(32)}
    if engine == "shardkit":
        plans["wire"] = _WIRE
    for name, plan in plans.items():
        path = tmp_path / f"parallelize_{name}.py"
        path.write_text(parallelize_source(plan, engine=engine))
        compile(path.read_text(), str(path), "exec")
        style = ["--isolated", "--line-length", "100"]
        rules = ["--select", "E,F,W,I,B,UP,SIM"]
        for command in (["check", *style, *rules], ["format", "--check", *style]):
            done = subprocess.run([ruff, *command, str(path)], capture_output=True, text=True)
            assert done.returncode == 0, (name, command, done.stdout, path.read_text())


def test_random_plans_written_out_train_as_applied() -> None:
    seeds = list(range(8))
    for rank_traces in run_on_ranks(WORLD_SIZE, plan_runs.random_plans_body, seeds=seeds):
        for seed, traces in zip(seeds, rank_traces, strict=True):
            assert traces["shardkit"]["losses"], seed
            plan_runs.assert_bitwise(traces, oracle="shardkit")
