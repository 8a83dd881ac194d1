"""Tensor-subclass parameters gathered through fsdp_pre_all_gather / fsdp_post_all_gather."""

from __future__ import annotations

import torch

from shardkit.core.layout import HookInput, ParamSpec, group_layout


def test_layout_plans_hook_inputs_once_known() -> None:
    hooked = ParamSpec(fqn="w", shape=(6, 4), dtype=torch.float32, all_gather_hooks=True)
    bias = ParamSpec(fqn="b", shape=(6,), dtype=torch.float32)
    before = group_layout([hooked, bias], shard_world=2)
    assert before.hooks_pending == ("w",)
    assert before.storage.numels == (0, 3)  # the subclass keeps its own storage
    inputs = (HookInput(12, torch.int8), HookInput(3, torch.float32))
    after = group_layout(
        [
            ParamSpec(
                fqn="w",
                shape=(6, 4),
                dtype=torch.float32,
                all_gather_hooks=True,
                all_gather_inputs=inputs,
            ),
            bias,
        ],
        shard_world=2,
    )
    assert after.hooks_pending == ()
    w = after.params[0]
    assert w.all_gather_inputs is not None and w.all_gather_inputs.offsets == (0, 16)
    # w: 12 int8 bytes, then 3 fp32 scales at 16 -> a 32-byte slot; b: 3 fp32 at 32.
    assert after.all_gather_input_bytes == 48
    assert after.unsharded.numels == (0, 6)  # the hook's outputs are the parameter's own
    assert after.reduce_scatter_output_numel == 12 + 3  # gradients are plain, as before
