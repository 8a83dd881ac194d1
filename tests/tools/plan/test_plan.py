"""The planner: exact bytes from shapes, the engine's schedule, memory, errors (one process)."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from torch import nn

from shardkit.core.layout import ParamSpec, group_layout
from shardkit.core.torch_release import REDUCES_IN_PARAM_DTYPE
from shardkit.tools import theory
from shardkit.tools.plan.examples import llama_8b, llama_tiny, llama_tiny_inputs
from shardkit.tools.plan.options import PlanOptions
from shardkit.tools.plan.plan_record import Plan
from shardkit.tools.plan.planner import plan
from shardkit.tools.records import Category, Phase
from tests.core.quant_support import QuantTensor


class Block(nn.Module):
    """Rows 6 and 5: uneven at W=4 (chunks of 2), so padding and alignment both show."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        self.fc2 = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.fc2(torch.relu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 5)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return cast(torch.Tensor, self.head(h))


def meta_net() -> Net:
    with torch.device("meta"):
        return Net()


# Hand-computed at W=4 (chunk = ceil(rows / 4); slots 16-byte aligned, total rounded up):
# block: fc1.w 2x5=10, fc1.b 2, fc2.w 2x6=12, fc2.b 2 elements per padded shard.
#   fp32 slots at 0, 48, 64, 112 -> 128 bytes; the bf16 all-gather input keeps their element
#   offsets (0, 12, 16, 28: the cast is one copy) -> bytes 0, 24, 32, 56 -> 64 bytes.
#   unsharded fp32: 4x(10, 2, 12, 2) elements = 160 + 32 + 192 + 32 -> 416 bytes.
#   reduce output: 26 elements (no alignment) = 104 bytes in fp32.
# root: inp.w 2x3=6, inp.b 2, head.w 1x5=5, head.b 1 -> fp32 slots 0, 32, 48, 80 -> 96 bytes;
#   unsharded 4x(6, 2, 5, 1) fp32 = 96 + 32 + 80 + 16 -> 224 bytes; reduce output 14 x 4 = 56.
BLOCK_SHARD, BLOCK_SHARD_BF16, BLOCK_FULL, BLOCK_REDUCE = 128, 64, 416, 104
ROOT_SHARD, ROOT_FULL, ROOT_REDUCE = 96, 224, 56


def test_the_core_layout_gives_the_hand_computed_sizes() -> None:
    """The planner asks shardkit.core.layout; its sizes are the hand-computed ones above."""
    shapes = {"fc1.weight": (6, 5), "fc1.bias": (6,), "fc2.weight": (5, 6), "fc2.bias": (5,)}
    specs = [ParamSpec(fqn=n, shape=s, dtype=torch.float32) for n, s in shapes.items()]
    fp32 = group_layout(specs, shard_world=4)
    assert (fp32.sharded_bytes, fp32.unsharded_bytes) == (BLOCK_SHARD, BLOCK_FULL)
    assert [p.storage_offset for p in fp32.params] == [0, 48, 64, 112]
    assert fp32.reduce_scatter_output_bytes == BLOCK_REDUCE
    bf16 = group_layout(specs, shard_world=4, param_dtype=torch.bfloat16)
    assert bf16.all_gather_input_bytes == BLOCK_SHARD_BF16
    assert [p.comm_offset for p in bf16.params] == [0, 24, 32, 56]
    one = group_layout([ParamSpec(fqn="w", shape=(1,), dtype=torch.float32)], shard_world=1)
    assert one.sharded_bytes == 16  # a 4-byte parameter still fills an aligned slot
    # One shard rank: the unsharded parameters view the shards, unless cast.
    assert one.unsharded_views_storage and not fp32.unsharded_views_storage
    cast = group_layout(specs, shard_world=1, param_dtype=torch.bfloat16)
    assert not cast.unsharded_views_storage


def test_groups_have_the_engines_padded_sizes() -> None:
    result = plan(meta_net, world_size=4)
    assert [g.fqn for g in result.groups] == ["blocks.0", "blocks.1", "<root>"]
    block, root = result.groups[0], result.groups[2]
    assert (block.param_count, block.sharded_bytes, block.unsharded_bytes) == (71, 128, 416)
    assert (block.gather_input_bytes, block.reduce_output_bytes) == (128, BLOCK_REDUCE)
    assert (root.param_count, root.sharded_bytes, root.unsharded_bytes) == (32, 96, ROOT_FULL)
    assert root.reduce_output_bytes == ROOT_REDUCE
    assert (block.reshard_after_forward, root.reshard_after_forward) == (True, False)
    assert result.param_count == result.trainable_count == 2 * 71 + 32


def _calls(result: Plan) -> list[tuple[str, str, int, int]]:
    return [(c.kind, c.group, c.input_bytes, c.sent_bytes) for c in result.schedule]


def test_schedule_is_the_engines_in_order() -> None:
    ag, rs = "all_gather", "reduce_scatter"
    root_ag = (ag, "<root>", ROOT_SHARD, 3 * ROOT_SHARD)
    b0_ag = (ag, "blocks.0", BLOCK_SHARD, 3 * BLOCK_SHARD)
    b1_ag = (ag, "blocks.1", BLOCK_SHARD, 3 * BLOCK_SHARD)
    b0_rs = (rs, "blocks.0", 4 * BLOCK_REDUCE, 3 * BLOCK_REDUCE)
    b1_rs = (rs, "blocks.1", 4 * BLOCK_REDUCE, 3 * BLOCK_REDUCE)
    root_rs = (rs, "<root>", 4 * ROOT_REDUCE, 3 * ROOT_REDUCE)
    # Default: the root keeps its parameters for backward; blocks gather again, in reverse.
    default = plan(meta_net, world_size=4)
    assert _calls(default) == [root_ag, b0_ag, b1_ag, b1_ag, b0_ag, b1_rs, b0_rs, root_rs]
    assert {c.group_size for c in default.schedule} == {4}
    assert [c.phase for c in default.schedule] == [Phase.FORWARD] * 3 + [Phase.BACKWARD] * 5
    gathers = 3 * ROOT_SHARD + 4 * 3 * BLOCK_SHARD
    assert default.sent_bytes_per_step == gathers + 2 * 3 * BLOCK_REDUCE + 3 * ROOT_REDUCE == 2616
    # Explicit True: the root too gathers again at the start of backward.
    always = plan(meta_net, world_size=4, options=PlanOptions(reshard_after_forward=True))
    assert _calls(always) == [root_ag, b0_ag, b1_ag, root_ag, b1_ag, b0_ag, b1_rs, b0_rs, root_rs]
    # False: one gather per group per step.
    never = plan(meta_net, world_size=4, options=PlanOptions(reshard_after_forward=False))
    assert _calls(never) == [root_ag, b0_ag, b1_ag, b1_rs, b0_rs, root_rs]


def test_collectives_sum_the_schedule_per_group() -> None:
    result = plan(meta_net, world_size=4)
    calls = {(c.kind, c.group): c.calls for c in result.collectives}
    assert calls == {
        ("all_gather", "<root>"): 1,
        ("all_gather", "blocks.0"): 2,
        ("all_gather", "blocks.1"): 2,
        ("reduce_scatter", "blocks.1"): 1,
        ("reduce_scatter", "blocks.0"): 1,
        ("reduce_scatter", "<root>"): 1,
    }
    assert sum(c.sent_bytes_per_step for c in result.collectives) == result.sent_bytes_per_step
    assert result.comm_seconds == pytest.approx(result.sent_bytes_per_step / 100e9)


def test_mixed_precision_gathers_bf16_and_reduces_in_the_reduce_dtype() -> None:
    options = PlanOptions(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    result = plan(meta_net, world_size=4, options=options)
    block = result.groups[0]
    assert block.sharded_bytes == BLOCK_SHARD  # the sharded parameters keep fp32
    assert block.gather_input_bytes == BLOCK_SHARD_BF16
    assert block.reduce_output_bytes == BLOCK_REDUCE
    bf16 = plan(meta_net, world_size=4, options=PlanOptions(param_dtype=torch.bfloat16))
    # The reduce dtype follows param_dtype, or the parameters' own dtype from torch 2.15 on.
    halved = 1 if REDUCES_IN_PARAM_DTYPE else 2
    assert bf16.groups[0].reduce_output_bytes == BLOCK_REDUCE // halved


def test_one_rank_has_no_collective() -> None:
    result = plan(meta_net, world_size=1)
    assert result.schedule == () and result.sent_bytes_per_step == 0
    assert result.theory_sent_bytes == 0 and result.sent_over_theory is None


def test_hsdp_all_reduces_the_reduced_shard_across_replicas() -> None:
    result = plan(meta_net, world_size=8, options=PlanOptions(mesh_shape=(2, 4)))
    assert result.shard_size == 4 and result.replicas == 2
    all_reduces = [c for c in result.schedule if c.kind == "all_reduce"]
    assert [(c.group, c.group_size) for c in all_reduces] == [
        ("blocks.1", 2),
        ("blocks.0", 2),
        ("<root>", 2),
    ]
    # A ring all-reduce of n bytes over R ranks sends 2n(R-1)/R.
    assert all_reduces[0].input_bytes == BLOCK_REDUCE
    assert all_reduces[0].sent_bytes == BLOCK_REDUCE
    # Shards (and so the gathers) are those of W=4.
    assert plan(meta_net, world_size=4).groups == result.groups


def test_frozen_parameters_are_gathered_but_not_reduced() -> None:
    model = meta_net()
    for param in model.blocks[0].parameters():
        param.requires_grad_(False)
    result = plan(model, world_size=4)
    kinds = {(c.kind, c.group) for c in result.schedule}
    assert ("all_gather", "blocks.0") in kinds and ("reduce_scatter", "blocks.0") not in kinds
    assert result.groups[0].reduce_output_bytes == 0
    assert result.trainable_count == 71 + 32


def test_resident_memory_is_exact() -> None:
    # Sharded fp32 buffers, and AdamW: two states of each rank's unpadded local shard plus a
    # 4-byte step per parameter (12 parameters).
    local = {0: 66, 1: 66, 2: 42, 3: 0}  # elements of each rank's unpadded shards
    for rank, elements in local.items():
        result = plan(meta_net, world_size=4, options=PlanOptions(rank=rank))
        maxima = result.memory.category_max
        assert maxima[Category.SHARDED_PARAMS] == ROOT_SHARD + 2 * BLOCK_SHARD
        assert maxima[Category.OPTIMIZER_STATE] == 2 * 4 * elements + 4 * 12
    sgd = plan(meta_net, world_size=4, options=PlanOptions(optimizer="sgd"))
    assert sgd.memory.category_max[Category.OPTIMIZER_STATE] == 0
    momentum = plan(meta_net, world_size=4, options=PlanOptions(optimizer="sgd_momentum"))
    assert momentum.memory.category_max[Category.OPTIMIZER_STATE] == 4 * 66


def test_transient_memory_follows_the_engine() -> None:
    result = plan(meta_net, world_size=4, options=PlanOptions(backend="gloo"))
    maxima = result.memory.category_max
    # The root stays gathered; one block is gathered beside it (the next one is in flight).
    assert maxima[Category.UNSHARDED_PARAMS] == ROOT_FULL + BLOCK_FULL
    # One reduction in flight at a time (the engine frees a finished one's buffers before the
    # next allocates): its gloo send buffer (W rows) and received rows (W-1), beside the rows
    # received by block 0's prefetched gather (W-1).
    assert maxima[Category.COMM_BUFFERS] == 4 * BLOCK_REDUCE + 3 * BLOCK_REDUCE + 3 * BLOCK_SHARD
    # Without inputs, activations are not counted.
    assert maxima[Category.ACTIVATIONS] == 0 and not result.activations_traced
    # NCCL: no received rows; the peak is block 1's send buffer beside block 0's prefetched
    # gather (received into W rows).
    nccl = plan(meta_net, world_size=4)
    assert nccl.memory.category_max[Category.COMM_BUFFERS] == 4 * BLOCK_REDUCE + 4 * BLOCK_SHARD
    peak = result.memory.peak
    assert peak.total == max(p.total for p in result.memory.timeline)
    assert peak.phase is Phase.BACKWARD


class Saver(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def test_activations_are_saved_tensors_without_parameters() -> None:
    with torch.device("meta"):
        model = Saver()

    def inputs() -> torch.Tensor:
        return torch.empty(3, 4, device="meta")

    result = plan(model, world_size=2, options=PlanOptions(inputs=inputs))
    # Linear saves its input (3x4) for the weight's gradient, relu its output (3x8), which is
    # also the model's output; the weight (a parameter) is not an activation.
    assert result.activations_traced
    assert result.memory.category_max[Category.ACTIVATIONS] == 4 * (3 * 4 + 3 * 8)
    # With param_dtype the engine casts the input at the module: saved in bf16.
    half = PlanOptions(inputs=inputs, param_dtype=torch.bfloat16)
    assert plan(model, world_size=2, options=half).memory.category_max[
        Category.ACTIVATIONS
    ] == 2 * (3 * 4 + 3 * 8)


def test_backward_counts_activation_gradients_and_the_loss_apart() -> None:
    with torch.device("meta"):
        model = Saver()

    def inputs() -> torch.Tensor:
        return torch.empty(3, 4, device="meta")

    result = plan(model, world_size=2, options=PlanOptions(inputs=inputs))
    # Backward of the unit loss: its seed (a 4-byte scalar), the output's gradient (3x8) and
    # relu's input gradient (3x8) live together; the weight's gradient is counted apart.
    assert result.memory.category_max[Category.OTHER] == 4 + 2 * 4 * 3 * 8

    def cross_entropy(out: torch.Tensor) -> torch.Tensor:
        target = torch.empty(3, dtype=torch.long, device="meta")
        return nn.functional.cross_entropy(out, target)

    with_loss = plan(model, world_size=2, options=PlanOptions(inputs=inputs, loss=cross_entropy))
    # The loss saves log_softmax's (3x8) output, the (3,) int64 target and nll_loss's total
    # weight (a float32 scalar): after forward, so not activations of the model.
    assert with_loss.memory.category_max[Category.ACTIVATIONS] == 4 * (3 * 4 + 3 * 8)
    loss_points = [p for p in with_loss.memory.timeline if p.label == "loss"]
    assert [p.by_category[Category.OTHER] for p in loss_points] == [4 * 3 * 8 + 8 * 3 + 4]


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 4).transpose(1, 3).unbind(2)  # (B, H, T, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_attention_is_counted_as_a_fused_kernel_saves_it() -> None:
    with torch.device("meta"):
        model = Attention()
    options = PlanOptions(inputs=lambda: torch.empty(2, 64, 8, device="meta"))
    result = plan(model, world_size=2, options=options)
    # x (2x64x8), the qkv projection (2x64x24; q, k and v view it), the output (2x2x64x4)
    # and a float32 log-sum-exp per query row (2x2x64) -- not the 2x2x64x64 scores.
    saved = 4 * (2 * 64 * 8 + 2 * 64 * 24 + 2 * 2 * 64 * 4 + 2 * 2 * 64)
    assert result.memory.category_max[Category.ACTIVATIONS] == saved


def test_traced_order_and_activations_of_a_llama() -> None:
    options = PlanOptions(inputs=llama_tiny_inputs, param_dtype=torch.bfloat16)
    traced = plan(llama_tiny, world_size=2, options=options)
    untraced = plan(llama_tiny, world_size=2, options=PlanOptions(param_dtype=torch.bfloat16))
    # The traced forward runs the groups in the order registration assumes.
    assert _calls(traced) == _calls(untraced)
    assert traced.memory.category_max[Category.ACTIVATIONS] > 0
    assert traced.memory.peak.total > untraced.memory.peak.total


def test_a_llama_8b_on_64_ranks() -> None:
    result = plan(llama_8b, world_size=64)
    assert result.param_count == 8_030_261_248
    sharded = sum(g.sharded_bytes for g in result.groups)
    assert sharded == pytest.approx(4 * 8.03e9 / 64, rel=0.01)
    assert len(result.groups) == 33
    assert result.sent_over_theory == pytest.approx(1.0, abs=1e-3)
    bf16 = PlanOptions(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mixed = plan(llama_8b, world_size=64, options=bf16)
    # 2 bytes gathered, 4 reduced: (2*2 + 4) * 8.03e9 * 63/64 less the root's second gather.
    assert mixed.sent_bytes_per_step == pytest.approx(8 * 8.03e9 * 63 / 64, rel=0.05)


def test_theory_formulas() -> None:
    assert theory.all_gather_bytes(1000, 4, 2) == 1500
    assert theory.reduce_scatter_bytes(1000, 4, 4) == 3000
    assert theory.all_reduce_bytes(1000, 4, 4) == 6000
    assert theory.fsdp_step_bytes(1000, 4, param_bytes=2, grad_bytes=4) == 6000
    zero2 = theory.fsdp_step_bytes(
        1000, 4, param_bytes=2, grad_bytes=4, reshard_after_forward=False
    )
    assert zero2 == 4500
    assert theory.fsdp_step_bytes(1000, 4, param_bytes=2, grad_bytes=4, replicas=2) == 6000 + 1000
    psi, w = 7_500_000_000, 64  # ZeRO's example: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    gb = [theory.zero_memory_per_rank(psi, w, stage=s) / 1e9 for s in range(4)]
    assert gb == pytest.approx([120, 31.41, 16.64, 1.875], abs=0.01)
    fsdp2 = theory.zero_memory_per_rank(
        64, 4, stage=3, param_bytes=4, grad_bytes=4, optimizer_bytes=8
    )
    assert fsdp2 == 16 * 64 // 4
    assert theory.comm_seconds(10**9, 100) == pytest.approx(0.01)


def test_theory_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="world_size"):
        theory.all_gather_bytes(10, 0, 2)
    with pytest.raises(TypeError, match="num_params"):
        theory.all_gather_bytes(1.5, 2, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stage"):
        theory.zero_memory_per_rank(10, 2, stage=4)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        theory.comm_seconds(10, 0)


def test_wrap_by_class_name_or_predicate() -> None:
    by_name = plan(meta_net, world_size=2, options=PlanOptions(wrap={"Linear"}))
    assert [g.fqn for g in by_name.groups] == [
        "inp",
        "blocks.0.fc1",
        "blocks.0.fc2",
        "blocks.1.fc1",
        "blocks.1.fc2",
        "head",
    ]  # the root has no parameters left: no group
    only_first = PlanOptions(wrap=lambda name, module: name == "blocks.0")
    assert [g.fqn for g in plan(meta_net, world_size=2, options=only_first).groups] == [
        "blocks.0",
        "<root>",
    ]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.blocks[1].weight = self.blocks[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.blocks[1](self.blocks[0](x)))


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match=r"fc1\.weight is on cpu"):
        plan(Net(), world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        plan(meta_net, world_size=0)
    with pytest.raises(ValueError, match="mesh_shape"):
        plan(meta_net, world_size=4, options=PlanOptions(mesh_shape=(2, 3)))
    with pytest.raises(ValueError, match="rank 4"):
        plan(meta_net, world_size=4, options=PlanOptions(rank=4))
    with pytest.raises(TypeError, match="returned int"):
        plan(lambda: 3, world_size=2)  # type: ignore[arg-type, return-value]
    with torch.device("meta"):
        tied = Tied()
    with pytest.raises(ValueError, match=r"blocks\.0\.weight is shared by the groups"):
        plan(tied, world_size=2)
    with torch.device("meta"):
        scalar = nn.Module()
        scalar.register_parameter("s", nn.Parameter(torch.tensor(1.0)))
    with pytest.raises(ValueError, match="0-dim"):
        plan(scalar, world_size=2)


def test_parameters_with_all_gather_hooks_are_not_modelled() -> None:
    # What they send and hold unsharded is what their hooks return, known only at run time.
    model = meta_net()
    model.head.weight = nn.Parameter(QuantTensor(torch.empty(2, 5, device="meta")))
    with pytest.raises(ValueError, match=r"head\.weight \(QuantTensor\) is gathered through"):
        plan(model, world_size=2)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="optimizer"):
        PlanOptions(optimizer="lamb")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="param_dtype"):
        PlanOptions(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="reshard_after_forward"):
        PlanOptions(reshard_after_forward=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        PlanOptions(bandwidth_gbps=0)
    with pytest.raises(ValueError, match="backend"):
        PlanOptions(backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mesh_shape"):
        PlanOptions(mesh_shape=(0, 2))


def test_mixed_dtypes_in_a_group_need_a_reduce_dtype() -> None:
    with torch.device("meta"):
        model = Net()
    model.head.half()
    with pytest.raises(ValueError, match=r"group <root>: fully_shard needs one dtype"):
        plan(model, world_size=2)
    result = plan(model, world_size=2, options=PlanOptions(reduce_dtype=torch.float32))
    assert result.groups[-1].reduce_output_bytes > 0


def test_a_failing_meta_forward_names_the_model() -> None:
    options = PlanOptions(inputs=lambda: torch.empty(3, 7, device="meta"))  # wrong width
    with pytest.raises(RuntimeError, match="forward failed on the meta device"):
        plan(meta_net, world_size=2, options=options)


def test_to_dict_is_plain_json() -> None:
    import json

    data = plan(meta_net, world_size=4).to_dict()
    again = json.loads(json.dumps(data))
    assert again["sent_bytes_per_step"] == data["sent_bytes_per_step"]
    assert again["memory"]["peak"]["by_category"]["sharded_params"] == 2 * BLOCK_SHARD + 96
    assert again["groups"][0]["fqn"] == "blocks.0"


def test_a_loss_with_two_required_parameters_is_given_the_model() -> None:
    from shardkit.tools.plan.options import loss_takes_model

    def with_model(output: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return output.sum()

    def with_default(output: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return scale * output.sum()

    assert loss_takes_model(with_model)
    assert not loss_takes_model(lambda output: output.sum())
    assert not loss_takes_model(with_default)
    assert not loss_takes_model(torch.sum)  # a builtin: the output alone, whatever it shows


def test_backward_places_each_gradient_before_or_after_its_segments_peak() -> None:
    # One segment, as backward_profile logs it: a saved activation (100 bytes), then in
    # backward a scratch tensor (10), the gradient of w1 (50), the activation freed, the
    # gradient of w2 (50), the scratch freed. The highest total, 160, comes once w1's
    # gradient exists and before w2's: w1's belongs at the peak, w2's after it.
    from types import SimpleNamespace

    from shardkit.tools.plan.backward import BackwardSegment, _replay

    act, scratch, g1, g2 = range(4)
    log = [(act, 0), (scratch, 0), (g1, 0), (act, 0), (g2, 0), (scratch, 0)]
    mode = SimpleNamespace(log=log, kind=[0, 1, 1, 1], nbytes=[100, 10, 50, 50])
    profile = _replay(mode, {g1: "w1", g2: "w2"}, 1)  # type: ignore[arg-type]  # the log only
    assert profile == (BackwardSegment(100, 10, 0, 0, frozenset({"w1"})),)
