"""Precision-aware gradient reduction (``set_reduce_precision``): narrow rows, one fp32 sum.

Against shardkit's own float32 reduction of the same step (the default, which the parity
tests hold bit-identical to torch's ``fully_shard``): each mode's gradients within its format's
error; the bytes gloo writes to its sockets for the reductions; stochastic rounding
reproducible from its seed; HSDP replicas left identical; the numerics check; bad input
refused by name before any step.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, cast

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from harness.pool import run_on_ranks
from shardkit.core import set_step_checks
from tests.core import models

MODES: dict[str, dict[str, Any]] = {
    "bf16": {"wire_dtype": torch.bfloat16},
    "bf16-sr": {"wire_dtype": torch.bfloat16, "stochastic_rounding": True, "seed": 3},
    "int8": {"wire_dtype": torch.int8, "block_size": 256},
    "int8-ef": {"wire_dtype": torch.int8, "block_size": 256, "error_feedback": True},
    "fp8": {"wire_dtype": "float8_e4m3fn", "block_size": 256},
}
# Relative error of a whole reduced gradient against float32's: one rounding of each row.
BOUNDS = {"bf16": 1e-2, "bf16-sr": 2e-2, "int8": 3e-2, "int8-ef": 3e-2, "fp8": 1.5e-1}


def _fsdp(module: nn.Module) -> Any:
    """``module`` as the FSDPModule that fully_shard made it (its set_* methods)."""
    from shardkit.core import FSDPModule

    assert isinstance(module, FSDPModule)
    return cast(Any, module)


def _wchar() -> int:
    """Bytes this process has written (gloo's socket writes, during a backward)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def _sharded(mesh_shape: tuple[int, ...], mode: str | None, dim: int = 16, **kw: Any) -> Any:
    from shardkit.core import ReducePrecision, fully_shard

    torch.manual_seed(0)
    model = models.MLPNet(dim=dim)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    if mode is not None:
        _fsdp(model).set_reduce_precision(ReducePrecision(**MODES[mode]))
    return model


def _grads(model: Any, step: int, rank: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(100 + step * 10 + rank)
    x = torch.randn(8, 7)
    model(x).pow(2).mean().backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    den = sum(float(b[k].pow(2).sum()) for k in a)
    return float((num / den) ** 0.5)


def _errors(rank: int, world_size: int, mesh_shape: tuple[int, ...]) -> dict[str, float]:
    exact = _grads(_sharded(mesh_shape, None), 0, rank)
    return {mode: _relative(_grads(_sharded(mesh_shape, mode), 0, rank), exact) for mode in MODES}


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["w2", "w4", "hsdp"])
def test_each_mode_is_within_its_formats_error(mesh_shape: tuple[int, ...]) -> None:
    world = 1
    for size in mesh_shape:
        world *= size
    errors = run_on_ranks(world, _errors, mesh_shape=mesh_shape)
    assert all(e == errors[0] for e in errors), "ranks see different gradients"
    for mode, error in errors[0].items():
        assert 0 < error < BOUNDS[mode], (mode, error)


def _replicas_agree(rank: int, world_size: int) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    model = _sharded((2, 2), "int8-ef")
    torch.manual_seed(7 + rank)
    model(torch.randn(8, 7)).pow(2).mean().backward()
    grad = next(iter(model.parameters())).grad
    assert isinstance(grad, DTensor)
    return grad.to_local().clone()


def test_hsdp_replicas_hold_the_same_gradients() -> None:
    # Ranks 0 and 2 hold shard 0 in replicas 0 and 1 (mesh (2, 2): replicate, shard).
    locals_ = run_on_ranks(4, _replicas_agree)
    assert torch.equal(locals_[0], locals_[2])
    assert torch.equal(locals_[1], locals_[3])


def _reduction_bytes(rank: int, world_size: int, mode: str | None) -> int:
    model = _sharded((world_size,), mode, dim=64, reshard_after_forward=False)
    torch.manual_seed(rank)
    x = torch.randn(8, 7)
    model(x).pow(2).mean().backward()  # a first step: lazy init, buffers
    model.zero_grad()
    loss = model(x).pow(2).mean()  # parameters stay gathered: backward only reduces
    # The reductions alone: the step check's message at the end of backward (a few dozen
    # bytes, tested in tests/core/runtime/test_step_check.py) is not theirs.
    set_step_checks(False)
    try:
        before = _wchar()
        loss.backward()
        return _wchar() - before
    finally:
        set_step_checks(True)


_GROUPS = 4  # MLPNet's three blocks and its root
_HEADER_BYTES = 160  # gloo's framing of one message: 144 bytes measured here


def _planned_bytes(world: int, mode: str | None) -> int:
    """The planner's bytes of the backward's reductions (the step ``_reduction_bytes`` counts)."""
    from shardkit.core import ReducePrecision
    from shardkit.tools.plan.options import PlanOptions
    from shardkit.tools.plan.planner import plan
    from shardkit.tools.records import Phase

    def model() -> nn.Module:
        with torch.device("meta"):
            built = models.MLPNet(dim=64)
        return built

    options = PlanOptions(
        reshard_after_forward=False,
        backend="gloo",
        inputs=lambda: torch.zeros(8, 7, device="meta"),
        reduce_precision=None if mode is None else ReducePrecision(**MODES[mode]),
    )
    planned = plan(model, world_size=world, options=options)
    return sum(
        c.sent_bytes
        for c in planned.schedule
        if c.phase is Phase.BACKWARD and c.kind == "reduce_scatter"
    )


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_on_the_wire(world: int) -> None:
    counted = {
        mode: max(run_on_ranks(world, _reduction_bytes, mode=mode))
        for mode in (None, "bf16", "int8")
    }
    fp32, bf16, int8 = counted[None], counted["bf16"], counted["int8"]
    assert fp32 > 100_000  # the reductions' bytes are what is counted
    # Every mode sends one message per group to each peer; gloo frames each with a header of
    # its own (tens of bytes), the same in every mode: allowed beside the payload's ratio.
    headers = _HEADER_BYTES * _GROUPS * (world - 1)
    assert bf16 <= 0.50 * fp32 + headers, (bf16, fp32)
    assert int8 <= 0.26 * fp32 + headers, (int8, fp32)
    for mode, nbytes in counted.items():  # the planner predicts the payload, headers aside
        planned = _planned_bytes(world, mode)
        assert planned <= nbytes <= planned + headers, (mode, planned, nbytes)


def _sr_grads(rank: int, world_size: int, seed: int) -> torch.Tensor:
    from shardkit.core import ReducePrecision

    model = _sharded((2,), None)
    _fsdp(model).set_reduce_precision(
        ReducePrecision(wire_dtype=torch.bfloat16, stochastic_rounding=True, seed=seed)
    )
    grads = [_grads(model, step, rank) for step in range(2)]
    return torch.cat([g.flatten() for step in grads for g in step.values()])


def test_stochastic_rounding_is_reproducible_from_its_seed() -> None:
    first = run_on_ranks(2, _sr_grads, seed=5)[0]
    again = run_on_ranks(2, _sr_grads, seed=5)[0]
    other = run_on_ranks(2, _sr_grads, seed=6)[0]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def _checked(
    rank: int, world_size: int, action: Literal["warn", "raise"], tolerance: float
) -> list[str]:
    from shardkit.core import NumericsCheckError, ReducePrecision

    model = _sharded((2,), None)
    policy = ReducePrecision(
        wire_dtype=torch.int8, check_every=1, check_tolerance=tolerance, check_action=action
    )
    _fsdp(model).set_reduce_precision(policy)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("shardkit.core.engine.reduce.precision")
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        _grads(model, 0, rank)
    except NumericsCheckError as error:
        seen.append(f"raised: {error}")
        model.reset_iter_state()
    finally:
        logger.removeHandler(handler)
    return seen


def test_the_numerics_check_warns_or_raises_on_every_rank() -> None:
    quiet = run_on_ranks(2, _checked, action="warn", tolerance=0.5)
    assert quiet == [[], []]
    warned = run_on_ranks(2, _checked, action="warn", tolerance=1e-9)
    assert all(len(w) >= 1 and "relative error" in w[0] for w in warned)
    raised = run_on_ranks(2, _checked, action="raise", tolerance=1e-9)
    assert all(r and r[0].startswith("raised: FSDP module") for r in raised)


def _refusal(call: Any, *args: Any) -> str:
    """The message of the error ``call(*args)`` raises, with its type."""
    try:
        call(*args)
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    raise AssertionError(f"{call} accepted {args}")


def _refusals(rank: int, world_size: int) -> list[str]:
    from shardkit.core import ReducePrecision, fully_shard

    policy = ReducePrecision(wire_dtype=torch.bfloat16)
    model = nn.Sequential(nn.Linear(4, 4, dtype=torch.complex64), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    plain, other = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))
    fully_shard(plain)
    fully_shard(other)
    _fsdp(plain).set_custom_reduce_scatter(object())
    _fsdp(other).set_reduce_precision(policy)
    return [
        _refusal(_fsdp(model).set_reduce_precision, policy),
        _refusal(_fsdp(plain).set_reduce_precision, policy),
        _refusal(_fsdp(other).set_custom_reduce_scatter, object()),
    ]


def test_a_policy_that_cannot_apply_is_refused_by_name() -> None:
    messages = run_on_ranks(2, _refusals)
    assert messages[0] == messages[1]
    complex_param, custom_first, custom_after = messages[0]
    assert complex_param.startswith("TypeError")
    assert "parameter weight" in complex_param and "complex64" in complex_param
    assert "FSDP module FSDPLinear" in complex_param
    assert custom_first.startswith("ValueError") and custom_after.startswith("ValueError")
    assert "custom reduce-scatter" in custom_first and "set_reduce_precision" in custom_first
    assert "custom reduce-scatter" in custom_after


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"wire_dtype": "float16"}, ValueError),
        ({"wire_dtype": torch.float16}, ValueError),
        ({"wire_dtype": 8}, TypeError),
        ({"wire_dtype": "float8_e4m3fn", "stochastic_rounding": True}, ValueError),
        ({"error_feedback": True}, ValueError),
        ({"wire_dtype": torch.int8, "block_size": 0}, ValueError),
        ({"wire_dtype": torch.int8, "check_every": -1}, ValueError),
        ({"wire_dtype": torch.int8, "check_action": "ignore"}, ValueError),
    ],
)
def test_a_bad_policy_is_refused(fields: dict[str, Any], error: type[Exception]) -> None:
    from shardkit.core import ReducePrecision

    with pytest.raises(error, match="ReducePrecision"):
        ReducePrecision(**fields)


def test_a_wire_dtype_this_torch_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.core import ReducePrecision

    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match="has no such dtype"):
        ReducePrecision(wire_dtype="float8_e4m3fn")


def test_one_fp32_sum_stays_flat_in_w_where_a_bf16_ring_grows() -> None:
    # The demo GPT's real gradients (2 layers, 64 wide), reduced with real arithmetic as each
    # collective would (benchmarks/reduce_precision_study.py): float64 is the reference.
    from benchmarks.reduce_precision_study import study

    rms = {(e.mode, e.world): e.rms for e in study((2, 64), small=True)}
    wire = rms[("bf16 wire, fp32 sum", 64)] / rms[("bf16 wire, fp32 sum", 2)]
    ring = rms[("bf16 ring", 64)] / rms[("bf16 ring", 2)]
    assert wire <= 1.25, rms  # one rounding per rank's row, whatever W
    assert ring >= 2.5, rms  # one rounding per hop: W-1 of them
    assert rms[("bf16 wire, fp32 sum", 64)] < rms[("bf16 ring", 64)] / 10


def _tracked_bytes(rank: int, world_size: int, mode: str | None) -> tuple[int, int]:
    """CommTracker's payload and wire bytes of the backward's reduce-scatters."""
    from shardkit.tools.track.comm import CommTracker

    model = _sharded((world_size,), mode, dim=64, reshard_after_forward=False)
    torch.manual_seed(rank)
    x = torch.randn(8, 7)
    model(x).pow(2).mean().backward()
    model.zero_grad()
    loss = model(x).pow(2).mean()
    with CommTracker() as comm:
        loss.backward()
    records = [c for c in comm.rank_report().collectives if c.kind == "reduce_scatter"]
    assert all(c.wire_bytes is not None for c in records)  # gloo's messages were seen
    return sum(c.sent_bytes for c in records), sum(c.wire_bytes or 0 for c in records)


@pytest.mark.parametrize("mode", [None, "bf16", "int8"])
def test_comm_tracker_reports_each_modes_bytes_as_planned(mode: str | None) -> None:
    sent, wire = run_on_ranks(2, _tracked_bytes, mode=mode)[0]
    planned = _planned_bytes(2, mode)
    assert sent == wire == planned, (sent, wire, planned)
