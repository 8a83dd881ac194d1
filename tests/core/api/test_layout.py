"""The read-only layout view: pure arithmetic in one process, and the live view on real ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from harness.pool import run_on_ranks
from shardkit.core.layout import ALIGN_BYTES, ParamSpec, group_layout, pooled_sizes
from shardkit.core.torch_release import REDUCES_IN_PARAM_DTYPE
from tests.core import models
from tests.core.parity import Run, apply


def test_uneven_shards_are_padded_and_slots_aligned() -> None:
    specs = [
        ParamSpec(fqn="w", shape=(5, 3), dtype=torch.float32),  # 3 rows per shard at W=2
        ParamSpec(fqn="b", shape=(5,), dtype=torch.float32),
    ]
    layout = group_layout(specs, shard_world=2)
    w, b = layout.params
    assert (w.chunk, w.shard_numel, w.padded_shard_shape) == (3, 9, torch.Size([3, 3]))
    assert [w.local_length(r) for r in (0, 1)] == [3, 2]
    assert [b.local_numel(r) for r in (0, 1)] == [3, 2]
    assert w.storage_offset == 0
    assert b.storage_offset == 48  # 36 bytes of w, rounded up to 16
    assert layout.sharded_bytes == 64 and layout.sharded_bytes % ALIGN_BYTES == 0
    assert layout.unsharded.numels == (18, 6)
    assert layout.reduce_scatter_output_numel == 12
    assert layout.reduce_scatter_input_bytes == 2 * 12 * 4
    assert layout.all_gather_receive_bytes(exchange=True) == 64
    assert layout.all_gather_receive_bytes(exchange=False) == 128
    # What the backend's all-gather will request, and nothing else: no staging in fp32.
    assert layout.pool_sizes(exchange=True) == {64}
    assert layout.pool_sizes(exchange=False) == {128}
    assert layout.pool_sizes(exchange=True, offload=True) == {64}  # staging: (1 row) == 64


def test_pool_sizes_add_the_staging_copy_only_when_it_is_borrowed() -> None:
    specs = [ParamSpec(fqn="w", shape=(8, 8), dtype=torch.float32)]
    bf16 = group_layout(specs, shard_world=4, param_dtype=torch.bfloat16)
    row = bf16.all_gather_input_bytes  # 2 rows of 8 bf16
    assert row == 32 and bf16.stages_gather_input()
    assert bf16.pool_sizes(exchange=True) == {3 * row, row}
    # A native all-gather stages into this rank's row of its receive buffer (in place).
    assert not bf16.stages_gather_input(exchange=False)
    assert bf16.pool_sizes(exchange=False) == {4 * row}
    # One shard rank: nothing is received, and a cast goes straight into the full parameter.
    one = group_layout(specs, shard_world=1, param_dtype=torch.bfloat16)
    assert not one.stages_gather_input() and one.pool_sizes(exchange=True) == frozenset()
    assert group_layout(specs, shard_world=1).pool_sizes(exchange=False) == frozenset()


def test_pool_sizes_of_the_post_forward_subgroup_follow_the_backend() -> None:
    specs = [ParamSpec(fqn="w", shape=(8, 8), dtype=torch.float32)]
    layout = group_layout(specs, shard_world=4, post_forward_world=2)
    assert layout.post_forward is not None
    slices = layout.post_forward.nbytes  # 4 rows of 8 fp32: 128
    assert slices == 128
    row = layout.all_gather_input_bytes
    assert layout.pool_sizes(exchange=True) == {3 * row, slices}
    assert layout.pool_sizes(exchange=False) == {4 * row, 2 * slices}


def test_mixed_precision_casts_floats_only_and_picks_the_reduce_dtype() -> None:
    specs = [
        ParamSpec(fqn="w", shape=(4, 4), dtype=torch.float32),
        ParamSpec(fqn="steps", shape=(4,), dtype=torch.int64, requires_grad=False),
    ]
    layout = group_layout(specs, shard_world=4, param_dtype=torch.bfloat16)
    assert [p.comm_dtype for p in layout.params] == [torch.bfloat16, torch.int64]
    # The trainable parameters' gather dtype; their own from torch 2.15 on (torch's rule).
    expected = torch.float32 if REDUCES_IN_PARAM_DTYPE else torch.bfloat16
    assert layout.reduce_dtype == expected
    # 4 bf16 (8 bytes, next slot at 16) + 1 int64 (8 bytes): 24, rounded up to 32.
    assert layout.all_gather_input_bytes == 32
    fp32 = group_layout(
        specs, shard_world=4, param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    assert fp32.reduce_dtype == torch.float32


def test_trainable_parameters_of_two_dtypes_need_a_reduce_dtype() -> None:
    specs = [
        ParamSpec(fqn="a", shape=(4,), dtype=torch.float32),
        ParamSpec(fqn="b", shape=(4,), dtype=torch.float64),
    ]
    with pytest.raises(ValueError, match=r"a: torch.float32, b: torch.float64"):
        group_layout(specs, shard_world=2)
    assert group_layout(specs, shard_world=2, reduce_dtype=torch.float32).reduce_dtype == (
        torch.float32
    )


def test_unsharded_buffer_holds_the_copy_out_of_either_world() -> None:
    # reshard_after_forward=n gathers n shards in backward, padded differently from W shards.
    for size in range(1, 14):
        for world, n in ((4, 2), (6, 3), (6, 2), (8, 4)):
            spec = [ParamSpec(fqn="w", shape=(size, 3), dtype=torch.float32)]
            layout = group_layout(spec, shard_world=world, post_forward_world=n)
            (numel,) = layout.unsharded.numels
            assert numel >= world * layout.params[0].shard_numel
            assert numel >= n * -(-size // n) * 3


def test_pooled_sizes_are_those_of_two_groups_or_more() -> None:
    block = [ParamSpec(fqn="w", shape=(8, 8), dtype=torch.float32)]
    root = [ParamSpec(fqn="w", shape=(16, 8), dtype=torch.float32)]
    blocks = [group_layout(block, shard_world=2) for _ in range(3)]
    for exchange in (True, False):
        kept = pooled_sizes([*blocks, group_layout(root, shard_world=2)], exchange=exchange)
        assert kept == blocks[0].pool_sizes(exchange=exchange)


def _live_view_body(rank: int, world_size: int) -> dict[str, Any]:
    from shardkit.core.layout import layout_of

    torch.manual_seed(0)
    model = models.MLPNet()
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (world_size,))
    apply("shardkit", model, mesh, Run(model="mlp"))
    views = layout_of(model)
    keys_seen: list[str] = []
    for view in views:
        assert view.mesh is mesh and view.shard_rank == rank
        for param_view in view.params:
            keys_seen += param_view.keys
            full = reference[param_view.keys[0]]
            expected = distribute_tensor(full, mesh, [Shard(0)]).to_local()
            local = param_view.local_shard()
            assert torch.equal(local, expected), param_view.keys
            assert local.shape == param_view.layout.local_shape(rank)
            assert param_view.param is dict(model.named_parameters())[param_view.keys[0]]
            assert isinstance(param_view.param, DTensor)
    # The blocks' views are also found from a block: keys relative to it.
    block_views = layout_of(model.blocks[0])
    return {
        "fqns": [v.fqn for v in views],
        "keys": sorted(keys_seen),
        "state_dict_keys": sorted(k for k, _ in model.named_parameters()),
        "block": [(v.fqn, [p.keys for p in v.params]) for v in block_views],
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_live_view_matches_the_model_and_torch_sharding(world_size: int) -> None:
    results = run_on_ranks(world_size, _live_view_body)
    first = results[0]
    assert first["fqns"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert first["keys"] == first["state_dict_keys"]
    assert first["block"] == [
        ("<root>", [("norm.weight",), ("norm.bias",), ("fc1.weight",), ("fc1.bias",),
                    ("fc2.weight",), ("fc2.bias",)]),
    ]  # fmt: skip


def test_layout_of_an_unsharded_module_names_it() -> None:
    from shardkit.core.layout import layout_of

    with pytest.raises(TypeError, match="Linear: no module in its tree is sharded"):
        layout_of(nn.Linear(2, 2))
