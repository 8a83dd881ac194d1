"""DTensorExtensions: FSDP1's hooks for 2D (FSDP x TP) models, against torch's own.

Each method runs by torch's ``DTensorExtensions`` and by ours on the same inputs (plain
tensors with 3 and 5 rows, every parameter of the TP test models), at world size 4 on a
(dp=2, tp=2) mesh: the results must have the same type, mesh, placements, shard metadata and
local values, and each round trip must give back its input exactly. Where torch's fail (see
tests/tp/tp_extensions.py), ours are checked alone.
"""

from __future__ import annotations

from typing import Any

from harness.compare import assert_all_equal
from harness.pool import run_on_ranks
from tests.tp.tp_extensions import (
    chunk_dtensor_body,
    chunk_tensor_body,
    flatten_body,
    gather_sharded_params_body,
    misuse_body,
    round_trip_body,
)

WORLD = 4


def assert_same(expected: object, actual: object, what: str) -> None:
    """``actual`` equals ``expected`` exactly (tensors: dtype, shape and every value)."""
    __tracebackhide__ = True
    try:
        assert_all_equal([expected, actual])
    except AssertionError as error:
        message = str(error).replace("rank 1 differs from rank 0", "differs")
        raise AssertionError(f"{what}: {message}") from None


def test_flatten_then_unflatten_matches_torch_and_rebuilds_the_input() -> None:
    results = run_on_ranks(WORLD, flatten_body)
    for rank, by_input in enumerate(results):
        kinds = {result["shardkit"]["metadata"] for result in by_input.values()}
        assert kinds == {True, False}, "both DTensors and plain tensors are among the inputs"
        for name, result in by_input.items():
            where = f"rank {rank}, {name}"
            ours = result["shardkit"]
            assert_same(result["torch"], ours, f"{where}: shardkit vs torch")
            if not ours["metadata"]:
                assert ours["same object"], where
                continue
            assert ours["shares storage"] and ours["no copy"], where
            assert_same(result["input"], ours["rebuilt"], f"{where}: rebuilt vs input")
            assert ours["grad type"] == "Tensor", f"{where}: a collective's gradient not waited"


def _outer_layout(chunked: dict[str, Any], shift: int) -> tuple[list[Any], list[Any], list[int]]:
    """A nested ShardedTensor's outer shards, local boxes and group, global ranks + ``shift``."""

    def moved(box: tuple[list[int], list[int], str]) -> tuple[list[int], list[int], str]:
        offsets, sizes, placement = box
        rank, device = placement.removeprefix("rank:").split("/", 1)
        return offsets, sizes, f"rank:{int(rank) + shift}/{device}"

    return (
        [moved(box) for box in chunked["shards"]],
        [moved(box) for box, _ in chunked["local"]],
        [rank + shift for rank in chunked["group"]],
    )


def test_chunk_tensor_matches_torch_and_loads_back() -> None:
    results = run_on_ranks(WORLD, chunk_tensor_body, uneven=False)
    for rank, by_input in enumerate(results):
        for name, result in by_input.items():
            where = f"rank {rank}, {name}"
            ours, theirs = result["shardkit"], result["torch"]
            assert "error" not in ours, f"{where}: {ours}"
            assert_same(result["expected"], result["restored"], f"{where}: loaded back")
            if "error" not in theirs:
                assert_same(theirs, ours, f"{where}: shardkit vs torch")
                continue
            # torch names a TP part's holders by their rank in the TP group, which
            # ShardedTensor reads as global ranks: only the TP group of ranks 0 and 1 works.
            # Ours there lays the part out as torch does on the rank two below, renamed.
            assert rank >= 2 and "part box" in result, f"{where}: torch failed: {theirs}"
            assert "does not exist in input process group" in theirs["message"], where
            paired = results[rank - 2][name]["torch"]["chunked"]
            assert_same(
                _outer_layout(paired, shift=2),
                _outer_layout(ours["chunked"], shift=0),
                f"{where}: outer layout vs torch's on rank {rank - 2}",
            )


def test_chunk_tensor_places_unevenly_cut_tp_parts_where_they_lie() -> None:
    # torch's FSDP1 extensions assume every TP part has the size of this rank's: its shard
    # metadata overlaps or falls short, and it raises. Ours names each part's true box.
    results = run_on_ranks(WORLD, chunk_tensor_body, uneven=True)
    for rank, by_input in enumerate(results):
        assert "sp.head.weight" in by_input, "the uneven inputs are there"
        peers = (rank // 2 * 2, rank // 2 * 2 + 1)  # the TP group: ranks with this dp index
        for name, result in by_input.items():
            where = f"rank {rank}, {name}"
            assert result["torch"]["error"] == "ValueError", where
            ours = result["shardkit"]
            assert_same(result["expected"], result["restored"], f"{where}: loaded back")
            [((offsets, sizes, placement), inner)] = ours["chunked"]["local"]
            assert (offsets, sizes) == result["part box"], where
            assert placement == f"rank:{rank}/cpu", where
            assert inner["type"] == "ShardedTensor", where
            parts = sorted(tuple(map(tuple, results[peer][name]["part box"])) for peer in peers)
            boxes = sorted((tuple(o), tuple(s)) for o, s, _ in ours["chunked"]["shards"])
            assert boxes == parts, f"{where}: the outer shards are not the TP parts"


def test_chunk_dtensor_matches_torch_and_gathers_back() -> None:
    results = run_on_ranks(WORLD, chunk_dtensor_body)
    for rank, by_mesh in enumerate(results):
        assert set(by_mesh) == {(2, 2), (2, 1, 2)}
        for shape, by_input in by_mesh.items():
            for name, result in by_input.items():
                where = f"rank {rank}, mesh {shape}, {name}"
                ours = result["shardkit"]
                assert_same(result["torch"], ours, f"{where}: shardkit vs torch")
                assert_same(result["expected"]["value"], ours["gathered"]["value"], where)


def test_full_and_tp_tensors_round_trip_through_the_2d_layout() -> None:
    # Ours alone, unevenly cut TP parts included: a full tensor or a TP DTensor placed onto
    # the (dp..., tp) layout holds the same full tensor; gathering over dp gives the TP part
    # back, and the TP DTensor rebuilt around it the full tensor.
    results = run_on_ranks(WORLD, round_trip_body)
    for rank, by_mesh in enumerate(results):
        for shape, by_input in by_mesh.items():
            assert "sp.head.weight" in by_input and "rows5" in by_input
            for name, result in by_input.items():
                where = f"rank {rank}, mesh {shape}, {name}"
                assert_same(result["full"], result["placed"], f"{where}: placed")
                assert_same(result["part"], result["gathered"], f"{where}: gathered")
                if name.startswith(("mlp.", "sp.")):
                    assert_same(result["full"], result["rebuilt"], f"{where}: rebuilt")


def test_all_gather_dtensor_matches_torch_on_fully_sharded_parameters() -> None:
    results = run_on_ranks(WORLD, gather_sharded_params_body)
    for rank, by_param in enumerate(results):
        assert "mlp.a.weight" in by_param and "sp.head.weight" in by_param
        for name, result in by_param.items():
            where = f"rank {rank}, {name}"
            ours = result["shardkit"]
            assert_same(result["torch"], ours, f"{where}: shardkit vs torch")
            assert_same(result["expected"]["value"], ours["value"], f"{where}: the TP part")


def test_misuse_is_refused() -> None:
    refused = run_on_ranks(WORLD, misuse_body)[0]
    expected = {
        "gather on another mesh": ("ValueError", "must lie on that (root) mesh"),
        "chunk_dtensor on a 1D mesh": ("ValueError", "mesh of 2 or more axes"),
        "chunk_dtensor of a dp DTensor": ("ValueError", "not tensor-parallel on the last axis"),
        "chunk_tensor of a 2D DTensor": ("ValueError", "only tensor-parallel DTensors"),
        "load a plain tensor": ("TypeError", "not Tensor"),
    }
    assert refused.keys() == expected.keys()
    for case, (error, fragment) in expected.items():
        assert refused[case]["error"] == error, f"{case}: {refused[case]}"
        assert fragment in str(refused[case]["message"]), f"{case}: {refused[case]}"
