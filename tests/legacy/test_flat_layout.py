"""shardkit's FSDP1 flat-parameter layout equals the one torch's FSDP1 builds.

FSDP1 wraps the test models on 2 and 4 gloo ranks with each kind of auto-wrap policy,
``use_orig_params`` False and True, and fp32 or bf16 mixed precision; every unit's parameter
order, tied names, padding, flat size and local shard size must match what
``flat_param_layout`` computes from a meta-device copy of the model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.pool import run_on_ranks
from shardkit.legacy import FlatParamEntry, FlatParamUnit, flat_param_layout
from tests.legacy import fsdp1_runs


def _cases() -> list[dict[str, Any]]:
    cases = [
        {"model": "gpt", "policy": "blocks", "use_orig_params": uop, "mp": mp}
        for uop in (False, True)
        for mp in (None, "bf16")
    ]
    cases += [
        {"model": "gpt", "policy": name, "use_orig_params": True, "mp": "bf16"}
        for name in ("none", "classes", "custom", "size", "transformer")
    ]
    cases += [
        {"model": "normnet", "policy": name, "use_orig_params": True, "mp": mp}
        for name in ("size", "custom")
        for mp in (None, "bf16")
    ]
    return cases


def _segments(unit: FlatParamUnit) -> tuple[list[int], list[bool]]:
    """FSDP1's ``_numels_with_padding`` and ``_is_padding_mask`` from shardkit's offsets."""
    numels: list[int] = []
    mask: list[bool] = []
    position = 0
    for entry in unit.params:
        if entry.offset > position:
            numels.append(entry.offset - position)
            mask.append(True)
        numels.append(entry.numel)
        mask.append(False)
        position = entry.offset + entry.numel
    if unit.numel > position:
        numels.append(unit.numel - position)
        mask.append(True)
    return numels, mask


def _ours(case: dict[str, Any], world_size: int, rank: int) -> dict[str, dict[str, Any]]:
    with torch.device("meta"):
        model = fsdp1_runs.build(case["model"])
    layout = flat_param_layout(
        model,
        world_size=world_size,
        auto_wrap_policy=fsdp1_runs.shardkit_policy(case["policy"], model),
        use_orig_params=case["use_orig_params"],
        mixed_precision=fsdp1_runs.mixed_precision(case["mp"]),
    )
    units = {}
    for unit in layout.units:
        numels, mask = _segments(unit)
        units[unit.prefix] = {
            "fqns": [e.fqn for e in unit.params],
            "shared": [alias for e in unit.params for alias in e.aliases],
            "numels_with_padding": numels,
            "padding_mask": mask,
            "numel": unit.numel,
            "local": unit.local_numel(rank),
            "dtype": unit.dtype,
        }
    return units


@pytest.mark.parametrize("world_size", [2, 4])
def test_layouts_match_fsdp1(world_size: int) -> None:
    cases = _cases()
    per_rank = run_on_ranks(world_size, fsdp1_runs.unit_layouts, cases=cases)
    for rank, theirs in enumerate(per_rank):
        for case, their_units in zip(cases, theirs, strict=True):
            ours = _ours(case, world_size, rank)
            assert ours == their_units, (rank, case)
    # The cases exercise what they are meant to: alignment padding, tied names, many units.
    layouts = [_ours(case, world_size, 0) for case in cases]
    assert any(True in u["padding_mask"] for units in layouts for u in units.values())
    assert any(u["shared"] for units in layouts for u in units.values())
    assert max(len(units) for units in layouts) >= 5


def _entry(offset: int, numel: int) -> FlatParamEntry:
    return FlatParamEntry(
        fqn="w", aliases=(), shape=(numel,), stride=(1,), offset=offset, numel=numel
    )


def test_shards_and_pieces() -> None:
    # 10 elements on 4 ranks: chunks of 3, 3, 3, 1; rank 3's shard is short.
    unit = FlatParamUnit(prefix="b", dtype=torch.float32, params=(), numel=10, world_size=4)
    assert unit.state_dict_key == "b._flat_param"
    assert unit.shard_numel == 3
    assert [unit.local_numel(r) for r in range(4)] == [3, 3, 3, 1]
    assert [tuple(p) for p in unit.pieces(_entry(2, 6))] == [(0, 2, 3), (1, 0, 3), (2, 0, 2)]
    assert [tuple(p) for p in unit.pieces(_entry(9, 1))] == [(3, 0, 1)]
    # 4 elements on 4 ranks... and on 3: chunks of 2, 2 and nothing for rank 2.
    small = FlatParamUnit(prefix="", dtype=torch.float32, params=(), numel=4, world_size=3)
    assert small.state_dict_key == "_flat_param"
    assert [small.local_numel(r) for r in range(3)] == [2, 2, 0]


def test_non_contiguous_parameters_unflatten_in_memory_order() -> None:
    weight = torch.arange(24.0).reshape(2, 3, 4).permute(0, 2, 1)  # (2, 4, 3), not contiguous
    flat = weight.as_strided((24,), (1,))  # FSDP1 flattens it in memory order
    entry = FlatParamEntry(
        fqn="w", aliases=(), shape=tuple(weight.shape), stride=weight.stride(), offset=0, numel=24
    )
    assert not entry.contiguous
    assert entry.unflatten(flat.clone()).equal(weight)


def test_a_unit_of_several_dtypes_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"unit \(root\): its parameters have several dtypes"):
        flat_param_layout(model, world_size=2)
