"""Where gradients are divided, as torch's fully_shard divides them.

The division's place decides the bits of the gradients at a world size that is not a power of
two, the kernels a step launches (none of its own where the collective averages), and what an
all-reduce hook and a custom reduce-scatter are handed. Torch is the oracle for all three:
its own planning function for the plan, and its fully_shard for what runs.
"""

from __future__ import annotations

import itertools
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as torch_collectives

from harness.pool import run_on_ranks
from shardkit.core.engine.reduce.division import plan_division
from shardkit.core.runtime.reduction import AVG, SUM, Reduction

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class _Sized:
    """A process group as torch's planning function reads it: its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _op_key(op: Any) -> tuple[str, float | None]:
    """A torch reduce op as (kind, scale): premul objects compare equal whatever their scale."""
    kind = str(getattr(op, "op", op)).rsplit(".", 1)[-1]
    return kind, getattr(op, "factor", None)


def _torch_plan(
    dtype: torch.dtype, shard: int, replicate: int, factor: float | None, force: bool, device: str
) -> tuple[Any, ...]:
    pre, post, scatter, reduce = torch_collectives._get_gradient_divide_factors(
        cast(Any, _Sized(shard)),
        cast(Any, _Sized(replicate) if replicate > 1 else None),
        dtype,
        device,
        factor,
        force,
    )
    return (pre or 1.0, _op_key(scatter), _op_key(reduce), post or 1.0)


@pytest.mark.parametrize("device", ["cpu", "cuda", "mtia"])
def test_the_plan_is_torchs(device: str) -> None:
    grid = itertools.product(
        DTYPES, [1, 2, 3, 4, 8, 64], [1, 2, 3], [None, 1.0, 2.0, 3.0, 6.0], [False, True]
    )
    checked = 0
    for dtype, shard, replicate, factor, force in grid:
        ours = plan_division(
            dtype, shard, replicate, factor=factor, force_sum=force, device_type=device
        )
        mine = (
            ours.pre,
            _op_key(ours.reduce_scatter.torch_op()),
            _op_key(ours.all_reduce.torch_op()),
            ours.post,
        )
        theirs = _torch_plan(dtype, shard, replicate, factor, force, device)
        where = f"{dtype} shard={shard} replicate={replicate} factor={factor} force={force}"
        assert mine[1:3] == theirs[1:3], where
        assert mine[0] == pytest.approx(theirs[0]) and mine[3] == pytest.approx(theirs[3]), where
        checked += 1
    assert checked == len(DTYPES) * 6 * 3 * 5 * 2


def test_reductions_finish_a_plain_sum_like_the_collective() -> None:
    summed = torch.tensor([6.0, 3.0, -9.0])
    for op, size, expected in [
        (SUM, 3, [6.0, 3.0, -9.0]),
        (AVG, 3, [2.0, 1.0, -3.0]),
        (AVG, 1, [6.0, 3.0, -9.0]),
        (Reduction.scaled_sum(1.5), 3, [4.0, 2.0, -6.0]),
    ]:
        out = summed.clone()
        op.finish_sum(out, size)
        assert out.tolist() == expected, (op, size)
    with pytest.raises(ValueError, match="positive divisor"):
        Reduction.scaled_sum(0.0)


class _RecordingReduceScatter:
    """A custom reduce-scatter (torch's ReduceScatter shape) that records the op it is given."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, float | None]] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
    ) -> None:
        self.ops.append(_op_key(op))
        reduced = input_tensor.clone()
        dist.all_reduce(reduced, op=op, group=group)
        output_tensor.copy_(reduced.view(group.size(), -1)[group.rank()])


def _hooked_body(rank: int, world_size: int, case: str) -> dict[str, Any]:
    """Two steps of each implementation; what each hook saw, the ops, the parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.core.parity import fully_shard_of, torch_policy

    seen: dict[str, Any] = {}
    for impl in ("torch", "shardkit"):
        if impl == "torch":
            from torch.distributed.fsdp import MixedPrecisionPolicy
        else:
            from shardkit.core import MixedPrecisionPolicy  # type: ignore[assignment]
        if case == "hsdp":
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("r", "s"))
        else:
            mesh = init_device_mesh("cpu", (world_size,))
        kwargs: dict[str, Any] = {"mesh": mesh}
        if case in ("bf16", "fp16"):
            dtype = torch.bfloat16 if case == "bf16" else torch.float16
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype)
            if impl == "torch":
                kwargs["mp_policy"] = torch_policy(kwargs["mp_policy"])
        torch.manual_seed(0)
        model: Any = torch.nn.Sequential(
            torch.nn.Linear(12, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5)
        )
        layers: list[Any] = [model[0], model[2]]
        fs = fully_shard_of(impl)
        for layer in layers:
            fs(layer, **kwargs)
        fs(model, **kwargs)
        hooked: list[list[float]] = []
        scatter = _RecordingReduceScatter()
        for layer in layers:
            layer.set_all_reduce_hook(lambda t, hooked=hooked: hooked.append(t.float().tolist()))
            if case == "force_sum":
                layer.set_force_sum_reduction_for_comms(True)
            if case == "force_sum_factor":
                layer.set_force_sum_reduction_for_comms(True)
                layer.set_gradient_divide_factor(2.0)
            if case == "custom":
                layer.set_custom_reduce_scatter(scatter)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            torch.manual_seed(100 + 10 * step + rank)
            model(torch.randn(4, 12)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        params = [cast(Any, p).full_tensor().tolist() for p in model.parameters()]
        seen[impl] = {"hooked": hooked, "ops": scatter.ops, "params": params}
    return seen


@pytest.mark.parametrize(
    ("case", "world_size"),
    [
        ("fp32", 3),
        ("fp32", 4),
        ("bf16", 3),
        ("bf16", 4),
        ("fp16", 3),
        ("fp16", 4),
        ("force_sum", 3),
        ("force_sum_factor", 3),
        ("hsdp", 4),
        ("custom", 3),
    ],
)
def test_hooks_and_custom_collectives_see_what_torchs_see(case: str, world_size: int) -> None:
    # Bit for bit: W=3 (a mean that is not a power-of-two scaling: 1/3 of a sum is not the sum
    # of thirds), W=4 (four rows added in gloo's order, test_ring_order.py) and HSDP.
    for rank, seen in enumerate(run_on_ranks(world_size, _hooked_body, case=case)):
        ours, theirs = seen["shardkit"], seen["torch"]
        assert ours["hooked"] == theirs["hooked"], f"rank {rank}: the hook saw other values"
        assert len(ours["hooked"]) == 4  # two groups, two steps
        assert ours["ops"] == theirs["ops"], f"rank {rank}: the custom reduce-scatter's op"
        assert ours["params"] == theirs["params"], f"rank {rank}: parameters differ"
    if case == "custom":
        assert ours["ops"] == [("AVG", None)] * 4


def _scaled_sum_body(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.core.parity import fully_shard_of

    out: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (world_size,))
    for impl in ("torch", "shardkit"):
        torch.manual_seed(0)
        model: Any = torch.nn.Linear(6, 5)
        fully_shard_of(impl)(model, mesh=mesh)
        model.set_gradient_divide_factor(3.0)  # not the shard group's size: a scaled sum
        torch.manual_seed(1 + rank)
        if impl == "torch":
            try:
                model(torch.randn(3, 6)).sum().backward()
            except RuntimeError as error:
                out[impl] = str(error)
            continue
        model(torch.randn(3, 6)).sum().backward()
        out[impl] = model.weight.grad.full_tensor()
    torch.manual_seed(0)
    local = torch.nn.Linear(6, 5)
    for r in range(world_size):
        torch.manual_seed(1 + r)
        local(torch.randn(3, 6)).sum().backward()
    assert local.weight.grad is not None
    out["local"] = local.weight.grad / 3.0
    return out


def test_a_divide_factor_on_gloo_scales_where_torch_refuses() -> None:
    # gloo has no scaled sum (PREMUL_SUM): torch's reduce-scatter fails there; shardkit
    # divides after the sum, so a job debugged on CPU runs as it will on NCCL.
    out = run_on_ranks(2, _scaled_sum_body)[0]
    assert "PREMUL_SUM" in out["torch"]
    torch.testing.assert_close(out["shardkit"], out["local"], rtol=0, atol=1e-6)
