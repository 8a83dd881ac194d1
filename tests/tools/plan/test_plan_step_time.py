"""The step-time model: operator counts, the roofline, the overlap replay, calibration's cache.

Every expected figure is exact arithmetic on hand-made profiles (one FLOP or byte per
second); nothing depends on how fast this machine is. The model's ranking of measured step
times is benchmarks/bench_plan_time.py's (timings are too noisy for a unit test).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

from shardkit.tools.plan import (
    H100,
    H200,
    Hardware,
    Link,
    OpCost,
    Plan,
    PlanOptions,
    StepCosts,
    StepMark,
    estimate_step_time,
    plan,
)
from shardkit.tools.plan.cli import main
from shardkit.tools.plan.gpt import GPT, GPTConfig
from shardkit.tools.plan.records import CollectiveCall
from shardkit.tools.plan.timing.calibrate import CALIBRATION_FIELDS, calibrate
from shardkit.tools.plan.timing.calibrate_gloo import isotonic, measure_gloo
from shardkit.tools.plan.timing.calibrate_host import measure_fresh_alloc, measure_per_operator
from shardkit.tools.plan.timing.step_time import costs_seconds, op_seconds
from shardkit.tools.records import Phase

# The host measurements' module, for monkeypatching, by name.
calibrate_host = importlib.import_module("shardkit.tools.plan.timing.calibrate_host")

_M, _K, _N, _P = 16, 32, 24, 8


def _unit(*, overlap: bool = True, launch_s: float = 0.0) -> Hardware:
    """One FLOP per second in float32, two in bfloat16; a byte per second on memory and
    on the link, which has no latency."""
    link = Link(gbps=1e-9, latency_s=0.0)
    return Hardware(
        name="unit",
        matmul_flops={"float32": 1.0, "bfloat16": 2.0},
        memory_gbps={"float32": 1e-9},
        launch_s=launch_s,
        intra_node=link,
        inter_node=Link(gbps=0.5e-9, latency_s=3.0),
        ranks_per_node=2,
        overlap=overlap,
    )


def test_an_operator_takes_its_roofline_plus_its_launch() -> None:
    hw = _unit(launch_s=0.25)
    assert op_seconds(OpCost(10, 4, "float32"), hw) == 10.25  # bound by FLOPs
    assert op_seconds(OpCost(10, 4, "bfloat16"), hw) == 5.25  # twice the rate
    assert op_seconds(OpCost(2, 7, "float32", count=3), hw) == 3 * 7.25  # bound by bytes
    assert op_seconds(OpCost(0, 0, ""), hw) == 0.25  # a launch costs even when nothing moves
    assert costs_seconds((OpCost(1, 0, "float32"), OpCost(0, 2, "float32")), hw) == 3.5


def test_links_by_axis() -> None:
    hw = _unit()
    assert hw.link("dp", 2) is hw.intra_node
    assert hw.link("dp", 4) is hw.inter_node  # more ranks than a node
    assert hw.link("dp_shard", 4) is hw.intra_node
    assert hw.link("dp_replicate", 2) is hw.inter_node
    assert hw.inter_node.seconds(1) == 5.0  # latency 3 s, then half a byte per second


def _tiny_plan(**options: object) -> Plan:
    config = GPTConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8)
    inputs = PlanOptions(
        inputs=lambda: torch.zeros(2, 8, dtype=torch.long, device="meta"),
        backend="gloo",
        **options,  # type: ignore[arg-type]
    )
    return plan(lambda: GPT(config), world_size=2, options=inputs)


def _call(kind: str, group: str, sent: int, phase: Phase) -> CollectiveCall:
    return CollectiveCall(
        kind=kind, group=group, axis="dp", group_size=2, input_bytes=0, sent_bytes=sent, phase=phase
    )


def _hand_built() -> Plan:
    """Two groups, a and b: a gathered, then b prefetched under segment 0's compute; b's
    reduce-scatter under segment 0's backward, a's waited for at the end."""
    fwd, bwd = Phase.FORWARD, Phase.BACKWARD
    schedule = (
        _call("all_gather", "a", 2, fwd),
        _call("all_gather", "b", 2, fwd),
        _call("reduce_scatter", "b", 2, bwd),
        _call("reduce_scatter", "a", 2, bwd),
    )
    marks = (
        StepMark(kind="collective", phase=fwd, index=0),  # a: 0 -> 2
        StepMark(kind="wait", phase=fwd, group="a"),  # compute waits 2 s
        StepMark(kind="collective", phase=fwd, index=1),  # b: 2 -> 4
        StepMark(kind="compute", phase=fwd, index=0),  # 2 -> 3
        StepMark(kind="wait", phase=fwd, group="b"),  # waits 1 s
        StepMark(kind="compute", phase=fwd, index=1),  # 4 -> 7
        StepMark(kind="compute", phase=bwd, index=1),  # 7 -> 9
        StepMark(kind="collective", phase=bwd, index=2),  # b: 9 -> 11, hidden
        StepMark(kind="compute", phase=bwd, index=0),  # 9 -> 13
        StepMark(kind="collective", phase=bwd, index=3),  # a: 13 -> 15
        StepMark(kind="optimizer", phase=Phase.OPTIMIZER),  # waits 2 s, then 0.5 s
    )
    flop = OpCost(1, 0, "float32")
    costs = StepCosts(
        forward=((flop,), (dataclasses.replace(flop, count=3),)),
        backward=((OpCost(4, 0, "float32"),), (OpCost(2, 0, "float32"),)),
        optimizer=(OpCost(0, 1, "bfloat16"),),  # no bfloat16 memory figure: float32's
    )
    return dataclasses.replace(_tiny_plan(), schedule=schedule, marks=marks, costs=costs)


def test_the_replay_overlaps_prefetches_and_reductions() -> None:
    step = estimate_step_time(_hand_built(), _unit())
    assert step.compute_s == 10.0
    assert step.communication_s == 8.0
    assert step.exposed_communication_s == 5.0  # 2 + 1 waiting for gathers, 2 at the end
    assert step.optimizer_s == 1.0
    assert step.total_s == 16.0
    assert step.phases == {"forward": 7.0, "backward": 8.0, "optimizer": 1.0}
    assert step.kernels == 1 + 3 + 1 + 1 + 1


def test_without_overlap_every_collective_adds() -> None:
    step = estimate_step_time(_hand_built(), _unit(overlap=False))
    assert step.total_s == 10.0 + 8.0 + 1.0
    assert step.exposed_communication_s == step.communication_s == 8.0


def test_contention_takes_part_of_each_overlapped_collective_from_the_compute() -> None:
    step = estimate_step_time(_hand_built(), dataclasses.replace(_unit(), contention=0.5))
    # Each collective takes 1 s of its 2 from the compute where it is issued; a's gather is
    # waited for 1 s more, b's lands in time, and the end waits 1 s for a's reduction.
    assert step.total_s == 17.0
    assert step.exposed_communication_s == 6.0
    assert step.compute_s == 10.0


def test_the_engine_s_host_work_runs_before_each_collective() -> None:
    hw = dataclasses.replace(_unit(), collective_overhead_s=0.25)
    step = estimate_step_time(_hand_built(), hw)
    assert step.compute_s == 11.0  # four collectives' 0.25 s on the compute stream
    assert step.total_s == 17.0  # the issues a quarter late: b waits for them, a ends at 16


def test_large_engine_buffers_are_paged_in_where_the_host_maps_them_afresh() -> None:
    calls = tuple(dataclasses.replace(c, input_bytes=2) for c in _hand_built().schedule)
    timed = dataclasses.replace(_hand_built(), schedule=calls)
    base = _unit(overlap=False)
    paged = dataclasses.replace(base, fresh_alloc_bytes=4, fresh_alloc_gbps=1e-9)
    # An all-gather's unsharded parameters (2 ranks x 2 bytes) reach 4 bytes, its receive
    # buffer (2) does not; a reduce-scatter's input (2) and output (1) neither.
    extra = estimate_step_time(timed, paged).total_s - estimate_step_time(timed, base).total_s
    assert extra == pytest.approx(2 * 4.0)


def test_a_selective_checkpoint_s_policy_costs_per_operator_twice() -> None:
    checkpointed = _tiny_plan(checkpoint=(("blocks.1", "selective"),))
    assert checkpointed.costs is not None
    operators = sum(c.count for c in checkpointed.costs.modules["blocks.1"])
    hw = _unit(overlap=False)
    with_policy = dataclasses.replace(hw, selective_op_s=1e-3)
    extra = (
        estimate_step_time(checkpointed, with_policy).total_s
        - estimate_step_time(checkpointed, hw).total_s
    )
    assert extra == pytest.approx(2 * operators * 1e-3)
    full = _tiny_plan(checkpoint=(("blocks.1", "full"),))
    assert estimate_step_time(full, with_policy) == estimate_step_time(full, hw)


def _linear_costs() -> StepCosts:
    model_inputs = PlanOptions(inputs=lambda: torch.zeros(_M, _K, device="meta"))
    model = lambda: nn.Sequential(nn.Linear(_K, _N, bias=False), nn.Linear(_N, _P, bias=False))  # noqa: E731
    costs = plan(model, world_size=2, options=model_inputs).costs
    assert costs is not None
    return costs


def test_a_linear_layer_counts_2mnk_forward_and_twice_that_backward() -> None:
    costs = _linear_costs()
    forward = sum(c.flops * c.count for seg in costs.forward for c in seg)
    backward = sum(c.flops * c.count for seg in costs.backward for c in seg)
    first, second = 2 * _M * _K * _N, 2 * _M * _N * _P
    assert forward == first + second
    # The second layer makes its weight's and its input's gradients (2x its forward); the
    # first only its weight's, the model's input needing none.
    assert backward == first + 2 * second
    assert costs.modules["1"] == tuple(c for c in costs.modules["1"] if c.flops == second)
    assert {c.dtype for seg in costs.forward for c in seg if c.flops} == {"float32"}


def test_mixed_precision_matmuls_count_in_the_gather_dtype() -> None:
    p = _tiny_plan(param_dtype=torch.bfloat16)
    assert p.costs is not None
    dtypes = {c.dtype for seg in p.costs.forward for c in seg if c.flops}
    assert dtypes == {"bfloat16"}


def test_checkpointing_reruns_the_module_forward_in_its_backward_segment() -> None:
    hw = _unit(launch_s=1e-3)
    plain = _tiny_plan()
    assert plain.costs is not None
    base = estimate_step_time(plain, hw)
    block_flops = sum(c.flops * c.count for c in plain.costs.modules["blocks.1"])
    for mode in ("full", "selective"):
        checkpointed = _tiny_plan(checkpoint=(("blocks.1", mode),))
        costs = checkpointed.costs
        assert costs is not None
        timed = estimate_step_time(checkpointed, hw)
        # torch's checkpoint reruns the block in the meta backward: in the block's own
        # backward segment, and counted once (the total grows by exactly the rerun).
        (segment,) = [j for j, c in enumerate(costs.recompute) if c]
        assert segment == plain.costs.module_segment["blocks.1"]
        rerun_s = costs_seconds(costs.recompute[segment], hw)
        assert timed.recompute_s == pytest.approx(rerun_s)
        assert timed.total_s == pytest.approx(base.total_s + rerun_s)
        assert timed.kernels > base.kernels
        rerun = costs.recompute[segment]
        rerun_flops = sum(c.flops * c.count for c in rerun)
        if mode == "full":
            # The block's forward again, attention included, up to its last saved tensor:
            # torch's checkpoint stops there (the MLP's output projection saves nothing its
            # backward needs from the rerun).
            assert any(c.attention for c in rerun)
            assert 0 < rerun_flops < block_flops
        else:  # selective keeps the matrix multiplies' and attention's outputs
            assert rerun_flops == 0
    with pytest.raises(ValueError, match=r"blocks\.7"):
        estimate_step_time(_tiny_plan(checkpoint=(("blocks.7", "full"),)), hw)


def test_offload_copies_shards_in_and_runs_the_optimizer_on_the_host() -> None:
    hw = dataclasses.replace(
        _unit(), host_link=Link(gbps=1e-9, latency_s=0.0), host_memory_gbps=1e-9
    )
    timed = estimate_step_time(_tiny_plan(offload=True), hw)
    plain = estimate_step_time(_tiny_plan(), hw)
    assert timed.offload_s > 0 and plain.offload_s == 0
    assert timed.total_s > plain.total_s


def test_an_untraced_plan_has_no_step_time() -> None:
    untraced = plan(lambda: nn.Linear(4, 4), world_size=2)
    with pytest.raises(ValueError, match="inputs"):
        estimate_step_time(untraced, _unit())


class _FakeMeasure:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, ranks: int, threads: int) -> dict[str, object]:
        self.calls += 1
        return _figures()


def _figures(**changes: object) -> dict[str, object]:
    """Figures a calibration could give: every rate 2, contention a half, two curves."""
    figures: dict[str, object] = dict.fromkeys(CALIBRATION_FIELDS, 2.0)
    figures["contention"] = 0.5
    figures["all_gather"] = [[4096, 1e-4], [1 << 20, 1e-3]]
    figures["reduce_scatter"] = [[4096, 2e-4], [1 << 20, 3e-3]]
    return figures | changes


def test_calibration_is_measured_once_then_cached(tmp_path: Path) -> None:
    path, fake = tmp_path / "hardware.json", _FakeMeasure()
    first = calibrate(2, path=path, measure_fn=fake)
    second = calibrate(2, path=path, measure_fn=fake)
    assert fake.calls == 1
    assert first == second
    assert first.overlap and first.contention == 0.5
    assert first.launch_s == 2.0 and first.flop_rate("bfloat16") == 2.0
    assert first.selective_op_s == first.collective_overhead_s == 2.0
    assert first.fresh_alloc_gbps == 2.0 and first.fresh_alloc_bytes == 2
    assert first.intra_node.seconds(4096, "all_gather") == 1e-4
    assert first.intra_node.seconds(1 << 20, "reduce_scatter") == 3e-3
    calibrate(2, path=path, measure_fn=fake, refresh=True)
    assert fake.calls == 2


def _cache_of(**changes: object) -> str:
    """A cache file whose one entry is this host's, with ``changes`` to good figures."""
    key = f"{socket.gethostname()}/threads=1/ranks=2/shapes=1024x512x512x8x4x128x32"
    return json.dumps({"version": 2, "entries": {key: _figures(**changes)}})


def test_a_good_cache_is_read_not_measured(tmp_path: Path) -> None:
    path, fake = tmp_path / "hardware.json", _FakeMeasure()
    path.write_text(_cache_of())
    assert calibrate(2, path=path, measure_fn=fake).contention == 0.5
    assert fake.calls == 0


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '{"version": 2, "entries": {"HOST": {"launch_s": NaN}}}',
        '{"version": 2, "entries": []}',
        "[" * 100000,
        _cache_of(launch_s=-1),
        _cache_of(launch_s=True),
        _cache_of(contention=1.5),  # a fraction
        _cache_of(collective_overhead_s=-1e-3),
        _cache_of(all_gather=[[4096, 1e-3], [1 << 20, 1e-4]]),  # cheaper for more bytes
        _cache_of(all_gather=[[1 << 20, 1e-3], [4096, 2e-3]]),  # bytes out of order
        _cache_of(reduce_scatter=[[4096, True]]),
        _cache_of(reduce_scatter=[[4096]]),
        _cache_of(reduce_scatter=[]),
        _cache_of(reduce_scatter=[[i + 1, 1.0] for i in range(300)]),  # too many points
        _cache_of(all_gather=None),
    ],
)
def test_a_bad_cache_is_measured_again(tmp_path: Path, text: str) -> None:
    path, fake = tmp_path / "hardware.json", _FakeMeasure()
    path.write_text(text)
    calibrate(2, path=path, measure_fn=fake)
    assert fake.calls == 1
    assert json.loads(path.read_text())["version"] == 2


def test_a_measured_curve_is_interpolated_between_its_points() -> None:
    link = Link(gbps=1.0, latency_s=1.0, curves={"all_gather": ((10, 1.0), (20, 3.0))})
    assert link.seconds(4, "all_gather") == 1.0  # below the first: its start-up
    assert link.seconds(15, "all_gather") == 2.0
    assert link.seconds(40, "all_gather") == 6.0  # past the last: its rate
    assert link.seconds(10, "reduce_scatter") == 1.0 + 10 / 1e9  # no curve: latency + rate


def test_isotonic_pools_adjacent_violators() -> None:
    assert isotonic([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert isotonic([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    assert isotonic([1.0, 2.0]) == [1.0, 2.0]


def test_the_host_figures_are_measured() -> None:
    per_operator = measure_per_operator()
    assert 0 < per_operator["launch_s"] < 1e-2
    assert per_operator["selective_op_s"] >= 0
    assert calibrate_host.fresh_seconds(1 << 20) >= 0


@pytest.mark.parametrize("threshold", [40 << 20, 1 << 20, None])
def test_the_size_the_host_maps_afresh_is_found_by_bisection(
    monkeypatch: pytest.MonkeyPatch, threshold: int | None
) -> None:
    """A host that pages in allocations from ``threshold`` bytes at 1 GB/s (None: never)."""

    def paged_in(nbytes: int) -> float:
        return nbytes / 1e9 if threshold is not None and nbytes >= threshold else 0.0

    monkeypatch.setattr(calibrate_host, "fresh_seconds", paged_in)
    fresh = measure_fresh_alloc()
    if threshold is None:
        assert fresh == {"fresh_alloc_gbps": 0.0, "fresh_alloc_bytes": 0.0}
        return
    assert fresh["fresh_alloc_gbps"] == pytest.approx(1.0)
    assert threshold <= fresh["fresh_alloc_bytes"] <= threshold + (256 << 10)


def test_gloo_is_timed_between_processes() -> None:
    figures = measure_gloo(2, sizes=(4096, 1 << 16), repeats=1)
    for kind in ("all_gather", "reduce_scatter"):
        (small_bytes, small_s), (large_bytes, large_s) = figures[kind]
        assert (small_bytes, large_bytes) == (4096, 1 << 16)
        assert 0 < small_s <= large_s  # made monotone
    assert 0 <= figures["contention"] <= 1
    assert figures["collective_overhead_s"] >= 0
    with pytest.raises(ValueError, match="2 ranks"):
        measure_gloo(1)


def test_the_cli_prints_the_step_time(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["shardkit.tools.examples:gpt_small", "--world-size", "8", "--hardware", "h100"]
    argv += ["--inputs", "shardkit.tools.examples:gpt_small_inputs"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step_time"]["hardware"]["name"] == "H100"
    assert data["step_time"]["total_s"] > data["step_time"]["optimizer_s"] > 0
    assert main(argv) == 0
    assert "Step time on H100" in capsys.readouterr().out
    assert main(argv[:5]) == 1  # no inputs: nothing to time
    assert "inputs" in capsys.readouterr().err


def test_the_marks_replay_every_collective_and_segment_once_in_order() -> None:
    p = _tiny_plan(param_dtype=torch.bfloat16)
    assert p.costs is not None
    issued = [m.index for m in p.marks if m.kind == "collective"]
    assert issued == list(range(len(p.schedule)))
    segments = len(p.costs.forward)
    forward = [m.index for m in p.marks if m.kind == "compute" and m.phase is Phase.FORWARD]
    backward = [m.index for m in p.marks if m.kind == "compute" and m.phase is Phase.BACKWARD]
    assert forward == list(range(segments))
    assert backward == list(range(segments - 1, -1, -1))
    assert [m.kind for m in p.marks][-1] == "optimizer"
    gathered = {c.group for c in p.schedule if c.kind == "all_gather"}
    assert {m.group for m in p.marks if m.kind == "wait"} == gathered


def test_the_published_profiles() -> None:
    nccl = dataclasses.replace(_tiny_plan(), options=PlanOptions(backend="nccl"))
    h100, h200 = estimate_step_time(nccl, H100), estimate_step_time(nccl, H200)
    assert H100.flop_rate("bfloat16") == H200.flop_rate("bfloat16") > H100.flop_rate("float32")
    assert H200.bytes_rate("float32") > H100.bytes_rate("float32")
    assert h200.total_s <= h100.total_s
    # A GPU hides collectives: the step is shorter than its parts in a row.
    assert h100.total_s < h100.compute_s + h100.communication_s + h100.optimizer_s
    assert H100.link("dp", 16) is H100.inter_node and H100.link("tp", 8) is H100.intra_node


def test_hsdp_reduces_across_replicas_after_the_shard_axis() -> None:
    bwd = Phase.BACKWARD
    shard = dataclasses.replace(_call("reduce_scatter", "a", 2, bwd), axis="dp_shard")
    replicas = dataclasses.replace(_call("all_reduce", "a", 1, bwd), axis="dp_replicate")
    marks = (
        StepMark(kind="collective", phase=bwd, index=0),  # 0 -> 2 in the node
        StepMark(kind="collective", phase=bwd, index=1),  # 2 -> 2 + 3 s latency + 2 s
        StepMark(kind="optimizer", phase=Phase.OPTIMIZER),
    )
    costs = StepCosts(forward=(), backward=())
    hsdp = dataclasses.replace(_tiny_plan(), schedule=(shard, replicas), marks=marks, costs=costs)
    step = estimate_step_time(hsdp, _unit())
    assert step.total_s == 7.0
    assert step.communication_s == 7.0
